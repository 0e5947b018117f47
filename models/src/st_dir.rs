//! A sentence-transformers model directory: the transformer (through `model_dir`), then
//! the modules `modules.json` lists after it, each read from its own folder: `Pooling`
//! (`1_Pooling/config.json`), any `Dense` layers, and `Normalize`. A module gpulane does
//! not implement stops the model at load, naming it: run without it, the model would
//! return wrong vectors and no error.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::Deserialize;

use crate::{
    model_dir::{ModelDir, ModelIdentity},
    ModelError, Pooling,
};

/// What a sentence-transformers model directory declares, read from its own files:
/// `config.json` (architecture and sizes), `modules.json` (the pipeline),
/// `1_Pooling/config.json` (pooling), `sentence_bert_config.json` (`max_seq_length`) and
/// `config_sentence_transformers.json` (prompts). Nothing here is guessed from the
/// model's name.
pub struct SentenceTransformerDir {
    /// The directory.
    pub path: PathBuf,
    /// Summary for listings and activity results (its identity's dtype is f32 until an
    /// engine loads it in another).
    pub info: ModelInfo,
    pub(crate) model: ModelDir,
    pub(crate) dense: Vec<DenseSpec>,
}

/// A loaded model's description, as `gpulane models` and activity results show it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// Which model this is: family, revision, dtype, architecture, parameters.
    pub identity: ModelIdentity,
    /// How token vectors are pooled.
    pub pooling: Pooling,
    /// Whether the pipeline ends with L2 normalization.
    pub normalize: bool,
    /// Whether a prompt's tokens are pooled with the text's (`include_prompt` in the
    /// pooling config; false for Instructor-style models).
    pub include_prompt: bool,
    /// The `Dense` layers after pooling, as `in→out activation`, in order.
    pub dense: Vec<String>,
    /// Longest input in tokens, special tokens included; longer inputs are truncated.
    pub max_seq_length: usize,
    /// Embedding width: the last Dense layer's output, else the hidden size.
    pub dimensions: usize,
    /// The transformer's hidden size.
    pub hidden_size: usize,
    /// Transformer layers, for cost estimates.
    pub num_layers: usize,
    /// Attention heads, for cost estimates.
    pub num_heads: usize,
    /// Feed-forward width, for cost estimates: config.json's `intermediate_size`, doubled
    /// for gated feed-forwards (ModernBERT, Qwen3), whose up-projection is twice that wide.
    pub intermediate_size: usize,
    /// Most padded tokens in one forward pass (rows × longest row); bounds working memory.
    pub batch_tokens: usize,
    /// Named prompts from config_sentence_transformers.json (e.g. e5's
    /// `{"query": "query: ", "passage": "passage: "}`), empty when it has none.
    pub prompts: BTreeMap<String, String>,
    /// The prompt applied when a call names none (`default_prompt_name`).
    pub default_prompt_name: Option<String>,
}

/// Rows one forward pass may hold. Batches are length-sorted, so short texts share a
/// batch with many others and long ones with few.
pub(crate) const MAX_BATCH_ROWS: usize = 32;
/// Padded tokens (rows × longest row) one forward pass may hold: this bounds working
/// memory whatever the request looks like.
pub(crate) const MAX_BATCH_TOKENS: usize = 16_384;

/// The default token budget of one forward pass for inputs up to `max_len` tokens.
pub(crate) fn default_batch_tokens(max_len: usize) -> usize {
    MAX_BATCH_TOKENS.min(MAX_BATCH_ROWS * max_len)
}

impl ModelInfo {
    /// Most padded tokens in one forward pass of this model.
    pub fn max_batch_tokens(&self) -> usize {
        self.batch_tokens
    }

    /// Bytes the weights occupy on a device at `dtype_bytes` per parameter. Resident once
    /// per device while the model is loaded.
    pub fn weight_bytes(&self, dtype_bytes: u64) -> u64 {
        self.identity.parameters * dtype_bytes
    }

    /// Upper bound of the working memory of one forward pass at its largest batch, in
    /// bytes: with T = max batch tokens, L = max sequence length, H hidden, I intermediate,
    /// A heads, b bytes per value,
    /// `b * (T * (4H + 2I) + 2 * A * T * L)`: four hidden-sized activations alive at once
    /// (input, attention output, residual, norm), the feed-forward input and output, and
    /// attention scores plus their softmax (T/L rows of A × L × L each). ARCHITECTURE.md
    /// explains the terms; `--vram-cost` overrides it per model.
    pub fn working_bytes(&self, dtype_bytes: u64) -> u64 {
        working_bytes(
            self.batch_tokens,
            self.max_seq_length,
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            dtype_bytes,
        )
    }
}

