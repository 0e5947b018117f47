//! The CPU kernels' narrower routes end to end, against the same sentence-transformers
//! references as `fixtures.rs`: with `cap_cpu_isa` at AVX-512 VNNI on a host with AMX
//! (int8's VNNI product, which AMX replaces there), at AVX2 (the f32 dense kernel's 6×16
//! tiles, panel attention on them, the 8-lane element-wise kernels, int8's portable
//! product) and at the baseline (candle's matmul, `gemm` attention, the auto-vectorized
//! bodies). On an AVX-512 host, CI's, these routes never run otherwise.
//!
//! Its own test binary, one test: the cap is process-wide and set before each load.

mod common;

use common::*;
use gpulane_models::{cap_cpu_isa, cpu_isa, CpuIsa, EmbedOptions, Embedder};

#[test]
fn every_narrower_route_matches_the_references() {
    for cap in [CpuIsa::Avx512Vnni, CpuIsa::Avx2, CpuIsa::Baseline] {
        if cap >= CpuIsa::detected() {
            eprintln!("{cap:?}: not below what this CPU has, already the default route");
            continue;
        }
        cap_cpu_isa(cap);
        assert_eq!(cpu_isa(), cap);
        let what = |name: &str| format!("{name} at {}", cap.as_str());

        // MiniLM: full-mask attention (panels at AVX2, gemm at the baseline), GELU.
        let r = reference(&fixtures().join("minilm/reference.json"));
        let mut model = Embedder::load(
            &minilm_dir(),
            &candle_core::Device::Cpu,
            candle_core::DType::F32,
        )
        .unwrap();
        let want = floats(&r["embeddings"]);
        let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
        assert_close(&out.vectors, &want, &what("minilm"));
        let one = model
            .embed(&texts(&r)[..1], EmbedOptions::default())
            .unwrap();
        assert_close(&one.vectors, &want[..1], &what("minilm, alone"));
        model.quantize_int8().unwrap();
        let q = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
        assert_cosine_at_least(&q.vectors, &want, 0.99, &what("minilm int8"));

        // Qwen3 (causal grouped-query attention, gated SiLU, Q/K norm and RoPE) and
        // ModernBERT (windowed layers, gated GELU).
        for name in ["tiny-qwen3-last", "tiny-modernbert-mean"] {
            let (r, model) = embedder_and_reference(&own_fixture(name), candle_core::DType::F32);
            let out = model.embed(&texts(&r), EmbedOptions::default()).unwrap();
            assert_close(&out.vectors, &floats(&r["embeddings"]), &what(name));
        }
    }
}
