// sparda-jax copy engine: move KV blocks between pinned host memory and device cache slots.
//
// XLA FFI handlers. A host pool is an ordinary operand in the pinned_host memory kind: XLA
// hands the handler its host pointer, which the GPU reads (or writes) directly over unified
// virtual addressing (UVA). One launch of a bounded, persistent grid: `num_ctas` CTAs loop
// over the copy tasks, so the copy holds few SMs while attention and FFN run beside it (the
// paper's CTA quota). Each task moves one block of `block_bytes` with 16-byte loads and stores.
//
//   SpardaGatherBlocks   cache[dst[t]] = pool[src[t]] on XLA's stream (synchronous in stream order)
//   SpardaGatherStart    the same copy on a high-priority side stream, after XLA's stream has
//                        produced the inputs; returns at once, so XLA's next kernels run beside it.
//                        With `resident`, XLA's stream also waits until every copy CTA is running
//                        (a stream wait on a counter the CTAs raise): Hopper GEMMs are persistent
//                        and hold every SM to their end, so a copy launched a moment after one
//                        would wait for it; resident first, the copy keeps its SMs (the paper's quota)
//   SpardaGatherWait     XLA's stream waits for the copy started into this cache; takes src/dst
//                        (kept alive until the copy is done) and `after` (any array that must be
//                        computed before the wait, which pins the wait's place in XLA's schedule)
//   SpardaScatterBlocks  pool[dst[t]] = cache[src[t]]: device slots written back into the host
//                        pool in place (the pool is aliased to the output)
//
//   pool   [n_pool, block_bytes]   host (pinned), any dtype, viewed as bytes
//   src    int32 [n]               source block per task (< 0: no task)
//   dst    int32 [n]               destination block per task
//   cache  [n_slots, block_bytes]  device, aliased to the output (updated in place; if XLA
//                                  hands over a separate output buffer, it starts as a copy)

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

__global__ void copy_blocks_kernel(const uint4* __restrict__ from, const int32_t* __restrict__ src,
                                   const int32_t* __restrict__ dst, uint4* __restrict__ to, int64_t n_tasks,
                                   int64_t vecs_per_block, int64_t n_from, int64_t n_to,
                                   unsigned int* started) {
  if (started != nullptr && threadIdx.x == 0) {  // announce that this CTA holds its SM
    atomicAdd(started, 1u);
    __threadfence_system();
  }
  for (int64_t t = blockIdx.x; t < n_tasks; t += gridDim.x) {
    const int32_t s = src[t];
    const int32_t d = dst[t];
    if (s < 0 || s >= n_from || d < 0 || d >= n_to) continue;
    const uint4* a = from + static_cast<int64_t>(s) * vecs_per_block;
    uint4* b = to + static_cast<int64_t>(d) * vecs_per_block;
    for (int64_t i = threadIdx.x; i < vecs_per_block; i += blockDim.x) {
      b[i] = a[i];
    }
  }
}

static ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

// The output should be the input's buffer (input_output_aliases), but XLA may hand over two
// buffers (seen on the H200 inside the engine's jit): then the output starts as a copy of the input.
static ffi::Error alias_or_copy(cudaStream_t stream, const void* in, void* out, size_t bytes) {
  if (in == out) return ffi::Error::Success();
  const cudaError_t err = cudaMemcpyAsync(out, in, bytes, cudaMemcpyDefault, stream);
  if (err != cudaSuccess) return cuda_error("cudaMemcpyAsync (unaliased output)", err);
  return ffi::Error::Success();
}

// Validates one copy from `from` (n_from blocks) into `to` (n_to blocks) and launches it.
static int copy_grid(int64_t n, int32_t num_ctas) {
  return static_cast<int>(num_ctas < 1 ? 1 : (num_ctas > n ? n : num_ctas));
}

