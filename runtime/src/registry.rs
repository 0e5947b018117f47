//! The models a worker serves: declared with `--model NAME=SOURCE` and/or a TOML file
//! (`--models-file`), each SOURCE resolved to a local directory: a path, a repo id already
//! in the local Hugging Face cache, or a repo id downloaded with hf-hub.

use std::path::{Path, PathBuf};

use gpulane_models::DType;
use gpulane_proto::{valid_model_name, MODEL_NAME_MAX};
use serde::Deserialize;

use crate::{
    config::{HubArgs, ModelArgs},
    RuntimeError,
};

/// Files a model directory may have; the required ones are checked when it loads.
const MODEL_FILES: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
];

/// One model as declared.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ModelDecl {
    /// The name activities select it by; when not given, the name the model gives itself
    /// (its README card's hub id, or config.json's `_name_or_path`), else its folder's.
    #[serde(default)]
    pub name: Option<String>,
    /// A directory, or a Hugging Face repo id (`org/name`).
    pub source: String,
    /// On cards: `f16` (default), `f32` or `bf16`.
    #[serde(default)]
    pub dtype: Option<String>,
    /// On CPU lanes: `f32` (default: `--cpu-dtype`) or `int8`.
    #[serde(default)]
    pub cpu_dtype: Option<String>,
    /// Which lanes serve it: `gpu`, `cpu` (default both).
    #[serde(default)]
    pub lanes: Option<Vec<String>>,
    /// Embedders: most padded tokens per forward pass.
    #[serde(default)]
    pub max_batch_tokens: Option<usize>,
    /// Per-task working memory on a card, overriding the estimate (e.g. "2GiB").
    #[serde(default)]
    pub vram_cost: Option<String>,
    /// Also serve the model's own queue (`gpu-tools@<name>`, `cpu-tools@<name>`);
    /// default: `--model-queues`.
    #[serde(default)]
    pub model_queue: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelsFile {
    #[serde(default, rename = "model")]
    models: Vec<ModelDecl>,
}

/// A model ready to load.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ModelSpec {
    pub name: String,
    pub source: String,
    pub path: PathBuf,
    /// What it computes in on a card; the CPU computes in f32.
    pub dtype: DType,
    /// On the CPU, its dense layers run in dynamic int8.
    pub cpu_int8: bool,
    pub on_gpu: bool,
    pub on_cpu: bool,
    pub batch_tokens: Option<usize>,
    pub vram_cost: Option<u64>,
    /// Serve `gpu-tools@<name>` / `cpu-tools@<name>` too.
    pub model_queue: bool,
}

fn decl_from_flag(s: &str) -> Result<ModelDecl, RuntimeError> {
    let (name, source) = match s.split_once('=') {
        Some((n, p)) if !n.is_empty() && !n.contains('/') => (Some(n.to_owned()), p.to_owned()),
        // A repo id names itself: `BAAI/bge-small-en` is `bge-small-en`.
        _ if looks_like_repo_id(s) => (s.rsplit('/').next().map(str::to_owned), s.to_owned()),
        // A directory is named at resolve time, from its own files (see `ModelDecl::name`).
        _ => (None, s.to_owned()),
    };
    Ok(ModelDecl {
        name,
        source,
        dtype: None,
        cpu_dtype: None,
        lanes: None,
        max_batch_tokens: None,
        vram_cost: None,
        model_queue: None,
    })
}

/// The name of a model declared without one, from its resolved directory.
fn derived_name(source: &str, path: &Path) -> Result<String, RuntimeError> {
    let config = std::fs::read_to_string(path.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let name_or_path = config.as_ref().and_then(|c| c["_name_or_path"].as_str());
    if let Some(n) = gpulane_models::self_name(path, name_or_path).filter(|n| valid_model_name(n)) {
        return Ok(n);
    }
    Path::new(source.trim_end_matches('/'))
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .filter(|f| !f.is_empty())
        .ok_or_else(|| {
            RuntimeError::Config(format!(
                "--model {source:?}: cannot name a model after this source; use NAME=SOURCE"
            ))
        })
}

/// Refuses a name that cannot name a queue or a metric label, or one already taken.
fn check_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<(), RuntimeError> {
    let mut seen = std::collections::HashSet::new();
    for name in names {
        if !valid_model_name(name) {
            return Err(RuntimeError::Config(format!(
                "model name {name:?}: use 1 to {MODEL_NAME_MAX} ASCII letters, digits, '-', '_' or '.' \
                 (it names a queue and a metric label); with --model write NAME=SOURCE"
            )));
        }
        if !seen.insert(name) {
            return Err(RuntimeError::Config(format!(
                "two models are named {name:?}: give each a distinct name (--model NAME=SOURCE, or name = \"...\" in the models file)"
            )));
        }
    }
    Ok(())
}

/// Every declared model, flags first, then the file's, in order; names must be unique.
pub(crate) fn declarations(args: &ModelArgs) -> Result<Vec<ModelDecl>, RuntimeError> {
    let mut decls: Vec<ModelDecl> = args
        .models
        .iter()
        .map(|m| decl_from_flag(m))
        .collect::<Result<_, _>>()?;
    if let Some(file) = &args.models_file {
        let text = std::fs::read_to_string(file).map_err(|source| RuntimeError::File {
            path: file.clone(),
            source,
        })?;
        let parsed: ModelsFile = toml::from_str(&text)
            .map_err(|e| RuntimeError::Config(format!("--models-file {}: {e}", file.display())))?;
        decls.extend(parsed.models);
    }
    for d in &mut decls {
        d.cpu_dtype.get_or_insert_with(|| args.cpu_dtype.clone());
    }
    if decls.is_empty() {
        return Err(RuntimeError::Config(
            "no model declared: pass --model NAME=SOURCE or --models-file FILE".to_owned(),
        ));
    }
    check_names(decls.iter().filter_map(|d| d.name.as_deref()))?;
    Ok(decls)
}

fn looks_like_repo_id(s: &str) -> bool {
    let mut parts = s.split('/');
    matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None)
        if !a.is_empty() && !b.is_empty() && !a.starts_with('.') && !s.starts_with('/'))
}

