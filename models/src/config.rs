//! config.json, parsed once into one typed struct per family, with each family's defaults
//! written here and nowhere else (the defaults transformers' config classes use), as
//! candle-transformers' configs do. A missing size is a parse error naming the field,
//! never a silent 0.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::{st_dir::read_json, ModelError};

/// The model families gpulane runs, chosen by config.json's `model_type`, never by the
/// model's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// BERT (all-MiniLM, bge, e5, ms-marco MiniLM rerankers).
    Bert,
    /// XLM-RoBERTa and RoBERTa (multilingual-e5, bge-m3's dense encoder, bge-reranker).
    XlmRoberta,
    /// DistilBERT (msmarco-distilbert, multi-qa-distilbert).
    DistilBert,
    /// MPNet (all-mpnet-base-v2, multi-qa-mpnet).
    MpNet,
    /// ModernBERT (modernbert-embed, gte-modernbert, gte-reranker-modernbert).
    ModernBert,
    /// Qwen3 decoders as embedders (Qwen3-Embedding-0.6B/4B/8B).
    Qwen3,
}

impl Family {
    /// The family's name in listings and activity results (config.json's `model_type`
    /// spelling).
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Bert => "bert",
            Family::XlmRoberta => "xlm-roberta",
            Family::DistilBert => "distilbert",
            Family::MpNet => "mpnet",
            Family::ModernBert => "modernbert",
            Family::Qwen3 => "qwen3",
        }
    }
}

/// BERT, XLM-RoBERTa and RoBERTa (transformers' `BertConfig` / `XLMRobertaConfig`).
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct BertConfig {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    #[serde(default = "d512")]
    pub max_position_embeddings: usize,
    #[serde(default = "d2")]
    pub type_vocab_size: usize,
    #[serde(default = "d1e12")]
    pub layer_norm_eps: f64,
    #[serde(default = "gelu")]
    pub hidden_act: String,
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    /// RoBERTa numbers positions after it; BERT ignores it.
    #[serde(default = "d1u")]
    pub pad_token_id: u32,
}

/// DistilBERT (`DistilBertConfig`): its own field names, no token types.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct DistilBertConfig {
    #[serde(default = "d768")]
    pub dim: usize,
    #[serde(default = "d12")]
    pub n_heads: usize,
    #[serde(default = "d6")]
    pub n_layers: usize,
    #[serde(default = "d3072")]
    pub hidden_dim: usize,
    pub vocab_size: usize,
    #[serde(default = "d512")]
    pub max_position_embeddings: usize,
    #[serde(default = "gelu")]
    pub activation: String,
}

/// MPNet (`MPNetConfig`): BERT-shaped, plus a relative position bias.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct MpNetConfig {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    #[serde(default = "d514")]
    pub max_position_embeddings: usize,
    #[serde(default = "d1e12")]
    pub layer_norm_eps: f64,
    #[serde(default = "gelu")]
    pub hidden_act: String,
    #[serde(default = "d32")]
    pub relative_attention_num_buckets: usize,
    #[serde(default = "d1u")]
    pub pad_token_id: u32,
}

/// ModernBERT (`ModernBertConfig`), in both spellings its configs come in (see
/// `encoder::modernbert`).
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ModernBertConfig {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    #[serde(default = "d8192")]
    pub max_position_embeddings: usize,
    #[serde(default = "d1e5")]
    pub norm_eps: f64,
    #[serde(default)]
    pub norm_bias: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "gelu")]
    pub hidden_activation: String,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default = "d3")]
    pub global_attn_every_n_layers: usize,
    #[serde(default)]
    pub global_rope_theta: Option<f64>,
    #[serde(default)]
    pub local_rope_theta: Option<f64>,
    #[serde(default = "d128")]
    pub local_attention: usize,
    #[serde(default)]
    pub rope_parameters: Value,
    #[serde(default)]
    pub rope_scaling: Value,
    #[serde(default = "cls")]
    pub classifier_pooling: String,
    #[serde(default = "gelu")]
    pub classifier_activation: String,
    #[serde(default)]
    pub classifier_bias: bool,
}

/// Qwen3 (`Qwen3Config`): a decoder; its head size is its own field, not hidden / heads.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Qwen3Config {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    #[serde(default = "d32768")]
    pub max_position_embeddings: usize,
    #[serde(default = "d1e6")]
    pub rms_norm_eps: f64,
    /// transformers before 5 wrote `rope_theta` at the top; 5.x writes `rope_parameters`.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_parameters: Value,
    #[serde(default)]
    pub rope_scaling: Value,
    #[serde(default = "silu")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
}

impl Qwen3Config {
    pub(crate) fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub(crate) fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The rotary base: `rope_parameters.rope_theta`, else `rope_theta`, else Qwen3's
    /// default.
    pub(crate) fn theta(&self) -> f64 {
        self.rope_parameters["rope_theta"]
            .as_f64()
            .or(self.rope_theta)
            .unwrap_or(1_000_000.0)
    }
}