static ffi::Error launch_copy(cudaStream_t stream, const void* from, size_t from_bytes, ffi::Buffer<ffi::S32> src,
                              ffi::Buffer<ffi::S32> dst, void* to, size_t to_bytes, int32_t num_ctas,
                              int64_t block_bytes, unsigned int* started = nullptr) {
  ffi::Error e = check_copy_args(from_bytes, to_bytes, src.element_count(), dst.element_count(), block_bytes);
  if (e.failure()) return e;
  if (reinterpret_cast<uintptr_t>(from) % 16 != 0 || reinterpret_cast<uintptr_t>(to) % 16 != 0) {
    return ffi::Error::InvalidArgument("pool and cache must be 16-byte aligned");
  }
  const int64_t n = static_cast<int64_t>(src.element_count());
  if (n == 0) return ffi::Error::Success();
  copy_blocks_kernel<<<copy_grid(n, num_ctas), 256, 0, stream>>>(
      static_cast<const uint4*>(from), src.typed_data(), dst.typed_data(), static_cast<uint4*>(to), n,
      block_bytes / 16, static_cast<int64_t>(from_bytes / block_bytes), static_cast<int64_t>(to_bytes / block_bytes),
      started);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error("copy_blocks launch failed", err);
  return ffi::Error::Success();
}

static ffi::Error GatherBlocksImpl(cudaStream_t stream, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src,
                                   ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer cache_in,
                                   ffi::Result<ffi::AnyBuffer> cache_out, int32_t num_ctas, int64_t block_bytes) {
  ffi::Error e = alias_or_copy(stream, cache_in.untyped_data(), cache_out->untyped_data(), cache_out->size_bytes());
  if (e.failure()) return e;
  return launch_copy(stream, pool.untyped_data(), pool.size_bytes(), src, dst, cache_out->untyped_data(),
                     cache_out->size_bytes(), num_ctas, block_bytes);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherBlocks, GatherBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // pool (pinned host)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Arg<ffi::AnyBuffer>()          // cache (aliased)
                                  .Ret<ffi::AnyBuffer>()          // cache
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<int64_t>("block_bytes"));

// ---------------------------------------------------------------- asynchronous gather (start / wait)

namespace {

// Per device: one side stream of the highest priority (its CTAs are scheduled first whenever
// attention or FFN kernels free an SM) and the completion event of each copy in flight, keyed by
// the cache buffer it writes: Start and Wait of one copy see the same buffer, aliased through both.
struct SideStream {
  cudaStream_t stream = nullptr;
  unsigned int* started = nullptr;  // device counter of copy CTAs that have begun (wraps)
  unsigned int launched = 0;        // CTAs launched so far, host side
  std::unordered_map<uintptr_t, cudaEvent_t> in_flight;
  std::vector<cudaEvent_t> spare;
};

std::mutex g_mu;
std::unordered_map<int, SideStream> g_side;

cudaError_t side_stream(SideStream** out) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  SideStream& s = g_side[dev];
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
  *out = &s;
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

static ffi::Error GatherStartImpl(cudaStream_t stream, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src,
                                  ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer cache_in,
                                  ffi::Result<ffi::AnyBuffer> cache_out, int32_t num_ctas, int64_t block_bytes,
                                  int32_t resident) {
  // before `ready` is recorded, so the side stream writes into the completed copy
  ffi::Error e0 = alias_or_copy(stream, cache_in.untyped_data(), cache_out->untyped_data(), cache_out->size_bytes());
  if (e0.failure()) return e0;
  std::lock_guard<std::mutex> lock(g_mu);
  SideStream* s = nullptr;
  cudaError_t err = side_stream(&s);
  if (err != cudaSuccess) return cuda_error("side stream", err);
  const auto key = reinterpret_cast<uintptr_t>(cache_out->untyped_data());
  if (s->in_flight.count(key)) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "a copy into this cache is already in flight");
  }
  cudaEvent_t ready = nullptr, done = nullptr;
  if ((err = take_event(*s, &ready)) != cudaSuccess || (err = take_event(*s, &done)) != cudaSuccess) {
    return cuda_error("event", err);
  }
  // the side stream starts once XLA's stream has produced the ids and the cache
  if ((err = cudaEventRecord(ready, stream)) != cudaSuccess) return cuda_error("cudaEventRecord", err);
  if ((err = cudaStreamWaitEvent(s->stream, ready, 0)) != cudaSuccess) return cuda_error("cudaStreamWaitEvent", err);
  s->spare.push_back(ready);  // a wait binds the record made before it: the event may be re-recorded
  const int64_t n = static_cast<int64_t>(src.element_count());
  ffi::Error e = launch_copy(s->stream, pool.untyped_data(), pool.size_bytes(), src, dst, cache_out->untyped_data(),
                             cache_out->size_bytes(), num_ctas, block_bytes, resident ? s->started : nullptr);
  if (e.failure()) return e;
  if ((err = cudaEventRecord(done, s->stream)) != cudaSuccess) return cuda_error("cudaEventRecord", err);
  s->in_flight[key] = done;
  if (resident && n > 0) {
    WaitValueFn wait_value = nullptr;
    if ((err = wait_value_fn(&wait_value)) != cudaSuccess) return cuda_error("cuStreamWaitValue32 lookup", err);
    s->launched += static_cast<unsigned int>(copy_grid(n, num_ctas));
    // GEQ compares as (int32)(*addr - value) >= 0, so the wrapping counter stays correct
    const CUresult r = wait_value(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(s->started),
                                  s->launched, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) return ffi::Error::Internal("cuStreamWaitValue32 failed: CUresult " + std::to_string(r));
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherStart, GatherStartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // pool (pinned host)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Arg<ffi::AnyBuffer>()          // cache (aliased)
                                  .Ret<ffi::AnyBuffer>()          // cache, being written
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<int64_t>("block_bytes")
                                  .Attr<int32_t>("resident"));