/// The per-task working-memory formula of [`ModelInfo::working_bytes`], shared by every
/// model kind.
pub(crate) fn working_bytes(
    batch_tokens: usize,
    max_len: usize,
    hidden: usize,
    inter: usize,
    heads: usize,
    b: u64,
) -> u64 {
    let t = batch_tokens as u64;
    let (l, h, i, a) = (max_len as u64, hidden as u64, inter as u64, heads as u64);
    b * (t * (4 * h + 2 * i) + 2 * a * t * l)
}

#[derive(Deserialize)]
struct ModuleEntry {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: String,
}

#[derive(Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
    /// sentence-transformers 6 writes the mode by name (or a list of names) instead of
    /// the booleans above.
    #[serde(default)]
    pooling_mode: Option<serde_json::Value>,
    #[serde(default = "yes")]
    include_prompt: bool,
}

impl PoolingConfig {
    /// The modes turned on, by sentence-transformers 6's names.
    fn modes(&self) -> Vec<String> {
        if let Some(m) = &self.pooling_mode {
            return match m {
                serde_json::Value::String(s) => vec![s.clone()],
                serde_json::Value::Array(a) => a
                    .iter()
                    .map(|v| v.as_str().unwrap_or("?").to_owned())
                    .collect(),
                other => vec![other.to_string()],
            };
        }
        [
            (self.pooling_mode_cls_token, "cls"),
            (self.pooling_mode_mean_tokens, "mean"),
            (self.pooling_mode_max_tokens, "max"),
            (
                self.pooling_mode_mean_sqrt_len_tokens,
                "mean_sqrt_len_tokens",
            ),
            (self.pooling_mode_weightedmean_tokens, "weightedmean"),
            (self.pooling_mode_lasttoken, "lasttoken"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| (*name).to_owned())
        .collect()
    }
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct SbertConfig {
    max_seq_length: Option<usize>,
}

#[derive(Deserialize, Default)]
struct StConfig {
    #[serde(default)]
    prompts: BTreeMap<String, String>,
    #[serde(default)]
    default_prompt_name: Option<String>,
}

/// The activation of a sentence-transformers `Dense` module, by the class path its
/// config.json names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DenseAct {
    Identity,
    Tanh,
    Gelu,
    Relu,
    Sigmoid,
    Silu,
}

impl DenseAct {
    fn parse(name: &str) -> Option<Self> {
        // `torch.nn.modules.activation.Tanh`, `torch.nn.modules.linear.Identity`, ...
        Some(match name.rsplit('.').next()? {
            "Identity" => DenseAct::Identity,
            "Tanh" => DenseAct::Tanh,
            "GELU" => DenseAct::Gelu,
            "ReLU" => DenseAct::Relu,
            "Sigmoid" => DenseAct::Sigmoid,
            "SiLU" => DenseAct::Silu,
            _ => return None,
        })
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            DenseAct::Identity => "identity",
            DenseAct::Tanh => "tanh",
            DenseAct::Gelu => "gelu",
            DenseAct::Relu => "relu",
            DenseAct::Sigmoid => "sigmoid",
            DenseAct::Silu => "silu",
        }
    }
}

/// A `Dense` module's folder and configuration; `embedder` loads its weights.
#[derive(Debug, Clone)]
pub(crate) struct DenseSpec {
    pub dir: PathBuf,
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
    pub act: DenseAct,
}

#[derive(Deserialize)]
struct DenseConfig {
    in_features: usize,
    out_features: usize,
    #[serde(default = "yes")]
    bias: bool,
    #[serde(default = "tanh")]
    activation_function: String,
}

fn tanh() -> String {
    // sentence-transformers' Dense default.
    "torch.nn.modules.activation.Tanh".to_owned()
}

pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::File {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_owned(),
        source,
    })
}

/// A module's type without its package (`sentence_transformers.models.Pooling` →
/// `Pooling`; newer releases write `sentence_transformers.sentence_transformer.modules.…`).
fn short_kind(kind: &str) -> &str {
    kind.rsplit('.').next().unwrap_or(kind)
}

/// The module pipeline of `modules.json`, checked: a Transformer at the root, one
/// Pooling, Dense layers, and at most one Normalize, last.
struct Pipeline {
    pooling_dir: PathBuf,
    dense: Vec<DenseSpec>,
    normalize: bool,
}