/// config.json's family-specific part.
#[derive(Debug, Clone)]
pub(crate) enum Arch {
    Bert(BertConfig),
    XlmRoberta(BertConfig),
    DistilBert(DistilBertConfig),
    MpNet(MpNetConfig),
    ModernBert(ModernBertConfig),
    Qwen3(Qwen3Config),
}

/// The sizes every family has, under one spelling, for cost estimates and listings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    pub layers: usize,
    /// Feed-forward width that bounds working memory: doubled for gated feed-forwards
    /// (ModernBERT's `Wi`, Qwen3's gate and up projections), whose up-projection is twice
    /// `intermediate_size` wide.
    pub ffn: usize,
    /// Longest input in tokens the positions allow.
    pub max_positions: usize,
}

/// A parsed config.json.
#[derive(Debug, Clone)]
pub(crate) struct ModelConfig {
    /// `architectures[0]`, or the family's bare model when absent.
    pub architecture: String,
    pub arch: Arch,
    /// Labels of a classification head (`id2label`), 1 when none are declared.
    pub num_labels: usize,
    /// `_name_or_path`, as the saving library wrote it.
    pub name_or_path: Option<String>,
}

#[derive(Deserialize)]
struct Common {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default)]
    id2label: Option<serde_json::Map<String, Value>>,
    #[serde(default, rename = "_name_or_path")]
    name_or_path: Option<String>,
}

const FAMILIES: &str = "bert, xlm-roberta, roberta, distilbert, mpnet, modernbert, qwen3";

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub(crate) fn open(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let value: Value = read_json(&path)?;
        Self::parse(value, &path, dir)
    }

    fn parse(value: Value, path: &Path, dir: &Path) -> Result<Self, ModelError> {
        let json = |source| ModelError::Json {
            path: path.to_owned(),
            source,
        };
        let common: Common = serde_json::from_value(value.clone()).map_err(json)?;
        let model_type = common.model_type.as_deref().unwrap_or("bert");
        let v = value;
        let arch = match model_type {
            "bert" => Arch::Bert(serde_json::from_value(v).map_err(json)?),
            "xlm-roberta" | "roberta" => Arch::XlmRoberta(serde_json::from_value(v).map_err(json)?),
            "distilbert" => Arch::DistilBert(serde_json::from_value(v).map_err(json)?),
            "mpnet" => Arch::MpNet(serde_json::from_value(v).map_err(json)?),
            "modernbert" => Arch::ModernBert(serde_json::from_value(v).map_err(json)?),
            "qwen3" => Arch::Qwen3(serde_json::from_value(v).map_err(json)?),
            other => {
                return Err(ModelError::Unsupported {
                    path: path.to_owned(),
                    reason: format!("model_type {other:?}; gpulane runs {FAMILIES}"),
                })
            }
        };
        let config = Self {
            architecture: common.architectures.first().cloned().unwrap_or_default(),
            num_labels: common.id2label.map_or(1, |m| m.len().max(1)),
            name_or_path: common.name_or_path.filter(|n| !n.is_empty()),
            arch,
        };
        config.check(dir)?;
        Ok(config)
    }

    /// Refuses sizes no forward pass can use, naming them.
    fn check(&self, dir: &Path) -> Result<(), ModelError> {
        let s = self.shape();
        let (hidden, heads) = (s.hidden, s.heads);
        let bad = |reason: String| {
            Err(ModelError::Unsupported {
                path: dir.to_owned(),
                reason,
            })
        };
        if heads == 0 || hidden == 0 || s.layers == 0 {
            return bad(format!(
                "config.json states hidden size {hidden}, {heads} heads and {} layers; each must be at least 1",
                s.layers
            ));
        }
        match &self.arch {
            Arch::Qwen3(c) => {
                let kv = c.kv_heads();
                if kv == 0 || heads % kv != 0 {
                    return bad(format!(
                        "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
                    ));
                }
                if c.head_dim() % 2 != 0 {
                    return bad(format!(
                        "head_dim {} is odd; rotary embeddings turn pairs of values",
                        c.head_dim()
                    ));
                }
            }
            _ if hidden % heads != 0 => {
                return bad(format!(
                    "hidden size {hidden} is not a multiple of {heads} attention heads"
                ))
            }
            Arch::ModernBert(_) if (hidden / heads) % 2 != 0 => {
                return bad(format!(
                    "head size {} (hidden size {hidden} / {heads} heads) is odd; rotary embeddings turn pairs of values",
                    hidden / heads
                ))
            }
            _ => {}
        }
        Ok(())
    }

    pub(crate) fn family(&self) -> Family {
        match self.arch {
            Arch::Bert(_) => Family::Bert,
            Arch::XlmRoberta(_) => Family::XlmRoberta,
            Arch::DistilBert(_) => Family::DistilBert,
            Arch::MpNet(_) => Family::MpNet,
            Arch::ModernBert(_) => Family::ModernBert,
            Arch::Qwen3(_) => Family::Qwen3,
        }
    }

    /// The common sizes. Learned position tables bound the input: RoBERTa and MPNet
    /// number positions after the padding index, so `pad_token_id + 1` rows are not
    /// usable; rotary families state the length they were trained to.
    pub(crate) fn shape(&self) -> Shape {
        match &self.arch {
            Arch::Bert(c) => Shape {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                layers: c.num_hidden_layers,
                ffn: c.intermediate_size,
                max_positions: c.max_position_embeddings,
            },
            Arch::XlmRoberta(c) => Shape {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                layers: c.num_hidden_layers,
                ffn: c.intermediate_size,
                max_positions: c
                    .max_position_embeddings
                    .saturating_sub(c.pad_token_id as usize + 1),
            },
            Arch::DistilBert(c) => Shape {
                hidden: c.dim,
                heads: c.n_heads,
                layers: c.n_layers,
                ffn: c.hidden_dim,
                max_positions: c.max_position_embeddings,
            },
            Arch::MpNet(c) => Shape {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                layers: c.num_hidden_layers,
                ffn: c.intermediate_size,
                max_positions: c
                    .max_position_embeddings
                    .saturating_sub(c.pad_token_id as usize + 1),
            },
            Arch::ModernBert(c) => Shape {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                layers: c.num_hidden_layers,
                ffn: 2 * c.intermediate_size,
                max_positions: c.max_position_embeddings,
            },
            Arch::Qwen3(c) => Shape {
                hidden: c.hidden_size,
                heads: c.num_attention_heads,
                layers: c.num_hidden_layers,
                ffn: 2 * c.intermediate_size,
                max_positions: c.max_position_embeddings,
            },
        }
    }
}

