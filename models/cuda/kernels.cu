// gpulane's own CUDA kernels: packed (varlen) attention and the fused element-wise steps
// of an encoder layer, for f32, f16 and bf16 storage (every sum and every exp in f32).
//
// Built two ways from this one file (models/build.rs):
// - by nvcc into PTX, with the `cuda` feature; candle loads the module on first use and
//   the driver compiles it for the card (models/src/cuda.rs launches the kernels);
// - by the host C++ compiler under models/cuda/simt.h, which runs each kernel body on CPU
//   threads, 32 to a warp, with real warp shuffles, so the CPU tests check these bodies
//   against the CPU kernels (models/src/simt_tests.rs). Only the f32 instances exist there.
//
// Every kernel is warp-per-item and uses nothing wider than a warp (no shared memory, no
// __syncthreads): a warp's 32 lanes exit together or not at all, which both the hardware
// and the emulator need for the full-mask shuffles.

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#endif

namespace gpulane {

__device__ __forceinline__ float to_f32(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
#ifdef __CUDACC__
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
#endif

// The sum of `v` over the warp, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// BERT's exact GELU, as torch's `gelu` (approximate="none").
__device__ __forceinline__ float gelu_erf(float v) {
  return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

// Self-attention of packed rows, without padding: one warp per (token, query head).
//
// qkv   [n, (nq + 2·nkv)·d]: each token's Q | K | V, Q already scaled by 1/√d.
// keys  [n, 2]: the packed token indices [lo, hi) that token t attends to, made by the host
//       (models/src/varlen.rs) from each row's start and length and the layer's mask (the
//       whole row, a window, or causal): all of this kernel's knowledge of rows.
// rel   span > 0: MPNet's relative bias, [nq, 2·span − 1], score(t, j) += rel[h][j − t +
//       span − 1] (j − t is the distance within the row, since both are in it); else unread.
// out   [n, nq·d]: the context of each token and head.
//
// Lane l holds dims l, l + 32, … of the head (DPL = ⌈d / 32⌉ of them). Keys go one at a
// time with an online softmax (running max m, running sum l, rescaled accumulator), so
// nothing of size n² or even of a row's length is ever stored.
template <typename T, int DPL>
__device__ __forceinline__ void varlen_attention(const T* __restrict__ qkv,
                                                 const uint32_t* __restrict__ keys,
                                                 const float* __restrict__ rel,
                                                 T* __restrict__ out, uint32_t n, uint32_t nq,
                                                 uint32_t nkv, uint32_t d, uint32_t span) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint64_t warp = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (warp >= (uint64_t)n * nq) return;  // the same for every lane of a warp
  const uint32_t t = (uint32_t)(warp / nq), h = (uint32_t)(warp % nq);
  const uint64_t width = (uint64_t)(nq + 2 * nkv) * d;
  const uint32_t kvh = h / (nq / nkv);  // grouped-query: nq / nkv query heads per K/V head
  const T* q = qkv + t * width + (uint64_t)h * d;
  const T* kcol = qkv + (uint64_t)(nq + kvh) * d;
  const T* vcol = qkv + (uint64_t)(nq + nkv + kvh) * d;
  float qv[DPL], acc[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const uint32_t c = lane + 32u * i;
    qv[i] = c < d ? to_f32(q[c]) : 0.0f;
    acc[i] = 0.0f;
  }
  const uint32_t lo = keys[2 * (uint64_t)t], hi = keys[2 * (uint64_t)t + 1];
  const float* bias = span ? rel + (uint64_t)h * (2 * span - 1) + (span - 1) : nullptr;
  float m = -INFINITY, l = 0.0f;
  for (uint32_t j = lo; j < hi; ++j) {
    const T* k = kcol + j * width;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const uint32_t c = lane + 32u * i;
      if (c < d) s += qv[i] * to_f32(k[c]);
    }
    s = warp_sum(s);
    if (bias) s += bias[(int64_t)j - (int64_t)t];
    const float m2 = fmaxf(m, s);
    const float corr = expf(m - m2);  // 0 for the first key (m = −∞)
    const float p = expf(s - m2);
    l = l * corr + p;
    const T* v = vcol + j * width;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const uint32_t c = lane + 32u * i;
      if (c < d) acc[i] = acc[i] * corr + p * to_f32(v[c]);
    }
    m = m2;
  }
  // Every token sees at least itself, so l > 0.
  const float inv = 1.0f / l;
  T* o = out + (uint64_t)t * nq * d + (uint64_t)h * d;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const uint32_t c = lane + 32u * i;
    if (c < d) o[c] = from_f32<T>(acc[i] * inv);
  }
}