fn pipeline(path: &Path) -> Result<Pipeline, ModelError> {
    let modules_path = path.join("modules.json");
    let modules: Vec<ModuleEntry> = read_json(&modules_path)?;
    let refuse = |reason: String| ModelError::Unsupported {
        path: modules_path.clone(),
        reason,
    };
    let mut pooling_dir = None;
    let mut dense = Vec::new();
    let mut normalize = false;
    for (i, m) in modules.iter().enumerate() {
        let kind = short_kind(&m.kind);
        if normalize {
            return Err(refuse(format!(
                "module {i} ({}) comes after Normalize; gpulane runs Normalize last",
                m.kind
            )));
        }
        match kind {
            "Transformer" if i == 0 && m.path.is_empty() => {}
            "Transformer" => {
                return Err(refuse(format!(
                    "module {i} is a Transformer in {:?}; gpulane runs one Transformer, the model directory itself, first",
                    m.path
                )))
            }
            _ if i == 0 => {
                return Err(refuse(format!(
                    "the first module is {}; gpulane runs pipelines that start with a Transformer",
                    m.kind
                )))
            }
            "Pooling" if pooling_dir.is_none() && dense.is_empty() => {
                pooling_dir = Some(path.join(&m.path));
            }
            "Dense" if pooling_dir.is_some() => dense.push(dense_spec(&path.join(&m.path))?),
            "Normalize" if pooling_dir.is_some() => normalize = true,
            _ => {
                return Err(refuse(format!(
                    "module {i} ({}, in {:?}) is not one gpulane runs here; it runs Transformer, then Pooling, then any Dense, then Normalize",
                    m.kind, m.path
                )))
            }
        }
    }
    let pooling_dir =
        pooling_dir.ok_or_else(|| refuse("modules.json has no Pooling module".to_owned()))?;
    Ok(Pipeline {
        pooling_dir,
        dense,
        normalize,
    })
}

/// Reads a Dense module's folder: its config.json, and checks that its weights are
/// safetensors (loading them is the embedder's, on its device).
fn dense_spec(dir: &Path) -> Result<DenseSpec, ModelError> {
    let config_path = dir.join("config.json");
    let c: DenseConfig = read_json(&config_path)?;
    let act = DenseAct::parse(&c.activation_function).ok_or_else(|| ModelError::Unsupported {
        path: config_path.clone(),
        reason: format!(
            "Dense activation {:?}; gpulane runs Identity, Tanh, GELU, ReLU, Sigmoid and SiLU",
            c.activation_function
        ),
    })?;
    if !dir.join("model.safetensors").is_file() {
        let pickle = dir.join("pytorch_model.bin");
        if pickle.is_file() {
            return Err(ModelError::Unsupported {
                path: pickle,
                reason: "PyTorch pickle weights for a Dense module; gpulane reads model.safetensors: convert the model once with `python -c \"from sentence_transformers import SentenceTransformer as S; S('DIR').save('DIR', safe_serialization=True)\"`".to_owned(),
            });
        }
        return Err(ModelError::File {
            path: dir.join("model.safetensors"),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        });
    }
    Ok(DenseSpec {
        dir: dir.to_owned(),
        in_features: c.in_features,
        out_features: c.out_features,
        bias: c.bias,
        act,
    })
}

