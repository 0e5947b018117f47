//! The f32 matrix products of MiniLM's layers through the `gemm` crate, as gpulane's
//! encoder calls it (candle's matmul and the CPU attention kernel use the same crate),
//! alone: GFLOP/s per shape, for comparing with the peer's BLAS on the same CPU
//! (`benches/matmul.py`, PyTorch's `linear`). benches/RESULTS.md has the figures.
//!
//!     RAYON_NUM_THREADS=2 cargo run --release --example gemm_probe

use std::time::Instant;

/// (tokens, in, out) of MiniLM's dense layers, for a full batch (32 × 256 tokens) and a
/// short-sentence one (32 × 25).
const SHAPES: [(usize, usize, usize); 6] = [
    (8192, 384, 1152),
    (8192, 384, 384),
    (8192, 384, 1536),
    (8192, 1536, 384),
    (800, 384, 1152),
    (800, 1536, 384),
];

fn main() {
    let threads = rayon::current_num_threads();
    for (m, k, n) in SHAPES {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        let mut c = vec![0f32; m * n];
        let mut run = || {
            // SAFETY: a is m × k, b is k × n and c is m × n, all row-major and distinct.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr(),
                    1,
                    k as isize,
                    b.as_ptr(),
                    1,
                    n as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(threads),
                )
            }
        };
        run();
        let reps = 10;
        let start = Instant::now();
        for _ in 0..reps {
            run();
        }
        let s = start.elapsed().as_secs_f64() / reps as f64;
        let gflops = 2.0 * (m * k * n) as f64 / s / 1e9;
        println!(
            "{m} x {k} x {n}: {:.2} ms, {gflops:.0} GFLOP/s ({threads} threads)",
            s * 1e3
        );
    }
}
