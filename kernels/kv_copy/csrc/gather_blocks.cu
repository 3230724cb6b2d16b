// sparda-jax KV copy: move KV blocks between pinned host memory and device cache slots.
//
// XLA FFI handlers. A host pool is an ordinary operand in the pinned_host memory kind: XLA
// hands the handler its host pointer, which the GPU reads (or writes) directly over unified
// virtual addressing (UVA). One launch of a bounded, persistent grid: `num_ctas` CTAs loop
// over the copy tasks, so the copy holds few SMs while attention and FFN run beside it (the
// paper's CTA quota). Each task moves one block of every payload with 16-byte loads and stores.
//
//   SpardaGatherBlocks   cache[dst[t]] = pool[src[t]] on XLA's stream; recordable into XLA's
//                        command buffers (CUDA graphs)
//   SpardaScatterBlocks  pool[dst[t]] = cache[src[t]]: device slots written back into the host
//                        pool in place (the pool is aliased to the output); recordable too
//   SpardaGatherStart    a gather (1..4 payloads, one launch) on a high-priority side stream
//                        (its lane), after XLA's stream has produced the inputs; returns at
//                        once, so XLA's next kernels run beside it. XLA's stream also waits
//                        until every copy CTA is running (a stream wait on a counter the CTAs
//                        raise): Hopper GEMMs are persistent and hold every SM to their end, so
//                        a copy launched a moment after one would wait for it; resident first,
//                        the copy keeps its SMs
//   SpardaGatherWait     XLA's stream waits for the copies started into these caches; takes
//                        src/dst (kept alive until the copy is done) and `after` with any more
//                        arrays (computed before the wait, never read: they pin the wait's place
//                        in XLA's schedule)
//
//   Operands (copy_tasks.h): src, dst int32 [n] (the task lists; an index out of range: no
//   task), then per payload the `from` buffers, then the buffers aliased to the results
//   (updated in place; if XLA hands over separate output buffers, they start as copies);
//   attr block_bytes, one per payload.
//   gather: from = pools [n_pool, block] (pinned host, viewed as bytes), to = caches [n_slots, block]
//   scatter: from = caches, to = pools

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>

#include "copy_tasks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// ---------------------------------------------------------------- the copy kernel

struct KernelPayloads {  // by value: a launch's payloads in constant memory
  const uint4* from[kMaxPayloads];
  uint4* to[kMaxPayloads];
  int64_t vecs[kMaxPayloads];  // 16-byte vectors per block
  int n;
};

// Loads of kUnroll vectors per thread are issued before their stores: a read over PCIe takes
// about a microsecond, and one vector in flight per thread would cap a CTA at 4 KB per latency.
constexpr int kUnroll = 4;

