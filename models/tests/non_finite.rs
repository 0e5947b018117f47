//! A model whose output is not finite fails the call as `NonFiniteOutput`, naming the
//! input, instead of handing NaN on (JSON would carry it as nulls). The fixtures are copies
//! of tiny models with one token's embedding row set to NaN, so that only texts holding
//! that word go wrong, in f32 and in int8 (where the NaN reaches the row quantizer).

mod common;

use std::path::Path;

use common::*;
use gpulane_models::{
    DType, EmbedOptions, Engine, EngineDevice, EngineOptions, ModelError, Progress,
};

/// The word whose embedding row is poisoned, and a text holding it.
const WORD: &str = "the";

/// A copy of fixture `name` whose word embedding row for [`WORD`] is NaN.
fn poisoned(name: &str, tensor: &str) -> tempfile::TempDir {
    let tmp = copy_dir(&fixtures().join(name));
    let vocab = std::fs::read_to_string(tmp.path().join("vocab.txt")).unwrap();
    let id = vocab
        .lines()
        .position(|w| w == WORD)
        .unwrap_or_else(|| panic!("{WORD:?} is not in {name}'s vocabulary"));
    let file = tmp.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let t = &header[tensor];
    assert_eq!(t["dtype"], "F32", "{name}: {tensor}");
    let hidden = t["shape"][1].as_u64().unwrap() as usize;
    let start = 8 + len + t["data_offsets"][0].as_u64().unwrap() as usize + id * hidden * 4;
    for v in bytes[start..start + hidden * 4].chunks_exact_mut(4) {
        v.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&file, bytes).unwrap();
    tmp
}

fn engine(dir: &Path, int8: bool) -> Engine {
    Engine::start(
        "poisoned",
        dir,
        &EngineDevice::Cpu,
        EngineOptions {
            dtype: DType::F32,
            int8,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Owned strings, as the engine takes them.
fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// The call with the poisoned word fails naming its text and precision, not retryable;
/// a call without it, sent at the same time (so batched into the same passes), gets
/// finite vectors; the engine keeps serving after it.
#[test]
fn a_nan_embedding_fails_its_call_naming_the_text() {
    let dir = poisoned("tiny-bert-cls", "embeddings.word_embeddings.weight");
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (int8, precision) in [(false, "f32"), (true, "int8")] {
        let e = engine(dir.path(), int8);
        let progress = Progress::default();
        let (bad, good) = rt.block_on(async {
            tokio::join!(
                e.embed(
                    strings(&["a cat sat", "on the mat", "the end"]),
                    EmbedOptions::default(),
                    &progress,
                ),
                e.embed(
                    strings(&["a cat sat", "no such word"]),
                    EmbedOptions::default(),
                    &progress
                ),
            )
        });
        match bad {
            Err(err @ ModelError::NonFiniteOutput { .. }) => {
                let text = err.to_string();
                assert!(!err.is_retryable(), "{text}");
                assert!(
                    text.contains("texts[1]") && text.contains(precision),
                    "{text}"
                );
                assert!(
                    text.contains("checkpoint"),
                    "f32's fix names the checkpoint: {text}"
                );
            }
            other => panic!("{precision}: the poisoned call gave {other:?}"),
        }
        let good = good.unwrap_or_else(|err| panic!("{precision}: the clean call failed: {err}"));
        assert!(good.vectors.iter().flatten().all(|v| v.is_finite()));
        let again = rt
            .block_on(e.embed(strings(&["a cat sat"]), EmbedOptions::default(), &progress))
            .unwrap();
        assert_eq!(again.vectors[0], good.vectors[0], "{precision}");
    }
}

/// A reranker's poisoned document is named as `documents[i]`.
#[test]
fn a_nan_score_fails_its_call_naming_the_document() {
    let dir = poisoned(
        "tiny-cross-encoder",
        "bert.embeddings.word_embeddings.weight",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let e = engine(dir.path(), false);
    let err = rt
        .block_on(e.score(
            "a question".into(),
            strings(&["a cat sat", "no dog", "on the mat"]),
            &Progress::default(),
            0,
        ))
        .expect_err("the poisoned document must fail the call");
    assert!(
        matches!(err, ModelError::NonFiniteOutput { .. })
            && err.to_string().contains("documents[2]"),
        "{err}"
    );
}
