//! Model outputs against the references in `tests/fixtures/`, computed by
//! sentence-transformers on CPU in float32. Compared by cosine and max abs difference,
//! never exact floats.

mod common;

use std::path::Path;

use common::*;
use gpulane_models::{EmbedOptions, Embedder};

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
                ..Default::default()
            },
        )
        .unwrap();
    assert_close(
        &raw.vectors,
        &floats(&r["mean_pooled_unnormalized"]),
        "minilm mean pooled, unnormalized",
    );
}

/// The fused BERT steps (the attention block and the feed-forward, each per task of
/// rows) serve a batch only where it gives every thread two tasks. On one thread these 24
/// texts (989 rows, one batch) make eleven feed-forward tasks and several attention-block
/// ones, so the reference is met through the fused steps whatever the host's core count.
#[test]
fn minilm_matches_sentence_transformers_through_the_fused_steps() {
    let r = reference(&fixtures().join("minilm/reference.json"));
    let model = minilm_f32();
    let texts = texts(&r);
    let out = on_one_thread(|| model.embed(&texts, EmbedOptions::default()).unwrap());
    assert_close(
        &out.vectors,
        &floats(&r["embeddings"]),
        "minilm embeddings, one thread",
    );
}

/// The pre-norm families' gated feed-forward fused per task of rows (ModernBERT's
/// LayerNorm and GELU, Qwen3's RMSNorm and SiLU), and ModernBERT's attention block
/// (norm, QKV, RoPE, windowed or global attention, output, residual), which like BERT's
/// serve a batch only where it gives every thread two tasks: on one thread these
/// fixtures' texts, in one batch, make more than two. (Skipping the block's RoPE fails
/// this test.)
#[test]
fn pre_norm_families_match_through_the_fused_steps() {
    for name in ["tiny-modernbert-mean", "tiny-qwen3-last"] {
        let (r, model) = embedder_and_reference(&own_fixture(name), candle_core::DType::F32);
        let texts = texts(&r);
        let out = on_one_thread(|| model.embed(&texts, EmbedOptions::default()).unwrap());
        assert_close(&out.vectors, &floats(&r["embeddings"]), name);
    }
}

/// A text's vector does not depend on its batch-mates: embedded with all the fixture's
/// texts (on one thread, a batch the fused steps serve) and alone (too few rows for them:
/// the steps apart), each text gets the same bits. Holds the fused paths and their
/// fallbacks to the same kernels, the pre-norms included.
#[test]
fn a_texts_vector_does_not_depend_on_its_batch() {
    for name in ["tiny-modernbert-mean", "tiny-qwen3-last"] {
        let (r, model) = embedder_and_reference(&own_fixture(name), candle_core::DType::F32);
        same_alone_as_together(name, &model, &texts(&r));
    }
    let r = reference(&fixtures().join("minilm/reference.json"));
    same_alone_as_together("minilm", &minilm_f32(), &texts(&r));
}

/// Each of `texts` embedded alone gives the bits it gets among all of them (one thread).
fn same_alone_as_together(name: &str, model: &Embedder, texts: &[String]) {
    let together = on_one_thread(|| model.embed(texts, EmbedOptions::default()).unwrap());
    for (i, text) in texts.iter().enumerate() {
        let one = std::slice::from_ref(text);
        let alone = on_one_thread(|| model.embed(one, EmbedOptions::default()).unwrap());
        let same = alone.vectors[0]
            .iter()
            .zip(&together.vectors[i])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: text {i} alone differs from it in the batch");
    }
}

