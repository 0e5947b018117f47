// The f32 instances of models/cuda/kernels.cu under the SIMT emulator (simt.h), for the CPU
// tests in models/src/simt_tests.rs. Each entry point takes the launch geometry the Rust
// launcher computes (models/src/varlen.rs, `launch_geometry`), so the tests run the
// kernels the way models/src/cuda.rs launches them on a card.
#include "simt.h"
#include "kernels.cu"

extern "C" {

void gpulane_simt_varlen_attention(unsigned grid, unsigned block, unsigned dpl, const float* qkv,
                                   const uint32_t* keys, const float* rel, float* out,
                                   uint32_t n, uint32_t nq, uint32_t nkv, uint32_t d,
                                   uint32_t span) {
  auto run = [&](auto body) { simt::launch(grid, block, body); };
  switch (dpl) {
    case 1: run([&] { gpulane::varlen_attention<float, 1>(qkv, keys, rel, out, n, nq, nkv, d, span); }); break;
    case 2: run([&] { gpulane::varlen_attention<float, 2>(qkv, keys, rel, out, n, nq, nkv, d, span); }); break;
    case 4: run([&] { gpulane::varlen_attention<float, 4>(qkv, keys, rel, out, n, nq, nkv, d, span); }); break;
    case 8: run([&] { gpulane::varlen_attention<float, 8>(qkv, keys, rel, out, n, nq, nkv, d, span); }); break;
    default: std::abort();
  }
}

void gpulane_simt_add_norm(unsigned grid, unsigned block, const float* x, const float* res,
                           const float* params, float* out, uint32_t rows, uint32_t h,
                           float eps) {
  simt::launch(grid, block, [&] { gpulane::add_norm<float>(x, res, params, out, rows, h, eps); });
}

void gpulane_simt_bias_gelu(unsigned grid, unsigned block, const float* x, const float* bias,
                            float* out, uint32_t rows, uint32_t h) {
  simt::launch(grid, block, [&] { gpulane::bias_gelu<float>(x, bias, out, rows, h); });
}

void gpulane_simt_gated_gelu(unsigned grid, unsigned block, const float* x, float* out,
                             uint32_t rows, uint32_t i) {
  simt::launch(grid, block, [&] { gpulane::gated_gelu<float>(x, out, rows, i); });
}

}