// Each CTA takes every gridDim.x-th task from blockIdx.x: one block of every payload each.
// started (asynchronous starts): a counter each CTA raises once it holds its SM.
__global__ void copy_blocks_kernel(KernelPayloads p, const int32_t* __restrict__ src,
                                   const int32_t* __restrict__ dst, int64_t n_tasks, int64_t n_from, int64_t n_to,
                                   unsigned int* started) {
  if (started != nullptr && threadIdx.x == 0) {
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

// ---------------------------------------------------------------- launching a copy

// The leading operands of every copy handler but the wait: XLA's stream, the task lists src/dst (int32
// [n]), then per payload its `from` buffer x n and the aliased `to` inputs x n, and the `to`
// results x n (gather: pools -> caches; write-back: caches -> pools). Attributes follow.
static auto copy_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::S32>>()   // src
      .Arg<ffi::Buffer<ffi::S32>>()   // dst
      .RemainingArgs()
      .RemainingRets();
}

static ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

// Handler calls that got an output apart from its aliased input, and the bytes they copied: each
// such copy moves a whole cache (or pool) on XLA's stream. Read by sparda_unaliased.
std::atomic<int64_t> g_unaliased_calls{0}, g_unaliased_bytes{0};

static void count_unaliased(size_t bytes) {
  g_unaliased_calls += 1;
  g_unaliased_bytes += static_cast<int64_t>(bytes);
}

// The outputs should be the inputs' buffers (input_output_aliases), but XLA may hand over two
// buffers: then an output starts as a copy of its input.
static ffi::Error alias_or_copy(cudaStream_t stream, const CopyPayloads& p) {
  for (int j = 0; j < p.n; ++j) {
    if (p.to_in[j] == p.to[j]) continue;
    count_unaliased(p.to_bytes[j]);
    const cudaError_t err = cudaMemcpyAsync(p.to[j], p.to_in[j], p.to_bytes[j], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return cuda_error("cudaMemcpyAsync (unaliased output)", err);
  }
  return ffi::Error::Success();
}

static int copy_grid(int64_t n, int32_t num_ctas) {
  return static_cast<int>(num_ctas < 1 ? 1 : (num_ctas > n ? n : num_ctas));
}

// Launches one copy of every payload (already decoded and checked).
static ffi::Error launch_copy(cudaStream_t stream, const CopyPayloads& p, ffi::Buffer<ffi::S32> src,
                              ffi::Buffer<ffi::S32> dst, int32_t num_ctas, int32_t threads,
                              unsigned int* started = nullptr) {
  ffi::Error e = check_threads(threads);
  if (e.failure()) return e;
  KernelPayloads k{};
  k.n = p.n;
  for (int j = 0; j < p.n; ++j) {
    if (reinterpret_cast<uintptr_t>(p.from[j]) % 16 != 0 || reinterpret_cast<uintptr_t>(p.to[j]) % 16 != 0) {
      return ffi::Error::InvalidArgument("pool and cache must be 16-byte aligned");
    }
    k.from[j] = static_cast<const uint4*>(p.from[j]);
    k.to[j] = static_cast<uint4*>(p.to[j]);
    k.vecs[j] = p.block_bytes[j] / 16;
  }
  const int64_t n = static_cast<int64_t>(src.element_count());
  if (n == 0) return ffi::Error::Success();
  copy_blocks_kernel<<<copy_grid(n, num_ctas), threads, 0, stream>>>(k, src.typed_data(), dst.typed_data(), n,
                                                                   p.n_from, p.n_to, started);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error("copy_blocks launch failed", err);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- synchronous gather and write-back

// The same copy with the sides swapped (their operands say which), on XLA's stream. Declared
// safe to record into XLA's command buffers: they only launch a kernel (and, if unaliased, a
// memcpy) on XLA's stream, and without the trait XLA cuts its graph at every call. Recorded, the
// host-side checks and the unaliased counter run when XLA records the graph, not at every replay.
static ffi::Error CopyImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                           ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t num_ctas,
                           ffi::Span<const int64_t> block_bytes, int32_t threads) {
  CopyPayloads p;
  ffi::Error e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), &p);
  if (e.failure()) return e;
  if ((e = alias_or_copy(stream, p)).failure()) return e;
  return launch_copy(stream, p, src, dst, num_ctas, threads);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherBlocks, CopyImpl, with_copy_attrs(copy_binding()),
                              {ffi::Traits::kCmdBufferCompatible});

// src: the cache slot of each task, dst: its pool block; from = caches, to = pools (aliased)
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaScatterBlocks, CopyImpl, with_copy_attrs(copy_binding()),
                              {ffi::Traits::kCmdBufferCompatible});

// ---------------------------------------------------------------- asynchronous gather (start / wait)

