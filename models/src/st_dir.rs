use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{backbone::Family, ModelError, Pooling};

/// What a sentence-transformers model directory declares, read from its own files:
/// `config.json` (architecture and sizes), `modules.json` (is there a `Normalize`
/// module?), `1_Pooling/config.json` (pooling) and `sentence_bert_config.json`
/// (`max_seq_length`). Nothing here is guessed from the model's name.
#[derive(Debug, Clone)]
pub struct SentenceTransformerDir {
    /// The directory.
    pub path: PathBuf,
    /// Summary for listings and activity results.
    pub info: ModelInfo,
    pub(crate) family: Family,
    pub(crate) config: serde_json::Value,
}

/// A loaded model's description, as `gpulane models` and activity results show it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// `architectures[0]` from config.json (e.g. `BertModel`).
    pub architecture: String,
    /// How token vectors are pooled.
    pub pooling: Pooling,
    /// Whether the pipeline ends with L2 normalization.
    pub normalize: bool,
    /// Longest input in tokens, special tokens included; longer inputs are truncated.
    pub max_seq_length: usize,
    /// Embedding width.
    pub dimensions: usize,
    /// Transformer layers, for cost estimates.
    pub num_layers: usize,
    /// Attention heads, for cost estimates.
    pub num_heads: usize,
    /// Feed-forward width, for cost estimates: config.json's `intermediate_size`, doubled
    /// for ModernBERT, whose gated up-projection is twice that wide.
    pub intermediate_size: usize,
    /// Floating-point parameters in model.safetensors.
    pub parameters: u64,
    /// Most padded tokens in one forward pass (rows × longest row); bounds working memory.
    pub batch_tokens: usize,
    /// Named prompts from config_sentence_transformers.json (e.g. e5's
    /// `{"query": "query: ", "passage": "passage: "}`), empty when it has none.
    pub prompts: std::collections::BTreeMap<String, String>,
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
        self.parameters * dtype_bytes
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
            self.dimensions,
            self.intermediate_size,
            self.num_heads,
            dtype_bytes,
        )
    }
}

/// The per-task working-memory formula of [`ModelInfo::working_bytes`], shared by every
/// encoder kind.
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

/// Counts the floating-point parameters in a safetensors file from its header alone.
pub(crate) fn count_parameters(path: &Path) -> Result<u64, ModelError> {
    use std::io::Read;
    let io = |source| ModelError::File {
        path: path.to_owned(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io)?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(ModelError::Unsupported {
            path: path.to_owned(),
            reason: format!("safetensors header of {len} bytes is not plausible"),
        });
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(io)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|source| ModelError::Json {
            path: path.to_owned(),
            source,
        })?;
    let mut total = 0u64;
    for (name, t) in &header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t["dtype"].as_str().unwrap_or("");
        if !matches!(dtype, "F32" | "F16" | "BF16" | "F64") {
            continue;
        }
        let n: u64 = t["shape"]
            .as_array()
            .map(|d| d.iter().map(|x| x.as_u64().unwrap_or(0)).product())
            .unwrap_or(0);
        total += n;
    }
    Ok(total)
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
}

#[derive(Deserialize)]
struct SbertConfig {
    max_seq_length: Option<usize>,
}

#[derive(Deserialize)]
struct ArchConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
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

impl SentenceTransformerDir {
    /// Reads the directory's configuration files. Fails naming the file that is missing or
    /// wrong, so a worker that cannot serve a declared model stops at start.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let unsupported = |reason: String| ModelError::Unsupported {
            path: path.to_owned(),
            reason,
        };
        let arch: ArchConfig = read_json(&path.join("config.json"))?;
        let config: serde_json::Value = read_json(&path.join("config.json"))?;
        let model_type = arch.model_type.clone().unwrap_or_else(|| "bert".to_owned());
        let family = Family::of(&model_type).ok_or_else(|| {
            unsupported(format!(
                "model_type {model_type:?}; supported embedders: bert, xlm-roberta, modernbert"
            ))
        })?;
        let architecture = arch
            .architectures
            .first()
            .cloned()
            .unwrap_or_else(|| "BertModel".to_owned());
        if !matches!(
            architecture.as_str(),
            "BertModel"
                | "BertForMaskedLM"
                | "XLMRobertaModel"
                | "RobertaModel"
                | "XLMRobertaForMaskedLM"
                | "ModernBertModel"
                | "ModernBertForMaskedLM"
        ) {
            return Err(unsupported(format!(
                "architecture {architecture}; an embedder is a BertModel, XLMRobertaModel or ModernBertModel"
            )));
        }
        let dim = |key: &str| -> Result<usize, ModelError> {
            config[key]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| unsupported(format!("config.json has no {key}")))
        };

        let modules: Vec<ModuleEntry> = read_json(&path.join("modules.json"))?;
        let normalize = modules.iter().any(|m| m.kind.ends_with("models.Normalize"));
        let pooling_dir = modules
            .iter()
            .find(|m| m.kind.ends_with("models.Pooling"))
            .map(|m| m.path.clone())
            .ok_or_else(|| unsupported("modules.json has no Pooling module".to_owned()))?;
        let pooling_cfg: PoolingConfig = read_json(&path.join(pooling_dir).join("config.json"))?;
        let modes = [
            (pooling_cfg.pooling_mode_cls_token, Pooling::Cls),
            (pooling_cfg.pooling_mode_mean_tokens, Pooling::Mean),
            (pooling_cfg.pooling_mode_max_tokens, Pooling::Max),
            (
                pooling_cfg.pooling_mode_mean_sqrt_len_tokens,
                Pooling::MeanSqrtLen,
            ),
        ];
        let chosen: Vec<Pooling> = modes.iter().filter(|(on, _)| *on).map(|m| m.1).collect();
        let pooling = match chosen.as_slice() {
            [one] => *one,
            _ => {
                return Err(unsupported(format!(
                    "pooling config enables {} modes; gpulane supports exactly one",
                    chosen.len()
                )))
            }
        };

        let sbert: SbertConfig = read_json(&path.join("sentence_bert_config.json"))?;
        let positions = family.max_positions(&config);
        let max_seq_length = sbert.max_seq_length.unwrap_or(positions).min(positions);
        let info = ModelInfo {
            architecture,
            pooling,
            normalize,
            max_seq_length,
            dimensions: dim("hidden_size")?,
            num_layers: dim("num_hidden_layers")?,
            num_heads: dim("num_attention_heads")?,
            intermediate_size: family.ffn_width(&config),
            parameters: count_parameters(&path.join("model.safetensors"))?,
            prompts: Default::default(),
            batch_tokens: default_batch_tokens(max_seq_length),
        };
        let st_config = path.join("config_sentence_transformers.json");
        let mut info = info;
        if st_config.is_file() {
            let v: serde_json::Value = read_json(&st_config)?;
            if let Some(p) = v["prompts"].as_object() {
                info.prompts = p
                    .iter()
                    .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_owned())))
                    .collect();
            }
        }
        Ok(Self {
            path: path.to_owned(),
            info,
            family,
            config,
        })
    }
}
