//! The families beyond BERT, XLM-R and ModernBERT, against sentence-transformers'
//! references (`models/tests/data/make_tiny_families.py`, CPU, float32): MPNet,
//! DistilBERT, BERT with a Dense head, and Qwen3 (last token, instruction prompts, a
//! sharded bf16-stored checkpoint). Each runs on every attention route (the packed CPU
//! kernel, the padded path, and the varlen route cards take, through its kernel's CPU
//! twin) and in several groupings of mixed-length rows, so neither padding nor packing
//! can leak between rows unseen.

mod common;

use common::*;
use gpulane_models::{EmbedOptions, Embedder, Family, ModelError, Pooling};

/// Embeds the reference texts in one call, then in groups of five (other neighbours, other
/// padding), then in reverse order, on every attention route, and compares each to the
/// reference. Returns the reference and the model (packed route) for further checks.
fn check(name: &str, family: Family, pooling: Pooling) -> (serde_json::Value, Embedder) {
    let dir = own_fixture(name);
    for route in ["padded", "varlen", "packed"] {
        let (r, mut model) = embedder_and_reference(&dir, candle_core::DType::F32);
        match route {
            "padded" => model.force_padded_attention(),
            "varlen" => model.force_varlen_attention(),
            _ => {}
        }
        let what = format!("{name} ({route} route)");
        assert_eq!(model.info().identity.family, family, "{what}");
        assert_eq!(model.info().pooling, pooling, "{what}");
        assert_eq!(
            model.info().max_seq_length as u64,
            r["max_seq_length"].as_u64().unwrap()
        );
        let texts = texts(&r);
        let want = floats(&r["embeddings"]);
        let out = model.embed(&texts, EmbedOptions::default()).unwrap();
        let counts: Vec<usize> = serde_json::from_value(r["token_counts"].clone()).unwrap();
        assert_eq!(out.token_counts, counts, "{what}: token counts");
        assert!(
            counts.iter().min() < counts.iter().max(),
            "{what}: the texts must differ in length"
        );
        assert_close(&out.vectors, &want, &what);
        for (i, group) in texts.chunks(5).enumerate() {
            let got = model.embed(group, EmbedOptions::default()).unwrap();
            assert_close(&got.vectors, &want[i * 5..i * 5 + group.len()], &what);
        }
        let reversed: Vec<String> = texts.iter().rev().cloned().collect();
        let mut got = model
            .embed(&reversed, EmbedOptions::default())
            .unwrap()
            .vectors;
        got.reverse();
        assert_close(&got, &want, &format!("{what}, reversed"));
        if route == "packed" {
            return (r, model);
        }
    }
    unreachable!("the loop returns on its packed pass")
}

/// The reference's `prompt_name` prompt on its first texts gives `prompted_embeddings`.
fn check_prompted(r: &serde_json::Value, model: &Embedder, what: &str) {
    let name = r["prompt_name"].as_str().unwrap();
    let want = floats(&r["prompted_embeddings"]);
    let texts = texts(r)[..want.len()].to_vec();
    let opts = EmbedOptions {
        prompt: Some(model.info().prompts[name].clone()),
        ..Default::default()
    };
    let got = model.embed(&texts, opts).unwrap();
    assert_close(&got.vectors, &want, what);
    let plain = model.embed(&texts, EmbedOptions::default()).unwrap();
    assert!(
        cosine(&plain.vectors[0], &got.vectors[0]) < 0.9999,
        "{what}: the prompt must change the vectors"
    );
}

/// MPNet (all-mpnet-base-v2's architecture): relative position buckets, positions after
/// the padding index, mean pooling, Normalize; its prompt is left out of pooling
/// (`include_prompt: false`), as Instructor-style models ask.
#[test]
fn mpnet_mean_matches_sentence_transformers() {
    let (r, model) = check("tiny-mpnet-mean", Family::MpNet, Pooling::Mean);
    assert!(!model.info().include_prompt);
    check_prompted(&r, &model, "tiny-mpnet-mean with its query prompt");
}

/// DistilBERT (msmarco-distilbert's architecture): its own weight names, no token types,
/// CLS pooling, no Normalize.
#[test]
fn distilbert_cls_matches_sentence_transformers() {
    let (_, model) = check("tiny-distilbert-cls", Family::DistilBert, Pooling::Cls);
    assert!(!model.info().normalize);
}

/// BERT, mean pooling, a Dense(32→16, tanh) module, then Normalize, as
/// sentence-transformers 6.2 saves it (its new module paths and pooling config).
#[test]
fn bert_with_a_dense_head_matches_sentence_transformers() {
    let (_, model) = check("tiny-bert-dense", Family::Bert, Pooling::Mean);
    assert_eq!(model.info().dense, ["32→16 tanh"]);
    assert_eq!(model.info().dimensions, 16);
}

/// Qwen3 (Qwen3-Embedding's architecture): causal grouped-query attention, q/k norms,
/// RoPE, last-token pooling of the EOS the tokenizer appends, with and without its
/// instruction prompt.
#[test]
fn qwen3_last_token_matches_sentence_transformers() {
    let (r, model) = check("tiny-qwen3-last", Family::Qwen3, Pooling::LastToken);
    check_prompted(&r, &model, "tiny-qwen3-last with its query prompt");
}