namespace {

// Per device: one side stream of the highest priority per lane (its CTAs are scheduled first
// whenever attention or FFN kernels free an SM) and the completion event of each copy in
// flight, keyed by each cache buffer it writes: Start and Wait of one copy see the same buffers,
// aliased through both. The engine starts either every payload (K, V, cis) in one launch, or
// each payload on its own lane, with its own stream and CTA counter, so that the copies run
// side by side: on one stream V's launch queued behind K's, and XLA's stream, which waits until
// a copy's CTAs are resident, waited for all of K (EngineConfig.copy_start).
constexpr int kLanes = kMaxPayloads;

struct Lane {
  cudaStream_t stream = nullptr;
  unsigned int* started = nullptr;  // device counter of copy CTAs that have begun (wraps)
  unsigned int launched = 0;        // CTAs launched so far, host side
};

struct SideStream {
  Lane lanes[kLanes];
  std::unordered_map<uintptr_t, cudaEvent_t> in_flight;
  std::vector<cudaEvent_t> spare;
};

std::mutex g_mu;
std::unordered_map<int, SideStream> g_side;

cudaError_t side_stream(SideStream** out, int lane = 0) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  Lane& s = g_side[dev].lanes[lane];
  if (s.stream == nullptr) {
    int least = 0, greatest = 0;
    err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (err != cudaSuccess) return err;
    err = cudaStreamCreateWithPriority(&s.stream, cudaStreamNonBlocking, greatest);
    if (err != cudaSuccess) return err;
    err = cudaMalloc(&s.started, sizeof(unsigned int));
    if (err != cudaSuccess) return err;
    err = cudaMemset(s.started, 0, sizeof(unsigned int));
    if (err != cudaSuccess) return err;
  }
  *out = &g_side[dev];
  return cudaSuccess;
}

// cuStreamWaitValue32 from the driver, looked up at run time (no link against libcuda)
using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

cudaError_t wait_value_fn(WaitValueFn* out) {
  static WaitValueFn fn = nullptr;
  if (fn == nullptr) {
    cudaDriverEntryPointQueryResult status;
    void* p = nullptr;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 12000, cudaEnableDefault, &status);
    if (err != cudaSuccess) return err;
    if (status != cudaDriverEntryPointSuccess || p == nullptr) return cudaErrorSymbolNotFound;
    fn = reinterpret_cast<WaitValueFn>(p);
  }
  *out = fn;
  return cudaSuccess;
}

cudaError_t take_event(SideStream& s, cudaEvent_t* ev) {
  if (!s.spare.empty()) {
    *ev = s.spare.back();
    s.spare.pop_back();
    return cudaSuccess;
  }
  return cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
}

}  // namespace

static ffi::Error GatherStartImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                  ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t num_ctas,
                                  ffi::Span<const int64_t> block_bytes, int32_t lane_id, int32_t threads) {
  // decoded and checked, and the cache made the result's buffer, before the lane's `ready` is
  // recorded, so the side stream writes into the completed copy
  CopyPayloads p;
  ffi::Error e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), &p);
  if (e.failure()) return e;
  if ((e = check_lane(lane_id)).failure()) return e;
  if ((e = check_threads(threads)).failure()) return e;
  if ((e = alias_or_copy(stream, p)).failure()) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  SideStream* s = nullptr;
  cudaError_t err = side_stream(&s, lane_id);
  if (err != cudaSuccess) return cuda_error("side stream", err);
  Lane& lane = s->lanes[lane_id];
  for (int j = 0; j < p.n; ++j) {
    if (s->in_flight.count(reinterpret_cast<uintptr_t>(p.to[j]))) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "a copy into this cache is already in flight");
    }
  }
  // the lane waits for XLA's stream (the ids and the cache are produced there)
  cudaEvent_t ready = nullptr, done = nullptr;
  if ((err = take_event(*s, &ready)) != cudaSuccess || (err = take_event(*s, &done)) != cudaSuccess) {
    return cuda_error("event", err);
  }
  if ((err = cudaEventRecord(ready, stream)) != cudaSuccess) return cuda_error("cudaEventRecord", err);
  if ((err = cudaStreamWaitEvent(lane.stream, ready, 0)) != cudaSuccess) return cuda_error("cudaStreamWaitEvent", err);
  s->spare.push_back(ready);  // a wait binds the record made before it: the event may be re-recorded
  if ((e = launch_copy(lane.stream, p, src, dst, num_ctas, threads, lane.started)).failure()) return e;
  if ((err = cudaEventRecord(done, lane.stream)) != cudaSuccess) return cuda_error("cudaEventRecord", err);
  for (int j = 0; j < p.n; ++j) s->in_flight[reinterpret_cast<uintptr_t>(p.to[j])] = done;
  const int64_t n = static_cast<int64_t>(src.element_count());
  if (n > 0) {  // XLA's stream goes on once every copy CTA holds its SM
    WaitValueFn wait_value = nullptr;
    if ((err = wait_value_fn(&wait_value)) != cudaSuccess) return cuda_error("cuStreamWaitValue32 lookup", err);
    lane.launched += static_cast<unsigned int>(copy_grid(n, num_ctas));
    // GEQ compares as (int32)(*addr - value) >= 0, so the wrapping counter stays correct
    const CUresult r = wait_value(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(lane.started),
                                  lane.launched, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) return ffi::Error::Internal("cuStreamWaitValue32 failed: CUresult " + std::to_string(r));
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherStart, GatherStartImpl,
                              copy_binding()
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<ffi::Span<const int64_t>>("block_bytes")
                                  .Attr<int32_t>("lane")
                                  .Attr<int32_t>("threads"));

