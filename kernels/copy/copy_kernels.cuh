// sparda-jax copy engine: the copy kernels, shared by the XLA FFI handlers (gather_blocks.cu) and
// the standalone overlap probe (scripts/probes/overlap_probe.cu), so the probe times the kernels
// the engine runs.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "copy_tasks.h"  // kMaxPayloads, kMaxGroup

struct KernelPayloads {  // by value: a launch's payloads in constant memory
  const uint4* from[kMaxPayloads];
  uint4* to[kMaxPayloads];
  int64_t vecs[kMaxPayloads];  // 16-byte vectors per block
  int n;
};

// Loads of kUnroll vectors per thread are issued before their stores: a read over PCIe takes
// about a microsecond, and one vector in flight per thread would cap a CTA at 4 KB per latency.
constexpr int kUnroll = 4;

__global__ void copy_blocks_kernel(KernelPayloads p, const int32_t* __restrict__ src,
                                   const int32_t* __restrict__ dst, int64_t n_tasks, int64_t n_from, int64_t n_to,
                                   unsigned int* started) {
  if (started != nullptr && threadIdx.x == 0) {  // announce that this CTA holds its SM
    atomicAdd(started, 1u);
    __threadfence_system();
  }
  const int64_t step = blockDim.x;
  for (int64_t t = blockIdx.x; t < n_tasks; t += gridDim.x) {
    const int32_t s = src[t];
    const int32_t d = dst[t];
    if (s < 0 || s >= n_from || d < 0 || d >= n_to) continue;
    for (int j = 0; j < p.n; ++j) {
      const int64_t vecs = p.vecs[j];
      const uint4* __restrict__ a = p.from[j] + static_cast<int64_t>(s) * vecs;
      uint4* __restrict__ b = p.to[j] + static_cast<int64_t>(d) * vecs;
      int64_t i = threadIdx.x;
      for (; i + (kUnroll - 1) * step < vecs; i += kUnroll * step) {
        uint4 r[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) r[u] = a[i + u * step];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) b[i + u * step] = r[u];
      }
      for (; i < vecs; i += step) b[i] = a[i];
    }
  }
}

// Deeper: the tasks of a group of `group` (<= kMaxGroup) are copied as one range of vectors, with
// kDeepUnroll loads per thread in flight (256 threads x 16 x 16 B = 64 KB per CTA for groups of
// 4 blocks of 16 KB, 4x the kernel above): a copy beside HBM-bound kernels reads over PCIe at
// a longer latency, and bytes in flight set its rate (bench/results/copy_pipeline*.json).
constexpr int kDeepUnroll = 16;

__global__ void copy_groups_kernel(KernelPayloads p, const int32_t* __restrict__ src,
                                   const int32_t* __restrict__ dst, int64_t n_tasks, int64_t n_from, int64_t n_to,
                                   unsigned int* started, int group) {
  __shared__ int32_t gs[kMaxGroup], gd[kMaxGroup];  // the group's tasks; -1: skipped
  if (started != nullptr && threadIdx.x == 0) {
    atomicAdd(started, 1u);
    __threadfence_system();
  }
  const int step = blockDim.x;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * group; t0 < n_tasks;
       t0 += static_cast<int64_t>(gridDim.x) * group) {
    const int g = static_cast<int>(n_tasks - t0 < group ? n_tasks - t0 : group);
    __syncthreads();  // every thread is done with the previous group's indices
    if (threadIdx.x < g) {
      const int32_t s = src[t0 + threadIdx.x];
      const int32_t d = dst[t0 + threadIdx.x];
      const bool ok = !(s < 0 || s >= n_from || d < 0 || d >= n_to);
      gs[threadIdx.x] = ok ? s : -1;
      gd[threadIdx.x] = ok ? d : -1;
    }
    __syncthreads();
    for (int j = 0; j < p.n; ++j) {
      const int vecs = static_cast<int>(p.vecs[j]);
      const int total = g * vecs;
      for (int base = threadIdx.x; base < total; base += kDeepUnroll * step) {
        uint4 r[kDeepUnroll];
#pragma unroll
        for (int u = 0; u < kDeepUnroll; ++u) {
          const int i = base + u * step;
          if (i < total) {
            const int k = i / vecs;
            if (gs[k] >= 0) r[u] = p.from[j][static_cast<int64_t>(gs[k]) * vecs + (i - k * vecs)];
          }
        }
#pragma unroll
        for (int u = 0; u < kDeepUnroll; ++u) {
          const int i = base + u * step;
          if (i < total) {
            const int k = i / vecs;
            if (gs[k] >= 0) p.to[j][static_cast<int64_t>(gd[k]) * vecs + (i - k * vecs)] = r[u];
          }
        }
      }
    }
  }
}
