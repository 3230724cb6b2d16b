// Does a UVA copy kernel run beside other kernels at all, outside XLA? The prefetch pattern of the
// engine measured compute + copy (bench/results/copy_pipeline*.json), and two copy lanes of one CTA
// each moved no more than one. This probe times the engine's own copy kernel (copy_kernels.cuh)
// with plain CUDA streams (the copy on a high-priority side stream, as the engine's lanes):
//   spin        one warp spinning 1 ms: two spins on two streams, and a spin beside a copy, are the
//               plainest test of whether kernels of two streams run together at all on the machine
//   stream      many short CTAs reading HBM (XLA's fusions): SMs free up all the time
//   stream_graph the same kernels launched as one CUDA graph (XLA runs its thunks as graphs)
//   persistent  one CTA per SM for the whole kernel (grid = SMs, all of an SM's SMEM), tiles
//               assigned statically, as cuBLAS's nvjet GEMMs (one CTA per SM, 168 regs x 384
//               threads): a copy CTA holding an SM delays one CTA of it until the copy ends
//   persistent_leaving_16_sms  the same on SMs - 16 CTAs (the engine's copy quota left free)
//   cublas      the decode microbenchmark's GEMM, [16, 4096] x [4096, 14336] bf16, if libcublas
//               loads; and the same with cublasSetSmCountTarget(SMs - 16)
// Each beside a copy issued before or after it, and "resident" (the main stream waits until the
// copy's CTAs run, as the engine's resident starts). Each case records, from one start event
// (after a gate that lets the host queue every launch first), when the copy ended, when the work
// ended and when both had: overlap shows as total ~ max(copy, work), serialisation as ~ their sum.
//
// Build and run (scripts/probes/overlap_probe.sh does both on the GPU machine):
//   nvcc -O3 -std=c++17 -arch=sm_90 -I kernels/copy -I $(python3 -c 'import jax; print(jax.ffi.include_dir())') \
//        scripts/probes/overlap_probe.cu -o /tmp/overlap_probe -ldl
//   /tmp/overlap_probe [path/to/libcublas.so]   # one JSON object a line: a header, then the cases
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>

#include "copy_kernels.cuh"

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

constexpr int64_t kBlockBytes = 64 * 128 * 2;  // one 64-token K (or V) block, head dim 128, bf16
constexpr int kRepeats = 9;

// ------------------------------------------------------------------------------- the work kernels

// Short CTAs: each reads its own 256 x 16 x 16 B = 64 KB and exits.
__global__ void stream_kernel(const uint4* __restrict__ a, int64_t n_vec, unsigned int* sink) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * 16 + threadIdx.x;
  unsigned int acc = 0;
#pragma unroll
  for (int u = 0; u < 16; ++u) {
    const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
    if (i < n_vec) {
      const uint4 r = a[i];
      acc ^= r.x ^ r.y ^ r.z ^ r.w;
    }
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);  // keeps the loads; practically never taken
}

// One CTA per SM to the end (its dynamic SMEM leaves no room for another CTA), tiles t = blockIdx.x,
// blockIdx.x + gridDim.x, ...: the kernel ends when its slowest CTA does.
__global__ void persistent_kernel(const uint4* __restrict__ a, int64_t n_tiles, int64_t tile_vec, unsigned int* sink) {
  extern __shared__ unsigned int smem[];
  unsigned int acc = 0;
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    const uint4* p = a + t * tile_vec;
    for (int64_t i = threadIdx.x; i < tile_vec; i += blockDim.x) {
      const uint4 r = p[i];
      acc ^= r.x ^ r.y ^ r.z ^ r.w;
    }
  }
  smem[threadIdx.x] = acc;
  __syncthreads();
  if (smem[(threadIdx.x + 1) % blockDim.x] == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// One warp spinning for `ns` nanoseconds of the GPU's global timer (not SM clocks, which vary
// with the boost state): two spins on two streams take one spin's time if the GPU runs kernels of
// different streams together, two spins' if it does not. Also the gate before each case.
// (global_ns: copy_kernels.cuh)

__global__ void spin_kernel(long long ns, unsigned int* sink) {
  const unsigned long long t0 = global_ns();
  while (static_cast<long long>(global_ns() - t0) < ns) {
  }
  if (ns < 0) atomicAdd(sink, 1u);
}

// ------------------------------------------------------------------------------- cuBLAS, optional

using CublasCreate = int (*)(void**);
using CublasSetStream = int (*)(void*, cudaStream_t);
using CublasSetSmCountTarget = int (*)(void*, int);
using CublasGetVersion = int (*)(void*, int*);
using CublasGemmEx = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int,
                             int, const void*, void*, int, int, int, int);