impl SentenceTransformerDir {
    /// Reads the directory's configuration files. Fails naming the file that is missing or
    /// wrong, so a worker that cannot serve a declared model stops at start.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let unsupported = |reason: String| ModelError::Unsupported {
            path: path.to_owned(),
            reason,
        };
        let model = ModelDir::open(path)?;
        let architecture = model.config.architecture.as_str();
        if architecture.ends_with("ForSequenceClassification")
            || architecture.ends_with("ForCausalLM")
        {
            return Err(unsupported(format!(
                "architecture {architecture}; an embedder is the bare model (BertModel, XLMRobertaModel, DistilBertModel, MPNetModel, ModernBertModel, Qwen3Model, or their ForMaskedLM)"
            )));
        }
        let shape = model.config.shape();
        let pipe = pipeline(path)?;
        let pooling_path = pipe.pooling_dir.join("config.json");
        let pooling_cfg: PoolingConfig = read_json(&pooling_path)?;
        let modes = pooling_cfg.modes();
        let pooling = match modes.as_slice() {
            [one] => match one.as_str() {
                "cls" => Pooling::Cls,
                "mean" => Pooling::Mean,
                "max" => Pooling::Max,
                "mean_sqrt_len_tokens" => Pooling::MeanSqrtLen,
                "lasttoken" => Pooling::LastToken,
                other => {
                    return Err(ModelError::Unsupported {
                        path: pooling_path,
                        reason: format!(
                            "pooling mode {other:?}; gpulane pools cls, mean, max, mean_sqrt_len_tokens or lasttoken"
                        ),
                    })
                }
            },
            _ => {
                return Err(ModelError::Unsupported {
                    path: pooling_path,
                    reason: format!(
                        "pooling modes {modes:?}; gpulane supports exactly one"
                    ),
                })
            }
        };
        let mut width = shape.hidden;
        for d in &pipe.dense {
            if d.in_features != width {
                return Err(ModelError::Unsupported {
                    path: d.dir.join("config.json"),
                    reason: format!(
                        "in_features {} does not match the {width} values it receives",
                        d.in_features
                    ),
                });
            }
            width = d.out_features;
        }

        // sentence_bert_config.json's max_seq_length, else (sentence-transformers 6 no
        // longer writes it there) the tokenizer's model_max_length, within the positions.
        let sbert: SbertConfig = read_json(&path.join("sentence_bert_config.json"))?;
        let tok_config = path.join("tokenizer_config.json");
        let tokenizer_max = if tok_config.is_file() {
            let t: serde_json::Value = read_json(&tok_config)?;
            t["model_max_length"].as_u64().map(|m| m as usize)
        } else {
            None
        };
        let positions = shape.max_positions;
        let max_seq_length = sbert
            .max_seq_length
            .or(tokenizer_max)
            .unwrap_or(positions)
            .min(positions);
        let st_config = path.join("config_sentence_transformers.json");
        let st: StConfig = if st_config.is_file() {
            read_json(&st_config)?
        } else {
            StConfig::default()
        };
        if let Some(name) = &st.default_prompt_name {
            if !st.prompts.contains_key(name) {
                return Err(ModelError::Unsupported {
                    path: st_config,
                    reason: format!("default_prompt_name {name:?} is not one of its prompts"),
                });
            }
        }
        let info = ModelInfo {
            identity: model.identity(candle_core::DType::F32)?,
            pooling,
            normalize: pipe.normalize,
            include_prompt: pooling_cfg.include_prompt,
            dense: pipe
                .dense
                .iter()
                .map(|d| format!("{}→{} {}", d.in_features, d.out_features, d.act.as_str()))
                .collect(),
            max_seq_length,
            dimensions: width,
            hidden_size: shape.hidden,
            num_layers: shape.layers,
            num_heads: shape.heads,
            intermediate_size: shape.ffn,
            prompts: st.prompts,
            default_prompt_name: st.default_prompt_name,
            batch_tokens: default_batch_tokens(max_seq_length),
        };
        Ok(Self {
            path: path.to_owned(),
            info,
            model,
            dense: pipe.dense,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, file: &str, text: &str) {
        let p = dir.join(file);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn modules(entries: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let list: Vec<String> = entries
            .iter()
            .enumerate()
            .map(|(i, (kind, path))| {
                format!(r#"{{"idx": {i}, "name": "{i}", "path": "{path}", "type": "sentence_transformers.models.{kind}"}}"#)
            })
            .collect();
        write(dir.path(), "modules.json", &format!("[{}]", list.join(",")));
        dir
    }

    #[test]
    fn an_unknown_module_is_refused_naming_it_and_the_file() {
        let dir = modules(&[
            ("Transformer", ""),
            ("Pooling", "1_Pooling"),
            ("LayerNorm", "2_LayerNorm"),
        ]);
        let err = pipeline(dir.path()).err().unwrap().to_string();
        assert!(
            err.contains("LayerNorm") && err.contains("modules.json"),
            "{err}"
        );
    }

    #[test]
    fn a_dense_module_with_pickle_weights_is_refused_naming_the_file() {
        let dir = modules(&[
            ("Transformer", ""),
            ("Pooling", "1_Pooling"),
            ("Dense", "2_Dense"),
        ]);
        write(
            dir.path(),
            "2_Dense/config.json",
            r#"{"in_features": 4, "out_features": 2, "bias": true, "activation_function": "torch.nn.modules.activation.Tanh"}"#,
        );
        write(dir.path(), "2_Dense/pytorch_model.bin", "x");
        let err = pipeline(dir.path()).err().unwrap().to_string();
        assert!(err.contains("2_Dense/pytorch_model.bin"), "{err}");
        assert!(err.contains("safe_serialization=True"), "{err}");
    }

    #[test]
    fn dense_activations_are_read_from_their_class_path() {
        for (name, want) in [
            ("torch.nn.modules.activation.Tanh", DenseAct::Tanh),
            ("torch.nn.modules.linear.Identity", DenseAct::Identity),
            ("torch.nn.modules.activation.GELU", DenseAct::Gelu),
            ("torch.nn.modules.activation.ReLU", DenseAct::Relu),
        ] {
            assert_eq!(DenseAct::parse(name), Some(want), "{name}");
        }
        assert_eq!(
            DenseAct::parse("torch.nn.modules.activation.Softplus"),
            None
        );
    }

    #[test]
    fn normalize_must_come_last() {
        let dir = modules(&[
            ("Transformer", ""),
            ("Pooling", "1_Pooling"),
            ("Normalize", "2"),
            ("Pooling", "3"),
        ]);
        let err = pipeline(dir.path()).err().unwrap().to_string();
        assert!(err.contains("after Normalize"), "{err}");
    }
}