/// Resolves SOURCE to a directory: an existing path; else a repo id in the local cache
/// (`<hf_home>/hub`); else, unless offline, a download with hf-hub into that cache from
/// `hub.hf_endpoint` (default huggingface.co).
pub(crate) async fn resolve_source(source: &str, hub: &HubArgs) -> Result<PathBuf, RuntimeError> {
    let path = Path::new(source);
    if path.is_dir() {
        return Ok(path.to_owned());
    }
    if !looks_like_repo_id(source) {
        return Err(RuntimeError::Config(format!(
            "model source {source:?} is not a directory (nor a Hugging Face repo id like org/name)"
        )));
    }
    let cache_dir = hub.home().join("hub");
    let cached = hf_hub::Cache::new(cache_dir.clone())
        .model(source.to_owned())
        .get("config.json");
    if let Some(config) = cached {
        return Ok(config
            .parent()
            .expect("a cached file has a snapshot directory; this is a bug")
            .to_owned());
    }
    if hub.hf_offline {
        return Err(RuntimeError::Config(format!(
            "model {source:?} is not in the Hugging Face cache at {} and downloads are off (HF_HUB_OFFLINE): download it there, or pass a directory",
            cache_dir.display()
        )));
    }
    let mut api = hf_hub::api::tokio::ApiBuilder::new()
        .with_cache_dir(cache_dir.clone())
        .with_progress(false);
    if let Some(endpoint) = &hub.hf_endpoint {
        api = api.with_endpoint(endpoint.clone());
    }
    let api = api
        .build()
        .map_err(|e| RuntimeError::Config(format!("Hugging Face client: {e}")))?;
    let repo = api.model(source.to_owned());
    let mut dir = None;
    for file in MODEL_FILES {
        match repo.get(file).await {
            Ok(p) => {
                if *file == "config.json" {
                    dir = p.parent().map(Path::to_owned);
                }
            }
            // Optional files are simply absent; required ones fail at load, by name.
            Err(e) if *file == "config.json" => {
                return Err(RuntimeError::Config(format!(
                    "downloading {source}/config.json: {e}"
                )))
            }
            Err(_) => {}
        }
    }
    dir.ok_or_else(|| RuntimeError::Config(format!("downloading {source}: no config.json")))
}