struct Cublas {
  void* handle = nullptr;     // as XLA's
  void* targeted = nullptr;   // cublasSetSmCountTarget(SMs - 16): told that 16 SMs are busy elsewhere
  CublasGemmEx gemm = nullptr;
  int version = 0;
  bool ok = false;
};

static bool load_cublas(const char* path, cudaStream_t stream, int target_sms, Cublas* c) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "cublas: %s\n", dlerror());
    return false;
  }
  auto create = reinterpret_cast<CublasCreate>(dlsym(lib, "cublasCreate_v2"));
  auto set_stream = reinterpret_cast<CublasSetStream>(dlsym(lib, "cublasSetStream_v2"));
  auto set_target = reinterpret_cast<CublasSetSmCountTarget>(dlsym(lib, "cublasSetSmCountTarget"));
  auto get_version = reinterpret_cast<CublasGetVersion>(dlsym(lib, "cublasGetVersion_v2"));
  c->gemm = reinterpret_cast<CublasGemmEx>(dlsym(lib, "cublasGemmEx"));
  if (create == nullptr || set_stream == nullptr || c->gemm == nullptr) return false;
  if (create(&c->handle) != 0 || set_stream(c->handle, stream) != 0) return false;
  if (get_version != nullptr) get_version(c->handle, &c->version);
  if (set_target != nullptr && create(&c->targeted) == 0 &&
      (set_stream(c->targeted, stream) != 0 || set_target(c->targeted, target_sms) != 0)) {
    c->targeted = nullptr;
  }
  return true;
}

// ------------------------------------------------------------------------------- the cases

using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct Setup {
  int sms = 0;
  KernelPayloads kv{};           // K and V pools (pinned host) -> caches
  KernelPayloads k_only{}, v_only{};
  int32_t* src = nullptr;        // device task lists
  int32_t* dst = nullptr;
  int64_t n_tasks = 0, n_pool = 0;
  uint4* hbm = nullptr;          // the work's input
  int64_t hbm_vec = 0;
  unsigned int* sink = nullptr;
  unsigned int* started = nullptr;  // resident copies: CTAs that have begun (the engine's counter)
  unsigned int launched = 0;
  WaitValueFn wait_value = nullptr;
  Cublas cublas;
  void *x = nullptr, *w = nullptr, *y = nullptr;
  cudaStream_t main = nullptr, side = nullptr, side2 = nullptr;
  int persistent_smem = 0;       // all an SM has for one CTA: no other CTA fits beside it
  cudaGraphExec_t graph = nullptr;
};

enum Work { kNone, kSpin, kStream, kStreamGraph, kPersistent, kPersistentLeaving, kCublas, kCublasTargeted };
static const char* work_name(Work w) {
  switch (w) {
    case kNone: return "none";
    case kSpin: return "spin";
    case kStream: return "stream";
    case kStreamGraph: return "stream_graph";
    case kPersistent: return "persistent";
    case kPersistentLeaving: return "persistent_leaving_16_sms";
    case kCublas: return "cublas";
    case kCublasTargeted: return "cublas_sm_target_minus_16";
  }
  return "?";
}

constexpr long long kSpinNs = 1000000;  // 1 ms
constexpr long long kGateNs = 2000000;  // holds the GPU while the host queues a case's launches
static int g_work_reps = 1;             // repeats of the work kernel per case, sized once to ~1 ms