static ffi::Error GatherWaitImpl(cudaStream_t stream, ffi::AnyBuffer cache_in, ffi::Buffer<ffi::S32> src,
                                 ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer after,
                                 ffi::Result<ffi::AnyBuffer> cache_out) {
  (void)src; (void)dst; (void)after;  // operands only to keep them alive and to order the wait
  std::lock_guard<std::mutex> lock(g_mu);
  SideStream* s = nullptr;
  cudaError_t err = side_stream(&s);
  if (err != cudaSuccess) return cuda_error("side stream", err);
  // the start's output is this call's input
  const auto it = s->in_flight.find(reinterpret_cast<uintptr_t>(cache_in.untyped_data()));
  if (it == s->in_flight.end()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "no copy in flight into this cache (wait without start)");
  }
  if ((err = cudaStreamWaitEvent(stream, it->second, 0)) != cudaSuccess) return cuda_error("cudaStreamWaitEvent", err);
  s->spare.push_back(it->second);
  s->in_flight.erase(it);
  return alias_or_copy(stream, cache_in.untyped_data(), cache_out->untyped_data(), cache_out->size_bytes());
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherWait, GatherWaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // cache being written (aliased)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src (kept alive)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst (kept alive)
                                  .Arg<ffi::AnyBuffer>()          // after: orders the wait
                                  .Ret<ffi::AnyBuffer>());        // cache, complete

// ---------------------------------------------------------------- write-back into the host pool

static ffi::Error ScatterBlocksImpl(cudaStream_t stream, ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> src,
                                    ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer pool_in,
                                    ffi::Result<ffi::AnyBuffer> pool_out, int32_t num_ctas, int64_t block_bytes) {
  // unaliased (not seen so far): correct but slow, the whole pool crosses PCIe twice
  ffi::Error e = alias_or_copy(stream, pool_in.untyped_data(), pool_out->untyped_data(), pool_out->size_bytes());
  if (e.failure()) return e;
  return launch_copy(stream, cache.untyped_data(), cache.size_bytes(), src, dst, pool_out->untyped_data(),
                     pool_out->size_bytes(), num_ctas, block_bytes);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaScatterBlocks, ScatterBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // cache (device)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src: cache slot per task
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst: pool block per task
                                  .Arg<ffi::AnyBuffer>()          // pool (pinned host, aliased)
                                  .Ret<ffi::AnyBuffer>()          // pool
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<int64_t>("block_bytes"));