// A wait's operands: src/dst (kept alive until the copy is done), `after` and any more arrays
// (never read: they order the wait), the caches its start wrote (all of a multi-payload start's,
// or one), each aliased to its result.
static ffi::Error GatherWaitImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                 ffi::AnyBuffer after, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)src; (void)dst; (void)after;  // operands only to keep them alive and to order the wait
  ffi::Error e = check_wait_payloads(args, rets);
  if (e.failure()) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  SideStream* s = nullptr;
  cudaError_t err = side_stream(&s);
  if (err != cudaSuccess) return cuda_error("side stream", err);
  for (size_t j = 0; j < rets.size(); ++j) {
    auto in = wait_cache(args, rets, j);
    auto out = rets.get<ffi::AnyBuffer>(j);
    // the start's output is this call's input
    const auto it = s->in_flight.find(reinterpret_cast<uintptr_t>(in->untyped_data()));
    if (it == s->in_flight.end()) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "no copy in flight into this cache (wait without start)");
    }
    const cudaEvent_t done = it->second;
    if ((err = cudaStreamWaitEvent(stream, done, 0)) != cudaSuccess) return cuda_error("cudaStreamWaitEvent", err);
    s->in_flight.erase(it);
    bool shared = false;  // another cache of the same start still waits on the event
    for (const auto& kv : s->in_flight) shared = shared || kv.second == done;
    if (!shared) s->spare.push_back(done);
    if (in->untyped_data() != (*out)->untyped_data()) {  // an output XLA placed apart starts as a copy
      count_unaliased((*out)->size_bytes());
      if ((err = cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(), (*out)->size_bytes(),
                                 cudaMemcpyDefault, stream)) != cudaSuccess) {
        return cuda_error("cudaMemcpyAsync (unaliased output)", err);
      }
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherWait, GatherWaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Arg<ffi::AnyBuffer>()          // after
                                  .RemainingArgs()
                                  .RemainingRets());

// ---------------------------------------------------------------- queries from Python (ctypes)

// what 0: handler calls that copied an unaliased output first; 1: their bytes.
extern "C" int64_t sparda_unaliased(int what) { return what == 0 ? g_unaliased_calls.load() : g_unaliased_bytes.load(); }

extern "C" void sparda_reset_unaliased() { g_unaliased_calls = 0; g_unaliased_bytes = 0; }

// Where CUDA places a buffer (cudaPointerGetAttributes): a cudaMemoryType (0 unregistered, i.e.
// pageable host memory; 1 page-locked host; 2 device; 3 managed), or -1 if the query failed.
// XLA's VMM allocator can place pinned_host arrays in device memory, where a gather from them
// is no offload: the host pools are checked with this.
extern "C" int sparda_memory_type(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for the next call's cudaGetLastError
    return -1;
  }
  return static_cast<int>(a.type);
}