static void launch_work(Setup& s, Work w) {
  if (w == kStreamGraph) {
    CK(cudaGraphLaunch(s.graph, s.main));
    return;
  }
  if (w == kSpin) {
    spin_kernel<<<1, 32, 0, s.main>>>(kSpinNs, s.sink);
    CK(cudaGetLastError());
    return;
  }
  for (int r = 0; r < g_work_reps; ++r) {
    if (w == kStream) {
      const int64_t per_cta = 256 * 16;
      stream_kernel<<<static_cast<unsigned>((s.hbm_vec + per_cta - 1) / per_cta), 256, 0, s.main>>>(s.hbm, s.hbm_vec,
                                                                                                   s.sink);
    } else if (w == kPersistent || w == kPersistentLeaving) {
      const int grid = w == kPersistent ? s.sms : std::max(1, s.sms - 16);
      const int64_t tile_vec = 64 * 1024 / 16;  // 64 KB tiles
      persistent_kernel<<<grid, 384, s.persistent_smem, s.main>>>(s.hbm, s.hbm_vec / tile_vec, tile_vec, s.sink);
    } else if (w == kCublas || w == kCublasTargeted) {
      const float one = 1.f, zero = 0.f;
      // row-major y[16, 14336] = x[16, 4096] @ w[4096, 14336], as column-major y^T = w^T x^T
      const int CUDA_R_16BF = 14, CUBLAS_COMPUTE_32F = 68, CUBLAS_GEMM_DEFAULT = -1;
      const int st = s.cublas.gemm(w == kCublas ? s.cublas.handle : s.cublas.targeted, 0, 0, 14336, 16, 4096, &one,
                                   s.w, CUDA_R_16BF, 14336, s.x, CUDA_R_16BF, 4096, &zero, s.y, CUDA_R_16BF, 14336,
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (st != 0) {
        std::fprintf(stderr, "cublasGemmEx (%s) returned %d\n", work_name(w), st);
        std::exit(2);
      }
    }
  }
  CK(cudaGetLastError());
}

static void launch_copy(Setup& s, cudaStream_t st, const KernelPayloads& p, int ctas, bool resident = false) {
  copy_blocks_kernel<<<ctas, 256, 0, st>>>(p, s.src, s.dst, s.n_tasks, s.n_pool, s.n_tasks,
                                           resident ? s.started : nullptr);
  CK(cudaGetLastError());
  if (resident) {  // the engine's resident start: the main stream waits until the copy's CTAs run
    s.launched += static_cast<unsigned int>(ctas);
    const CUresult r = s.wait_value(reinterpret_cast<CUstream>(s.main), reinterpret_cast<CUdeviceptr>(s.started),
                                    s.launched, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) {
      std::fprintf(stderr, "cuStreamWaitValue32: %d\n", static_cast<int>(r));
      std::exit(1);
    }
  }
}

struct Times {
  float copy_ms = 0, work_ms = 0, total_ms = 0;
};

// copies: 0 (work alone), 1 (K and V in one kernel of `ctas` CTAs on `side`), 2 (K on side, V on
// side2, `ctas` each), 3 (as 1, resident: the main stream waits until its CTAs run, then works),
// -1 (a spin on `side` instead of a copy). copy_first: the copy's launch is issued before the
// work's. Every case starts behind a gate (a spin on the main stream): its launches are all
// queued before the timing event e0, so host launch time is not counted.
static Times run_case(Setup& s, Work w, int copies, int ctas, bool copy_first) {
  std::vector<float> c, k, t;
  cudaEvent_t e0, ec, ec2, ew, e1;
  for (cudaEvent_t* e : {&e0, &ec, &ec2, &ew, &e1}) CK(cudaEventCreate(e));
  for (int rep = 0; rep < kRepeats + 1; ++rep) {  // the first is a warm-up
    spin_kernel<<<1, 32, 0, s.main>>>(kGateNs, s.sink);
    CK(cudaEventRecord(e0, s.main));
    CK(cudaStreamWaitEvent(s.side, e0, 0));
    CK(cudaStreamWaitEvent(s.side2, e0, 0));
    auto copy = [&]() {
      if (copies == -1) spin_kernel<<<1, 32, 0, s.side>>>(kSpinNs, s.sink);
      if (copies == 1 || copies == 3) launch_copy(s, s.side, s.kv, ctas, copies == 3);
      if (copies == 2) {
        launch_copy(s, s.side, s.k_only, ctas);
        launch_copy(s, s.side2, s.v_only, ctas);
      }
      CK(cudaEventRecord(ec, s.side));
      CK(cudaEventRecord(ec2, s.side2));
    };
    if (copy_first) copy();
    launch_work(s, w);
    CK(cudaEventRecord(ew, s.main));
    if (!copy_first) copy();
    CK(cudaStreamWaitEvent(s.main, ec, 0));
    CK(cudaStreamWaitEvent(s.main, ec2, 0));
    CK(cudaEventRecord(e1, s.main));
    CK(cudaEventSynchronize(e1));
    if (rep == 0) continue;
    float a = 0, b = 0, b2 = 0, d = 0;
    CK(cudaEventElapsedTime(&a, e0, ec));
    CK(cudaEventElapsedTime(&b2, e0, ec2));
    CK(cudaEventElapsedTime(&b, e0, ew));
    CK(cudaEventElapsedTime(&d, e0, e1));
    c.push_back(std::max(a, b2));
    k.push_back(b);
    t.push_back(d);
  }
  auto med = [](std::vector<float>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (cudaEvent_t e : {e0, ec, ec2, ew, e1}) CK(cudaEventDestroy(e));
  return Times{med(c), med(k), med(t)};
}

int main(int argc, char** argv) {
  Setup s;
  CK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  s.sms = prop.multiProcessorCount;
  // the opt-in maximum per CTA (227 KB on Hopper) + its 1 KB reserve = the SM's 228 KB
  s.persistent_smem = static_cast<int>(prop.sharedMemPerBlockOptin);
  CK(cudaFuncSetAttribute(persistent_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, s.persistent_smem));
  int least = 0, greatest = 0;
  CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  CK(cudaStreamCreateWithFlags(&s.main, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithPriority(&s.side, cudaStreamNonBlocking, greatest));  // as the engine's lanes
  CK(cudaStreamCreateWithPriority(&s.side2, cudaStreamNonBlocking, greatest));
  {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || p == nullptr) {
      std::fprintf(stderr, "cuStreamWaitValue32 not found\n");
      return 1;
    }
    s.wait_value = reinterpret_cast<WaitValueFn>(p);
  }
  CK(cudaMalloc(&s.started, 4));
  CK(cudaMemset(s.started, 0, 4));

  // pools: 512 MiB each of pinned host memory; 1920 tasks a layer (60 MiB of K and V: random traffic
  // at batch 16 and 128K, bench/results/decode_overlap.json)
  // OVERLAP_PROBE_POOL_MIB: a pool as large as the engine's (33 GB at batch 8, 128K) spreads the
  // random blocks over as many host pages as the engine's gather touches
  const char* pool_mib = std::getenv("OVERLAP_PROBE_POOL_MIB");
  s.n_pool = ((pool_mib ? std::atoll(pool_mib) : 512ll) << 20) / kBlockBytes;
  s.n_tasks = 1920;
  void *kp = nullptr, *vp = nullptr, *kc = nullptr, *vc = nullptr;
  CK(cudaHostAlloc(&kp, s.n_pool * kBlockBytes, cudaHostAllocMapped | cudaHostAllocPortable));
  CK(cudaHostAlloc(&vp, s.n_pool * kBlockBytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(kp, 1, s.n_pool * kBlockBytes);
  std::memset(vp, 2, s.n_pool * kBlockBytes);
  void *kpd = nullptr, *vpd = nullptr;
  CK(cudaHostGetDevicePointer(&kpd, kp, 0));
  CK(cudaHostGetDevicePointer(&vpd, vp, 0));
  CK(cudaMalloc(&kc, s.n_tasks * kBlockBytes));
  CK(cudaMalloc(&vc, s.n_tasks * kBlockBytes));
  std::vector<int32_t> hs(s.n_pool), hd(s.n_tasks);
  for (int64_t i = 0; i < s.n_pool; ++i) hs[i] = static_cast<int32_t>(i);
  std::shuffle(hs.begin(), hs.end(), std::mt19937(0));
  for (int64_t i = 0; i < s.n_tasks; ++i) hd[i] = static_cast<int32_t>(i);
  CK(cudaMalloc(&s.src, s.n_tasks * 4));
  CK(cudaMalloc(&s.dst, s.n_tasks * 4));
  CK(cudaMemcpy(s.src, hs.data(), s.n_tasks * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.dst, hd.data(), s.n_tasks * 4, cudaMemcpyHostToDevice));
  const int64_t vecs = kBlockBytes / 16;
  s.kv.n = 2;
  s.kv.from[0] = static_cast<const uint4*>(kpd);
  s.kv.from[1] = static_cast<const uint4*>(vpd);
  s.kv.to[0] = static_cast<uint4*>(kc);
  s.kv.to[1] = static_cast<uint4*>(vc);
  s.kv.vecs[0] = s.kv.vecs[1] = vecs;
  s.k_only = s.kv;
  s.k_only.n = 1;
  s.v_only = s.kv;
  s.v_only.n = 1;
  s.v_only.from[0] = s.kv.from[1];
  s.v_only.to[0] = s.kv.to[1];

  s.hbm_vec = (1ll << 30) / 16;  // 1 GiB of HBM, read by the work kernels
  CK(cudaMalloc(&s.hbm, s.hbm_vec * 16));
  CK(cudaMemset(s.hbm, 3, s.hbm_vec * 16));
  CK(cudaMalloc(&s.sink, 4));
  bool have_cublas = argc > 1 && load_cublas(argv[1], s.main, s.sms - 16, &s.cublas);
  if (have_cublas) {
    CK(cudaMalloc(&s.x, 16 * 4096 * 2));
    CK(cudaMalloc(&s.w, 4096ll * 14336 * 2));
    CK(cudaMalloc(&s.y, 16 * 14336 * 2));
    CK(cudaMemset(s.x, 0, 16 * 4096 * 2));
    CK(cudaMemset(s.w, 0, 4096ll * 14336 * 2));
  }
  CK(cudaDeviceSynchronize());

  // the copy's data is checked once: every task's block landed in its slot
  run_case(s, kNone, 1, 16, true);
  {
    std::vector<unsigned char> got(kBlockBytes);
    CK(cudaMemcpy(got.data(), static_cast<char*>(vc) + 7 * kBlockBytes, kBlockBytes, cudaMemcpyDeviceToHost));
    if (std::count(got.begin(), got.end(), 2) != kBlockBytes) {
      std::fprintf(stderr, "copy check failed\n");
      return 1;
    }
  }

  // one JSON object a line, flushed: a crash or a timeout keeps the lines before it
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  std::printf("{\"header\": true, \"sms\": %d, \"device\": \"%s\", \"driver\": %d, \"runtime\": %d, "
              "\"smem_per_sm\": %zu, \"smem_per_block_optin\": %zu, \"smem_reserved_per_block\": %zu, "
              "\"cublas_version\": %d, \"cublas_sm_target\": %s, \"mib_per_copy\": %.1f, "
              "\"CUDA_DEVICE_MAX_CONNECTIONS\": \"%s\", \"pool_mib\": %lld}\n",
              s.sms, prop.name, driver, runtime, prop.sharedMemPerMultiprocessor, prop.sharedMemPerBlockOptin,
              prop.reservedSharedMemPerBlock, s.cublas.version, s.cublas.targeted ? "true" : "false",
              2.0 * s.n_tasks * kBlockBytes / (1 << 20), conn ? conn : "",
              static_cast<long long>(s.n_pool * kBlockBytes >> 20));
  std::fflush(stdout);
  auto emit = [&](const char* what, Work w, int copies, int ctas, bool copy_first) {
    const Times t = run_case(s, w, copies, ctas, copy_first);
    std::printf("{\"case\": \"%s\", \"work\": \"%s\", \"copies\": %d, \"ctas\": %d, \"copy_first\": %s, "
                "\"copy_ms\": %.4f, \"work_ms\": %.4f, \"total_ms\": %.4f, \"work_reps\": %d}\n",
                what, work_name(w), copies, ctas, copy_first ? "true" : "false", t.copy_ms, t.work_ms, t.total_ms,
                g_work_reps);
    std::fflush(stdout);
  };
  // the plainest concurrency check: a spin alone, two spins on two streams, a spin beside a copy
  emit("spin_alone", kSpin, 0, 1, true);
  emit("two_spins", kSpin, -1, 1, true);
  emit("spin_and_copy", kSpin, 1, 16, true);
  // the copies alone: one kernel of 1, 2, 16 CTAs; two kernels on two streams (1 + 1, 8 + 8)
  for (int c : {1, 2, 16}) emit("copy_alone", kNone, 1, c, true);
  for (int c : {1, 8}) emit("two_streams", kNone, 2, c, true);
  // the work alone, sized to ~1 ms a case, then beside a copy of 2 or 16 CTAs issued first or
  // last, and (16 CTAs) resident as the engine's starts are
  std::vector<Work> works = {kStream, kStreamGraph, kPersistent, kPersistentLeaving};
  if (have_cublas) works.push_back(kCublas);
  if (have_cublas && s.cublas.targeted != nullptr) works.push_back(kCublasTargeted);
  for (Work w : works) {
    if (w != kStreamGraph) {  // the graph keeps the stream kernel's repeats
      g_work_reps = 1;
      const float one = run_case(s, w, 0, 16, true).work_ms;
      g_work_reps = std::max(1, std::min(200, static_cast<int>(1.0f / std::max(one, 5e-3f))));
    } else {
      cudaGraph_t g = nullptr;
      CK(cudaStreamBeginCapture(s.main, cudaStreamCaptureModeThreadLocal));
      launch_work(s, kStream);
      CK(cudaStreamEndCapture(s.main, &g));
      CK(cudaGraphInstantiate(&s.graph, g, 0));
      CK(cudaGraphDestroy(g));
    }
    emit("work_alone", w, 0, 16, true);
    for (int c : {2, 16}) {
      for (bool cf : {true, false}) emit("together", w, 1, c, cf);
    }
    emit("together_resident", w, 3, 16, true);
  }
  return 0;
}