fn d2() -> usize {
    2
}
fn d3() -> usize {
    3
}
fn d6() -> usize {
    6
}
fn d12() -> usize {
    12
}
fn d32() -> usize {
    32
}
fn d128() -> usize {
    128
}
fn d512() -> usize {
    512
}
fn d514() -> usize {
    514
}
fn d768() -> usize {
    768
}
fn d3072() -> usize {
    3072
}
fn d8192() -> usize {
    8192
}
fn d32768() -> usize {
    32768
}
fn d1u() -> u32 {
    1
}
fn d1e5() -> f64 {
    1e-5
}
fn d1e6() -> f64 {
    1e-6
}
fn d1e12() -> f64 {
    1e-12
}
fn gelu() -> String {
    "gelu".to_owned()
}
fn silu() -> String {
    "silu".to_owned()
}
fn cls() -> String {
    "cls".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ModelConfig, ModelError> {
        ModelConfig::parse(v, Path::new("m/config.json"), Path::new("m"))
    }

    #[test]
    fn a_missing_size_is_named_not_zero() {
        let err = parse(serde_json::json!({"model_type": "bert", "hidden_size": 32}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_attention_heads"), "{err}");
    }

    #[test]
    fn roberta_positions_start_after_padding() {
        let c = parse(serde_json::json!({
            "model_type": "xlm-roberta", "hidden_size": 32, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10,
            "max_position_embeddings": 514
        }))
        .unwrap();
        assert_eq!(c.shape().max_positions, 512);
        assert_eq!(c.family(), Family::XlmRoberta);
    }

    #[test]
    fn qwen3_heads_and_rope_defaults_and_spellings() {
        let base = serde_json::json!({
            "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 1,
            "intermediate_size": 8, "vocab_size": 10, "rope_theta": 5.0
        });
        let Arch::Qwen3(c) = parse(base.clone()).unwrap().arch else {
            panic!("not qwen3")
        };
        assert_eq!((c.kv_heads(), c.head_dim(), c.theta()), (2, 32, 5.0));
        let mut newer = base;
        newer["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 7.0});
        let Arch::Qwen3(c) = parse(newer.clone()).unwrap().arch else {
            panic!("not qwen3")
        };
        assert_eq!(c.theta(), 7.0);
        newer["num_key_value_heads"] = 3.into();
        assert!(parse(newer)
            .unwrap_err()
            .to_string()
            .contains("num_key_value_heads"));
    }

    /// ModernBERT rotates pairs of each head's values: an odd head size is refused at
    /// load, naming it, rather than reaching the attention kernels.
    #[test]
    fn modernbert_with_odd_heads_is_refused() {
        let config = |hidden: usize| {
            serde_json::json!({
                "model_type": "modernbert", "hidden_size": hidden, "num_attention_heads": 4,
                "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10
            })
        };
        assert!(parse(config(32)).is_ok());
        let err = parse(config(36)).unwrap_err().to_string();
        assert!(err.contains("head size 9") && err.contains("odd"), "{err}");
    }

    #[test]
    fn unknown_families_are_refused_naming_the_supported_ones() {
        let err = parse(serde_json::json!({"model_type": "t5"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("t5") && err.contains("mpnet"), "{err}");
    }
}