/// A model whose config_sentence_transformers.json names a `default_prompt_name` gets
/// that prompt on calls that name none, and none with an explicit empty prompt.
#[test]
fn the_default_prompt_applies_when_a_call_names_none() {
    let tmp = copy_fixture("tiny-qwen3-last");
    let st = tmp.path().join("config_sentence_transformers.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&st).unwrap()).unwrap();
    cfg["default_prompt_name"] = "query".into();
    std::fs::write(&st, cfg.to_string()).unwrap();
    let (r, model) = embedder_and_reference(tmp.path(), candle_core::DType::F32);
    let want = floats(&r["prompted_embeddings"]);
    let texts = texts(&r)[..want.len()].to_vec();
    let got = model.embed(&texts, EmbedOptions::default()).unwrap();
    assert_close(&got.vectors, &want, "default prompt");
    let none = EmbedOptions {
        prompt: Some(String::new()),
        ..Default::default()
    };
    let got = model.embed(&texts, none).unwrap();
    assert_close(
        &got.vectors,
        &floats(&r["embeddings"])[..want.len()],
        "no prompt",
    );
}

/// A checkpoint in three bf16-stored shards (`model.safetensors.index.json`), upcast to
/// f32 at load.
#[test]
fn a_sharded_bf16_checkpoint_matches_sentence_transformers() {
    let (_, model) = check("tiny-qwen3-sharded", Family::Qwen3, Pooling::LastToken);
    let id = &model.info().identity;
    assert_eq!(id.dtype, candle_core::DType::F32);
    assert!(id.revision.starts_with("sha256:") && id.revision.len() == 7 + 64);
    assert!(id.parameters > 0);
}

/// A copy of one of this repository's fixtures in a temporary folder, to break on purpose.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    copy_dir(&own_fixture(name))
}

fn load_err(dir: &std::path::Path) -> String {
    match Embedder::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => {
            assert!(!e.is_retryable());
            e.to_string()
        }
    }
}

/// A module gpulane does not run stops the model at load, naming it and modules.json.
#[test]
fn an_unsupported_module_is_refused_at_load() {
    let tmp = copy_fixture("tiny-bert-dense");
    let modules = tmp.path().join("modules.json");
    let text = std::fs::read_to_string(&modules).unwrap().replace(
        "sentence_transformers.base.modules.dense.Dense",
        "sentence_transformers.models.WordWeights",
    );
    std::fs::write(&modules, text).unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains("WordWeights") && err.contains("modules.json"),
        "{err}"
    );
}

/// Weights only as a PyTorch pickle are refused naming the file and the conversion.
#[test]
fn pytorch_model_bin_is_refused_at_load() {
    let tmp = copy_fixture("tiny-distilbert-cls");
    std::fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
    std::fs::write(tmp.path().join("pytorch_model.bin"), b"not read").unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("pytorch_model.bin"), "{err}");
    assert!(err.contains("safe_serialization=True"), "{err}");
    assert!(matches!(
        Embedder::load(
            tmp.path(),
            &candle_core::Device::Cpu,
            candle_core::DType::F32
        ),
        Err(ModelError::Unsupported { .. })
    ));
}

/// A copy of fixture `name` whose tokenizer adds no special tokens, so "" has no tokens.
fn without_special_tokens(name: &str) -> tempfile::TempDir {
    let tmp = copy_fixture(name);
    let path = tmp.path().join("tokenizer.json");
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    t["post_processor"] = serde_json::Value::Null;
    std::fs::write(&path, t.to_string()).unwrap();
    tmp
}

/// A text with no tokens is refused, naming it, whatever the pooling: last-token pooling
/// took its neighbour's first token (and failed alone), and mean pooling gave zeros.
#[test]
fn a_text_of_no_tokens_is_refused_by_name() {
    let no_prompt = || EmbedOptions {
        prompt: Some(String::new()),
        ..Default::default()
    };
    for name in [
        "tiny-qwen3-last",
        "tiny-modernbert-mean",
        "tiny-distilbert-cls",
    ] {
        let tmp = without_special_tokens(name);
        let model = Embedder::load(
            tmp.path(),
            &candle_core::Device::Cpu,
            candle_core::DType::F32,
        )
        .unwrap();
        let texts = ["hello there", "", "and more"].map(String::from);
        let err = model.embed(&texts, no_prompt()).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::NoTokens {
                    field: "texts",
                    index: 1,
                    ..
                }
            ),
            "{name}: {err}"
        );
        assert!(!err.is_retryable(), "{name}");
        // The same tokenizer still embeds texts that have tokens.
        let ok = model.embed(&[texts[0].clone()], no_prompt()).unwrap();
        assert!(ok.vectors.len() == 1 && ok.token_counts[0] > 0, "{name}");
    }
}

/// A reranker's pair of empty texts has no token for its classifier either.
#[test]
fn a_reranker_pair_of_no_tokens_is_refused_by_name() {
    let tmp = without_special_tokens("tiny-modernbert-reranker");
    let model = gpulane_models::CrossEncoder::load(
        tmp.path(),
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap();
    let documents = ["a passage", ""].map(String::from);
    assert_eq!(model.score("q", &documents).unwrap().logits.len(), 2);
    let err = model.score("", &documents).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::NoTokens {
                field: "documents",
                index: 1,
                ..
            }
        ),
        "{err}"
    );
}
