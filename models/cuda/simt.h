// Just enough of CUDA's execution model, on CPU threads, to run models/cuda/kernels.cu's
// kernel bodies in the CPU tests: every thread of a block is an OS thread, 32 to a warp,
// and `__shfl_xor_sync` really exchanges values between the lanes of a warp (through a
// slot per lane and a barrier), so a wrong lane mask, reduction or per-lane index gives a
// wrong answer here as it would on a card. Blocks run one after another.
//
// What it does not model: shared memory and __syncthreads (the kernels use neither),
// memory ordering between warps, and f16/bf16 arithmetic (only f32 instances are built).
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace simt {

struct Warp {
  std::barrier<> bar{32};
  uint64_t slot[32];
};

inline thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Warp* warp = nullptr;
inline thread_local unsigned lane = 0;

// Runs `kernel()` as `grid` blocks of `block` threads (a multiple of 32).
template <class F>
void launch(unsigned grid, unsigned block, F kernel) {
  for (unsigned b = 0; b < grid; ++b) {
    std::vector<std::unique_ptr<Warp>> warps;
    for (unsigned w = 0; w < (block + 31) / 32; ++w) warps.push_back(std::make_unique<Warp>());
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
      threads.emplace_back([&, t] {
        thread_idx = {t, 0, 0};
        block_idx = {b, 0, 0};
        block_dim = {block, 1, 1};
        grid_dim = {grid, 1, 1};
        warp = warps[t / 32].get();
        lane = t % 32;
        kernel();
        // A lane that has finished no longer holds the others at a shuffle.
        warp->bar.arrive_and_drop();
      });
    }
    for (auto& t : threads) t.join();
  }
}

}  // namespace simt

#define threadIdx simt::thread_idx
#define blockIdx simt::block_idx
#define blockDim simt::block_dim
#define gridDim simt::grid_dim
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict

template <class T>
T __shfl_xor_sync(unsigned /*mask*/, T v, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "one slot per lane");
  uint64_t mine = 0;
  std::memcpy(&mine, &v, sizeof(T));
  simt::warp->slot[simt::lane] = mine;
  simt::warp->bar.arrive_and_wait();
  const uint64_t theirs = simt::warp->slot[simt::lane ^ (unsigned)lane_mask];
  simt::warp->bar.arrive_and_wait();
  T out;
  std::memcpy(&out, &theirs, sizeof(T));
  return out;
}