/// Resolves and types every declaration; `model_queues` is the default of each one's
/// `model_queue`.
pub(crate) async fn resolve(
    decls: Vec<ModelDecl>,
    hub: &HubArgs,
    model_queues: bool,
) -> Result<Vec<ModelSpec>, RuntimeError> {
    let mut out: Vec<ModelSpec> = Vec::with_capacity(decls.len());
    for d in decls {
        let bad = |what: String| {
            RuntimeError::Config(format!(
                "model {:?}: {what}",
                d.name.as_deref().unwrap_or(&d.source)
            ))
        };
        // f16 on cards by default, as TEI and most sentence-transformers GPU users run
        // them: half the memory, and the tensor cores (gpu-check.sh measures its agreement
        // with f32 on a card).
        let dtype = match d.dtype.as_deref().unwrap_or("f16") {
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            other => return Err(bad(format!("dtype {other:?}; use f32, f16 or bf16"))),
        };
        let cpu_int8 = match d.cpu_dtype.as_deref().unwrap_or("f32") {
            "f32" => false,
            "int8" => true,
            other => return Err(bad(format!("cpu_dtype {other:?}; use f32 or int8"))),
        };
        let lanes = d
            .lanes
            .clone()
            .unwrap_or_else(|| vec!["gpu".into(), "cpu".into()]);
        if let Some(l) = lanes.iter().find(|l| *l != "gpu" && *l != "cpu") {
            return Err(bad(format!("lane {l:?}; use \"gpu\" and/or \"cpu\"")));
        }
        let vram_cost = d
            .vram_cost
            .as_deref()
            .map(crate::units::parse_bytes)
            .transpose()
            .map_err(|e| bad(format!("vram_cost: {e}")))?;
        let path = resolve_source(&d.source, hub).await?;
        let name = match d.name {
            Some(n) => n,
            None => derived_name(&d.source, &path)?,
        };
        out.push(ModelSpec {
            path,
            dtype,
            cpu_int8,
            on_gpu: lanes.iter().any(|l| l == "gpu"),
            on_cpu: lanes.iter().any(|l| l == "cpu"),
            batch_tokens: d.max_batch_tokens,
            vram_cost,
            model_queue: d.model_queue.unwrap_or(model_queues),
            name,
            source: d.source,
        });
    }
    check_names(out.iter().map(|m| m.name.as_str()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name)
    }

    #[test]
    fn flags_name_models_after_their_folder_or_explicitly() {
        let d = decl_from_flag("minilm=/m/all-MiniLM").unwrap();
        assert_eq!(
            (d.name.as_deref(), d.source.as_str()),
            (Some("minilm"), "/m/all-MiniLM")
        );
        assert_eq!(decl_from_flag("/m/all-MiniLM/").unwrap().name, None);
        assert_eq!(
            decl_from_flag("BAAI/bge-small-en").unwrap().name.as_deref(),
            Some("bge-small-en")
        );
        assert!(derived_name("/", Path::new("/nonexistent")).is_err());
    }

    /// A directory declared without a name takes the name its README card loads it by,
    /// else its folder's.
    #[test]
    fn unnamed_directories_take_the_name_the_model_gives_itself() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir(&model).unwrap();
        let src = model.to_str().unwrap();
        assert_eq!(derived_name(src, &model).unwrap(), "model");
        std::fs::write(
            model.join("README.md"),
            "model = SentenceTransformer('sentence-transformers/all-MiniLM-L6-v2')",
        )
        .unwrap();
        assert_eq!(derived_name(src, &model).unwrap(), "all-MiniLM-L6-v2");
    }

    #[tokio::test]
    async fn a_cpu_dtype_other_than_f32_or_int8_is_refused() {
        let mut d = decl_from_flag("m=/nonexistent").unwrap();
        d.cpu_dtype = Some("int4".into());
        let e = resolve(vec![d], &HubArgs::default(), false)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cpu_dtype \"int4\"") && e.contains("f32 or int8"),
            "{e}"
        );
    }

    #[test]
    fn repo_ids_are_told_from_paths() {
        assert!(looks_like_repo_id("BAAI/bge-m3"));
        assert!(!looks_like_repo_id("/abs/path"));
        assert!(!looks_like_repo_id("./rel"));
        assert!(!looks_like_repo_id("a/b/c"));
    }

    #[tokio::test]
    async fn a_repo_id_is_found_in_the_local_cache_without_network() {
        let home = tempfile::tempdir().unwrap();
        let repo = home.path().join("hub/models--acme--tiny");
        let snap = repo.join("snapshots/0123abcd");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
        for f in std::fs::read_dir(fixture("tiny-bert-cls"))
            .unwrap()
            .flatten()
        {
            if f.path().is_file() {
                std::fs::copy(f.path(), snap.join(f.file_name())).unwrap();
            }
        }
        let hub = HubArgs {
            hf_home: Some(home.path().to_owned()),
            hf_offline: true,
            hf_endpoint: None,
        };
        let dir = resolve_source("acme/tiny", &hub).await.unwrap();
        assert_eq!(dir, snap);
        let e = resolve_source("acme/missing", &hub)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not in the Hugging Face cache") && e.contains("HF_HUB_OFFLINE"),
            "{e}"
        );
    }

    #[test]
    fn a_toml_file_declares_models_with_options() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("models.toml");
        std::fs::write(
            &file,
            r#"
[[model]]
name = "e5"
source = "intfloat/multilingual-e5-small"
dtype = "f16"
lanes = ["gpu"]
max_batch_tokens = 8192
vram_cost = "1GiB"

[[model]]
name = "mini"
source = "/m/mini"
cpu_dtype = "f32"
"#,
        )
        .unwrap();
        let args = ModelArgs {
            models: vec!["a=/x".into()],
            models_file: Some(file),
            cpu_dtype: "int8".into(),
            hub: HubArgs {
                hf_offline: true,
                ..Default::default()
            },
        };
        let d = declarations(&args).unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(d[1].lanes.as_deref(), Some(&["gpu".to_owned()][..]));
        assert_eq!(d[1].vram_cost.as_deref(), Some("1GiB"));
        // `--cpu-dtype` is every model's default; a models file's `cpu_dtype` wins.
        let cpu: Vec<_> = d.iter().map(|d| d.cpu_dtype.as_deref()).collect();
        assert_eq!(cpu, [Some("int8"), Some("int8"), Some("f32")]);
        let dup = ModelArgs {
            models: vec!["e5=/x".into()],
            ..args
        };
        assert!(declarations(&dup)
            .unwrap_err()
            .to_string()
            .contains("two models are named"));
    }
}
