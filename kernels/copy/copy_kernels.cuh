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

// This CTA's share of the tasks (every gridDim.x-th from blockIdx.x): one block of every payload each
__device__ __forceinline__ void copy_task_share(const KernelPayloads& p, const int32_t* __restrict__ src,
                                                const int32_t* __restrict__ dst, int64_t n_tasks, int64_t n_from,
                                                int64_t n_to) {
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

__global__ void copy_blocks_kernel(KernelPayloads p, const int32_t* __restrict__ src,
                                   const int32_t* __restrict__ dst, int64_t n_tasks, int64_t n_from, int64_t n_to,
                                   unsigned int* started) {
  if (started != nullptr && threadIdx.x == 0) {  // announce that this CTA holds its SM
    atomicAdd(started, 1u);
    __threadfence_system();
  }
  copy_task_share(p, src, dst, n_tasks, n_from, n_to);
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

// ---------------------------------------------------------------- doorbell copies
// A persistent server grid copies the jobs that ring kernels on XLA's stream post, and wait
// kernels on XLA's stream spin until a job is done: the start and the wait of a prefetch are then
// ordinary kernels that XLA can record into its CUDA graphs (docs/decisions.md, "At full depth").
// Per job j (a step's j-th ring): the ring writes job[j], then rung[j] = 1; the server's CTAs
// copy their shares, the last one resets rung[j] and count[j] and sets done[j] = 1; the wait
// spins on done[j] and resets it. Stream order makes the resets safe: XLA's stream runs wait j of
// one step before ring j of the next, and a step's server ends before the next one starts (one
// stream). A spin past kSpinLimit cycles, or a ring beyond the served jobs, stops the context
// (doorbell_fail): the protocol needs the server to run beside XLA's kernels, so it cannot work
// where kernels are serialised (CUDA_LAUNCH_BLOCKING=1, a kernel profiler's replay).

constexpr int kMaxJobs = 256;  // rings a step: one per offloaded layer
// ~10 s at H200 clocks: a hang, not a slow step (a first execution loads modules and builds graphs)
constexpr long long kSpinLimit = 20000000000LL;

struct DoorbellJob {
  KernelPayloads k;
  const int32_t* src;
  const int32_t* dst;
  int64_t n_tasks, n_from, n_to;
};

// The step's timeline, in %globaltimer ns (diagnostics, read by sparda_doorbell_timeline after a
// step): where XLA's stream reached each ring and wait, when the server took up and finished
// each job. Overwritten by every step; a few timer reads a job.
enum DoorbellMark { kRing = 0, kCopyBegin, kCopyEnd, kWaitBegin, kWaitEnd, kMarks };

struct Doorbell {  // device memory, zeroed once
  DoorbellJob job[kMaxJobs];
  unsigned int rung[kMaxJobs];
  unsigned int done[kMaxJobs];
  unsigned int count[kMaxJobs];
  unsigned long long served;  // when the step's server (its CTA 0) began
  int served_jobs;            // and that step's job count: the marks of jobs beyond it are stale
  unsigned long long t[kMaxJobs][kMarks];
};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int load_volatile(const unsigned int* a) {
  return *reinterpret_cast<const volatile unsigned int*>(a);
}

// The protocol is broken (a ring or wait without its match, or kernels serialised, as under
// CUDA_LAUNCH_BLOCKING): say so and kill the context. Going on would hand XLA a half-copied cache
// and leave the doorbell's flags for the next step to misread; a trap fails every later call.
__device__ __noinline__ void doorbell_fail(int* error, int code, int job) {
  atomicExch(error, code);
  __threadfence_system();
  printf("sparda doorbell: %s (job %d); the CUDA context is stopped\n",
         code == 1 ? "a spin waited > ~10 s: a ring or wait without its match, or kernels serialised"
                   : "a ring outside the served jobs", job);
  __trap();
}

// One thread spins until *flag != 0, or stops everything after ~10 s (doorbell_fail)
__device__ __forceinline__ void spin_until_set(const unsigned int* flag, int* error, int job) {
  const long long t0 = clock64();
  while (load_volatile(flag) == 0) {
    if (clock64() - t0 > kSpinLimit) doorbell_fail(error, 1, job);
    __nanosleep(256);
  }
  __threadfence();  // what was written before the flag is visible after it
}

__global__ void doorbell_ring_kernel(Doorbell* bell, int job, KernelPayloads k, const int32_t* src,
                                     const int32_t* dst, int64_t n_tasks, int64_t n_from, int64_t n_to) {
  DoorbellJob* j = &bell->job[job];
  j->k = k;
  j->src = src;
  j->dst = dst;
  j->n_tasks = n_tasks;
  j->n_from = n_from;
  j->n_to = n_to;
  bell->t[job][kRing] = global_ns();
  __threadfence();
  atomicExch(&bell->rung[job], 1u);
}

__global__ void doorbell_wait_kernel(Doorbell* bell, int job, int* error) {
  const unsigned long long t0 = global_ns();
  spin_until_set(&bell->done[job], error, job);
  bell->done[job] = 0;
  bell->t[job][kWaitBegin] = t0;
  bell->t[job][kWaitEnd] = global_ns();
  __threadfence();
}

__global__ void doorbell_server_kernel(Doorbell* bell, int n_jobs, int* error) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    bell->served = global_ns();
    bell->served_jobs = n_jobs;
  }
  for (int j = 0; j < n_jobs; ++j) {
    if (threadIdx.x == 0) {
      spin_until_set(&bell->rung[j], error, j);
      if (blockIdx.x == 0) bell->t[j][kCopyBegin] = global_ns();  // CTA 0's view: when the job was taken up
    }
    __syncthreads();  // with thread 0's fence: the job (and the tasks it names) visible to every thread
    // the descriptor through L2 (ld.cg), a habit for data another kernel wrote while this one
    // runs; the release/acquire chain above already orders it, and the task lists and pools
    const DoorbellJob* jb = &bell->job[j];
    KernelPayloads k;
    for (int i = 0; i < kMaxPayloads; ++i) {
      k.from[i] = reinterpret_cast<const uint4*>(__ldcg(reinterpret_cast<const long long*>(&jb->k.from[i])));
      k.to[i] = reinterpret_cast<uint4*>(__ldcg(reinterpret_cast<const long long*>(&jb->k.to[i])));
      k.vecs[i] = __ldcg(reinterpret_cast<const long long*>(&jb->k.vecs[i]));
    }
    k.n = __ldcg(&jb->k.n);
    const int32_t* src = reinterpret_cast<const int32_t*>(__ldcg(reinterpret_cast<const long long*>(&jb->src)));
    const int32_t* dst = reinterpret_cast<const int32_t*>(__ldcg(reinterpret_cast<const long long*>(&jb->dst)));
    copy_task_share(k, src, dst, __ldcg(reinterpret_cast<const long long*>(&jb->n_tasks)),
                    __ldcg(reinterpret_cast<const long long*>(&jb->n_from)),
                    __ldcg(reinterpret_cast<const long long*>(&jb->n_to)));
    __threadfence();  // this thread's stores visible device-wide before the count says so
    __syncthreads();
    if (threadIdx.x == 0) {
      if (atomicAdd(&bell->count[j], 1u) == gridDim.x - 1) {  // the last CTA of this job
        bell->t[j][kCopyEnd] = global_ns();
        bell->count[j] = 0;
        bell->rung[j] = 0;
        __threadfence();
        atomicExch(&bell->done[j], 1u);
        // the step's last job: no ring may be pending beyond the served ones (it would be run,
        // with a stale descriptor, by the next step's server)
        if (j == n_jobs - 1) {
          for (int r = n_jobs; r < kMaxJobs; ++r) {
            if (load_volatile(&bell->rung[r]) != 0) doorbell_fail(error, 2, r);
          }
        }
      }
    }
  }
}