/// `f` on a pool of one thread, where a batch's tasks of rows number the same on any host.
fn on_one_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a 1-thread pool")
        .install(f)
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
                truncate: false,
                ..Default::default()
            },
        )
        .unwrap_err();
    match err {
        gpulane_models::ModelError::TextTooLong {
            field,
            index,
            tokens,
            limit,
        } => {
            assert_eq!((field, index), ("texts", long));
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

/// MiniLM on the CPU in f32.
fn minilm_f32() -> Embedder {
    Embedder::load(
        &minilm_dir(),
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap()
}

/// The varlen route cards take (one kernel launch per layer over packed rows, no
/// padding), through its kernel's CPU twin in f32: MiniLM (every key of the row) and
/// ModernBERT (its local layers' window) meet the references as tightly as the packed
/// kernel does, in one batch and one text at a time.
#[test]
fn varlen_route_matches_the_references_in_f32() {
    let r = reference(&fixtures().join("minilm/reference.json"));
    let mut model = minilm_f32();
    model.force_varlen_attention();
    let want = floats(&r["embeddings"]);
    let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
    assert_close(&out.vectors, &want, "minilm (varlen route)");
    let one = model
        .embed(&texts(&r)[..1], EmbedOptions::default())
        .unwrap();
    assert_close(&one.vectors, &want[..1], "minilm (varlen route), alone");

    let (r, mut model) = embedder_and_reference(
        &own_fixture("tiny-modernbert-mean"),
        candle_core::DType::F32,
    );
    model.force_varlen_attention();
    let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
    assert_close(
        &out.vectors,
        &floats(&r["embeddings"]),
        "tiny-modernbert-mean (varlen route)",
    );
}

/// ModernBERT with the hub's config spelling, no biases, mean pooling; its long texts
/// run past the sliding window of its local layers.
#[test]
fn tiny_modernbert_mean_matches_sentence_transformers() {
    let (r, model) = embedder_and_reference(
        &own_fixture("tiny-modernbert-mean"),
        candle_core::DType::F32,
    );
    assert_eq!(model.info().identity.architecture, "ModernBertModel");
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

/// The CPU's opt-in int8 (dense layers quantized dynamically) stays within cosine 0.99 of
/// the f32 reference, really differs from f32 (so it ran quantized), and names itself
/// `int8` in results.
#[test]
fn minilm_in_int8_stays_within_cosine_0_99_of_the_reference() {
    let r = reference(&fixtures().join("minilm/reference.json"));
    let mut model = minilm_f32();
    let texts = texts(&r);
    let exact = model.embed(&texts, EmbedOptions::default()).unwrap();
    model.quantize_int8().unwrap();
    assert_eq!(model.info().identity.precision(), "int8");
    let out = model.embed(&texts, EmbedOptions::default()).unwrap();
    assert_eq!(out.token_counts, exact.token_counts);
    let want = floats(&r["embeddings"]);
    assert_cosine_at_least(&out.vectors, &want, 0.99, "minilm int8");
    let moved = out
        .vectors
        .iter()
        .flatten()
        .zip(exact.vectors.iter().flatten())
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        moved > 1e-4,
        "int8 vectors equal f32 ones ({moved}): not quantized"
    );
}

/// Every family's dense layers quantize (BERT's own, ModernBERT's and Qwen3's `Linear`s,
/// the padded-attention inputs included) and stay within cosine 0.99 of f32.
#[test]
fn every_family_runs_in_int8_close_to_f32() {
    for dir in [
        fixtures().join("tiny-xlmr-mean"),
        own_fixture("tiny-mpnet-mean"),
        own_fixture("tiny-modernbert-mean"),
        own_fixture("tiny-qwen3-last"),
    ] {
        let (r, mut model) = embedder_and_reference(&dir, candle_core::DType::F32);
        let texts = texts(&r);
        let exact = model.embed(&texts, EmbedOptions::default()).unwrap();
        model.quantize_int8().unwrap();
        let out = model.embed(&texts, EmbedOptions::default()).unwrap();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        assert_cosine_at_least(&out.vectors, &exact.vectors, 0.99, &name);
        assert_ne!(out.vectors, exact.vectors, "{name}: not quantized");
    }
}

/// A cross-encoder's encoder quantizes too; its scores stay near the f32 reference.
#[test]
fn a_cross_encoder_in_int8_scores_near_f32() {
    let dir = fixtures().join("tiny-cross-encoder");
    let r = reference(&dir.join("reference.json"));
    let mut model = gpulane_models::CrossEncoder::load(
        &dir,
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap();
    model.quantize_int8().unwrap();
    assert_eq!(model.info().identity.precision(), "int8");
    for case in r["cases"].as_array().unwrap() {
        let query = case["query"].as_str().unwrap();
        let docs: Vec<String> = serde_json::from_value(case["documents"].clone()).unwrap();
        let scores: Vec<f32> = serde_json::from_value(case["scores"].clone()).unwrap();
        let out = model.score(query, &docs).unwrap();
        for (got, want) in out.logits.iter().zip(&scores) {
            let sig = 1.0 / (1.0 + (-got).exp());
            // Hidden size 32: each output sums 32 quantized products, not 384, so the
            // error averages out far less than in a real reranker (seen: up to 0.033).
            assert!((sig - want).abs() <= 0.05, "{query:?}: {sig} vs {want}");
        }
    }
}

/// int8 is a CPU f32 option: an engine asked for it in another dtype refuses to start,
/// saying why.
#[test]
fn int8_is_refused_outside_the_cpu_in_f32() {
    let e = gpulane_models::Engine::start(
        "m",
        &minilm_dir(),
        &gpulane_models::EngineDevice::Cpu,
        gpulane_models::EngineOptions {
            dtype: candle_core::DType::F16,
            int8: true,
            ..Default::default()
        },
    )
    .err()
    .expect("int8 in f16 must be refused");
    assert!(
        e.to_string()
            .contains("int8 quantizes f32 weights on the CPU"),
        "{e}"
    );
}