// out = LayerNorm(x + bias + residual) · gamma + beta, one warp per row of h;
// params [3, h] = bias; gamma; beta. Mean first, then the variance about it (two passes
// over the row, which stays in L1), as the CPU kernel does.
template <typename T>
__device__ __forceinline__ void add_norm(const T* __restrict__ x, const T* __restrict__ res,
                                         const T* __restrict__ params, T* __restrict__ out,
                                         uint32_t rows, uint32_t h, float eps) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint64_t r = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (r >= rows) return;
  const T* xr = x + r * h;
  const T* rr = res + r * h;
  const T *bias = params, *gamma = params + h, *beta = params + 2 * (uint64_t)h;
  float sum = 0.0f;
  for (uint32_t c = lane; c < h; c += 32) sum += to_f32(xr[c]) + to_f32(bias[c]) + to_f32(rr[c]);
  const float mean = warp_sum(sum) / (float)h;
  float sq = 0.0f;
  for (uint32_t c = lane; c < h; c += 32) {
    const float v = to_f32(xr[c]) + to_f32(bias[c]) + to_f32(rr[c]) - mean;
    sq += v * v;
  }
  const float rstd = 1.0f / sqrtf(warp_sum(sq) / (float)h + eps);
  T* o = out + r * h;
  for (uint32_t c = lane; c < h; c += 32) {
    const float v = to_f32(xr[c]) + to_f32(bias[c]) + to_f32(rr[c]) - mean;
    o[c] = from_f32<T>(v * rstd * to_f32(gamma[c]) + to_f32(beta[c]));
  }
}

// out = GELU(x + bias), bias [h] broadcast over rows; one warp per row.
template <typename T>
__device__ __forceinline__ void bias_gelu(const T* __restrict__ x, const T* __restrict__ bias,
                                          T* __restrict__ out, uint32_t rows, uint32_t h) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint64_t r = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (r >= rows) return;
  for (uint32_t c = lane; c < h; c += 32)
    out[r * h + c] = from_f32<T>(gelu_erf(to_f32(x[r * h + c]) + to_f32(bias[c])));
}

// out [rows, i] = GELU(x[:, :i]) · x[:, i:], x [rows, 2i] (ModernBERT's gated feed-forward);
// one warp per row.
template <typename T>
__device__ __forceinline__ void gated_gelu(const T* __restrict__ x, T* __restrict__ out,
                                           uint32_t rows, uint32_t i) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint64_t r = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (r >= rows) return;
  const T* xr = x + r * 2 * i;
  for (uint32_t c = lane; c < i; c += 32)
    out[r * i + c] = from_f32<T>(gelu_erf(to_f32(xr[c])) * to_f32(xr[i + c]));
}

}  // namespace gpulane

#ifdef __CUDACC__
// The entry points models/src/cuda.rs loads by name: `<kernel>_<dtype>` (candle's dtype
// names), and for attention `_<DPL>` too.
#define GPULANE_VARLEN(TY, NAME, DPL)                                                       \
  extern "C" __global__ void varlen_attention_##NAME##_##DPL(                               \
      const TY* qkv, const uint32_t* keys, const float* rel, TY* out, uint32_t n,           \
      uint32_t nq, uint32_t nkv, uint32_t d, uint32_t span) {                               \
    gpulane::varlen_attention<TY, DPL>(qkv, keys, rel, out, n, nq, nkv, d, span);           \
  }
#define GPULANE_ROWS(TY, NAME)                                                              \
  GPULANE_VARLEN(TY, NAME, 1)                                                               \
  GPULANE_VARLEN(TY, NAME, 2)                                                               \
  GPULANE_VARLEN(TY, NAME, 4)                                                               \
  GPULANE_VARLEN(TY, NAME, 8)                                                               \
  extern "C" __global__ void add_norm_##NAME(const TY* x, const TY* res, const TY* params,  \
                                             TY* out, uint32_t rows, uint32_t h,            \
                                             float eps) {                                   \
    gpulane::add_norm<TY>(x, res, params, out, rows, h, eps);                               \
  }                                                                                         \
  extern "C" __global__ void bias_gelu_##NAME(const TY* x, const TY* bias, TY* out,         \
                                              uint32_t rows, uint32_t h) {                  \
    gpulane::bias_gelu<TY>(x, bias, out, rows, h);                                          \
  }                                                                                         \
  extern "C" __global__ void gated_gelu_##NAME(const TY* x, TY* out, uint32_t rows,         \
                                               uint32_t i) {                                \
    gpulane::gated_gelu<TY>(x, out, rows, i);                                               \
  }
GPULANE_ROWS(float, f32)
GPULANE_ROWS(__half, f16)
GPULANE_ROWS(__nv_bfloat16, bf16)
#endif
