// sparda-jax copy engine: move KV blocks between pinned host memory and device cache slots.
//
// XLA FFI handlers. A host pool is an ordinary operand in the pinned_host memory kind: XLA
// hands the handler its host pointer, which the GPU reads (or writes) directly over unified
// virtual addressing (UVA). One launch of a bounded, persistent grid: `num_ctas` CTAs loop
// over the copy tasks, so the copy holds few SMs while attention and FFN run beside it (the
// paper's CTA quota). Each task moves one block of every payload with 16-byte loads and stores.
//
//   SpardaGatherBlocks   cache[dst[t]] = pool[src[t]] on XLA's stream (synchronous in stream order)
//   SpardaGatherStart    the same copy on a high-priority side stream, after XLA's stream has
//                        produced the inputs; returns at once, so XLA's next kernels run beside it.
//                        With `resident`, XLA's stream also waits until every copy CTA is running
//                        (a stream wait on a counter the CTAs raise): Hopper GEMMs are persistent
//                        and hold every SM to their end, so a copy launched a moment after one
//                        would wait for it; resident first, the copy keeps its SMs (the paper's quota)
//   SpardaGatherDmaStart the start through cudaMemcpyBatchAsync (DMA engines, no SM; an experiment)
//   SpardaGatherWait     XLA's stream waits for the copy started into this cache; takes src/dst
//                        (kept alive until the copy is done) and `after` (any array that must be
//                        computed before the wait, which pins the wait's place in XLA's schedule)
//   SpardaMark           diagnostics: a timing event on XLA's stream (with the starts' copy events,
//                        a timeline; off unless sparda_trace_enable)
//   SpardaScatterBlocks  pool[dst[t]] = cache[src[t]]: device slots written back into the host
//                        pool in place (the pool is aliased to the output)
//   SpardaDoorbell*      the prefetch as jobs of a persistent server, rung and waited on by
//                        kernels XLA may record into its graphs (the section at the end)
//
//   Operands (copy_tasks.h): src, dst int32 [n] (the task lists; src < 0: no task), then per
//   payload (K, V, cis: 1..kMaxPayloads, one launch for all) the `from` buffers, then the
//   buffers aliased to the results (updated in place; if XLA hands over separate output
//   buffers, they start as copies); attr block_bytes, one per payload.
//   gather: from = pools [n_pool, block] (pinned host, viewed as bytes), to = caches [n_slots, block]
//   scatter: from = caches, to = pools

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>

#include "copy_tasks.h"
#include "copy_kernels.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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

// The synchronous copies' whole signature: the leading operands, then their attributes
static auto copy_call_binding() { return with_copy_attrs(copy_binding()); }

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
// buffers (seen on the H200 inside the engine's jit): then an output starts as a copy of its input.
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
                              ffi::Buffer<ffi::S32> dst, int32_t num_ctas, int32_t threads, int32_t group,
                              unsigned int* started = nullptr) {
  ffi::Error e = check_threads(threads);
  if (e.failure()) return e;
  if ((e = check_group(group)).failure()) return e;
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
  if (group > 1) {
    copy_groups_kernel<<<copy_grid(-(-n / group), num_ctas), threads, 0, stream>>>(
        k, src.typed_data(), dst.typed_data(), n, p.n_from, p.n_to, started, group);
  } else {
    copy_blocks_kernel<<<copy_grid(n, num_ctas), threads, 0, stream>>>(k, src.typed_data(), dst.typed_data(), n,
                                                                     p.n_from, p.n_to, started);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error("copy_blocks launch failed", err);
  return ffi::Error::Success();
}

// The synchronous gather and the write-back: the same copy with the sides swapped (their
// operands say which). An unaliased write-back (not seen so far) is correct but slow: the whole
// pool crosses PCIe twice.
static ffi::Error CopyImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                           ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t num_ctas,
                           ffi::Span<const int64_t> block_bytes, int32_t threads, int32_t group) {
  CopyPayloads p;
  ffi::Error e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), &p);
  if (e.failure()) return e;
  if ((e = alias_or_copy(stream, p)).failure()) return e;
  return launch_copy(stream, p, src, dst, num_ctas, threads, group);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherBlocks, CopyImpl,
                              copy_call_binding());

// ---------------------------------------------------------------- asynchronous gather (start / wait)

namespace {

// Per device: one side stream of the highest priority (its CTAs are scheduled first whenever
// attention or FFN kernels free an SM) and the completion event of each copy in flight, keyed by
// the cache buffer it writes: Start and Wait of one copy see the same buffer, aliased through both.
// A start names its lane: the engine starts K and V as separate copies on lanes 0 and 1, each its
// own stream and counter, so that they run side by side. On one stream V's launch queued behind
// K's, and XLA's stream, which waits until a copy's CTAs are resident, waited for all of K (a
// profile cannot show this: the traced kernels ran one at a time, even on two lanes). One start of
// several payloads would need one launch only, but a multi-result start lost its buffer between
// start and wait inside the engine's jit on the H200 ("already in flight"; the CPU twin did not).
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

// Diagnostics (off unless sparda_trace_enable(1)): a timeline of timing events, in the order they
// were recorded, labelled: each asynchronous start's copy ("copy<lane>+" where its lane reaches it,
// "copy<lane>-" when it ends) and each SpardaMark ("mark<id>", on XLA's stream). Read back with
// sparda_trace_read after a sync: do the copies run while XLA's kernels do?
bool g_trace_on = false;
std::vector<std::pair<std::string, cudaEvent_t>> g_trace;

cudaError_t trace_mark(const std::string& label, cudaStream_t stream) {
  if (!g_trace_on) return cudaSuccess;
  cudaEvent_t ev = nullptr;
  cudaError_t err = cudaEventCreate(&ev);
  if (err != cudaSuccess) return err;
  g_trace.emplace_back(label, ev);
  return cudaEventRecord(ev, stream);
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

// What every asynchronous start shares, with g_mu held. enter_lane: the lane, a refusal when a
// copy into this cache is already in flight, and the lane's wait for XLA's stream (the side stream
// starts once XLA's stream has produced the ids and the caches); `done` is the copy's completion
// event, which leave_lane records after the copy's work on the lane and files for its wait.
struct StartedCopy {
  SideStream* s = nullptr;
  Lane* lane = nullptr;
  uintptr_t key = 0;  // a copy is known by its first cache
  cudaEvent_t done = nullptr;
};

static ffi::Error enter_lane(cudaStream_t stream, const CopyPayloads& p, int32_t lane_id, StartedCopy* c) {
  cudaError_t err = side_stream(&c->s, lane_id);
  if (err != cudaSuccess) return cuda_error("side stream", err);
  c->lane = &c->s->lanes[lane_id];
  c->key = reinterpret_cast<uintptr_t>(p.to[0]);
  if (c->s->in_flight.count(c->key)) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "a copy into this cache is already in flight");
  }
  cudaEvent_t ready = nullptr;
  if ((err = take_event(*c->s, &ready)) != cudaSuccess || (err = take_event(*c->s, &c->done)) != cudaSuccess) {
    return cuda_error("event", err);
  }
  if ((err = cudaEventRecord(ready, stream)) != cudaSuccess) return cuda_error("cudaEventRecord", err);
  if ((err = cudaStreamWaitEvent(c->lane->stream, ready, 0)) != cudaSuccess) {
    return cuda_error("cudaStreamWaitEvent", err);
  }
  c->s->spare.push_back(ready);  // a wait binds the record made before it: the event may be re-recorded
  return ffi::Error::Success();
}

static ffi::Error leave_lane(StartedCopy* c) {
  const cudaError_t err = cudaEventRecord(c->done, c->lane->stream);
  if (err != cudaSuccess) return cuda_error("cudaEventRecord", err);
  c->s->in_flight[c->key] = c->done;
  return ffi::Error::Success();
}

// A start's operands decoded and checked, and its caches made the results' buffers, before the
// lane's `ready` is recorded, so the side stream writes into the completed copies.
static ffi::Error start_payloads(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                 const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                 ffi::Span<const int64_t> block_bytes, int32_t lane_id, CopyPayloads* p) {
  ffi::Error e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), p);
  if (e.failure()) return e;
  if ((e = check_lane(lane_id)).failure()) return e;
  return alias_or_copy(stream, *p);
}

static ffi::Error GatherStartImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                  ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t num_ctas,
                                  ffi::Span<const int64_t> block_bytes, int32_t resident, int32_t lane_id,
                                  int32_t threads, int32_t group) {
  CopyPayloads p;
  ffi::Error e0 = start_payloads(stream, src, dst, args, rets, block_bytes, lane_id, &p);
  if (e0.failure()) return e0;
  std::lock_guard<std::mutex> lock(g_mu);
  StartedCopy c;
  if ((e0 = enter_lane(stream, p, lane_id, &c)).failure()) return e0;
  Lane& lane = *c.lane;
  cudaError_t err;
  const int64_t n = static_cast<int64_t>(src.element_count());
  const std::string tag = "copy" + std::to_string(lane_id);
  if ((err = trace_mark(tag + "+", lane.stream)) != cudaSuccess) return cuda_error("trace", err);
  ffi::Error e = launch_copy(lane.stream, p, src, dst, num_ctas, threads, group, resident ? lane.started : nullptr);
  if (e.failure()) return e;
  if ((err = trace_mark(tag + "-", lane.stream)) != cudaSuccess) return cuda_error("trace", err);
  if ((e = leave_lane(&c)).failure()) return e;
  if (resident && n > 0) {
    WaitValueFn wait_value = nullptr;
    if ((err = wait_value_fn(&wait_value)) != cudaSuccess) return cuda_error("cuStreamWaitValue32 lookup", err);
    lane.launched += static_cast<unsigned int>(copy_grid(group > 1 ? -(-n / group) : n, num_ctas));
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
                                  .Attr<int32_t>("resident")
                                  .Attr<int32_t>("lane")
                                  .Attr<int32_t>("threads")
                                  .Attr<int32_t>("group"));

// The same start through the DMA copy engines instead of SMs (an experiment: does a copy that holds
// no SM overlap with the layer's kernels?). cudaMemcpyBatchAsync takes host arrays of addresses,
// so the task lists come to the host first: the handler waits for XLA's stream to produce them
// (a host-side synchronisation per start, which stalls the host's dispatch; measured alone in
// bench_pipeline, not used by the engine). One copy per block and payload, on the lane's stream;
// the wait is SpardaGatherWait's.
static ffi::Error GatherDmaStartImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                     ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t num_ctas,
                                     ffi::Span<const int64_t> block_bytes, int32_t lane_id) {
  (void)num_ctas;
  CopyPayloads p;
  ffi::Error e0 = start_payloads(stream, src, dst, args, rets, block_bytes, lane_id, &p);
  if (e0.failure()) return e0;
  const size_t n = src.element_count();
  std::vector<int32_t> hs(n), hd(n);
  cudaError_t err;
  if (n > 0) {
    if ((err = cudaMemcpyAsync(hs.data(), src.typed_data(), n * 4, cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
        (err = cudaMemcpyAsync(hd.data(), dst.typed_data(), n * 4, cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
        (err = cudaStreamSynchronize(stream)) != cudaSuccess) {
      return cuda_error("task lists to the host", err);
    }
  }
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (size_t t = 0; t < n; ++t) {
    if (hs[t] < 0 || hs[t] >= p.n_from || hd[t] < 0 || hd[t] >= p.n_to) continue;
    for (int j = 0; j < p.n; ++j) {
      srcs.push_back(static_cast<const char*>(p.from[j]) + static_cast<int64_t>(hs[t]) * p.block_bytes[j]);
      dsts.push_back(static_cast<char*>(p.to[j]) + static_cast<int64_t>(hd[t]) * p.block_bytes[j]);
      sizes.push_back(static_cast<size_t>(p.block_bytes[j]));
    }
  }
  std::lock_guard<std::mutex> lock(g_mu);
  StartedCopy c;
  if ((e0 = enter_lane(stream, p, lane_id, &c)).failure()) return e0;
  Lane& lane = *c.lane;
  if (!sizes.empty()) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.srcLocHint.type = cudaMemLocationTypeHost;
    int dev = 0;
    cudaGetDevice(&dev);
    attr.dstLocHint.type = cudaMemLocationTypeDevice;
    attr.dstLocHint.id = dev;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t idx = 0;
    if ((err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), sizes.size(), &attr, &idx, 1,
                                    lane.stream)) != cudaSuccess) {
      return cuda_error("cudaMemcpyBatchAsync", err);
    }
  }
  return leave_lane(&c);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherDmaStart, GatherDmaStartImpl,
                              copy_binding()
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<ffi::Span<const int64_t>>("block_bytes")
                                  .Attr<int32_t>("lane"));

// A wait's operands: src/dst (kept alive until the copy is done), `after` (orders the wait), the
// caches being written x n (aliased to the results), and the results, complete.
static auto wait_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::S32>>()   // src
      .Arg<ffi::Buffer<ffi::S32>>()   // dst
      .Arg<ffi::AnyBuffer>()          // after
      .RemainingArgs()
      .RemainingRets();
}

// A wait's results, after its wait is on `stream`: each output XLA placed apart from its input
// starts as a copy of it (counted; not seen so far)
static ffi::Error wait_outputs(cudaStream_t stream, const ffi::RemainingArgs& args, const ffi::RemainingRets& rets) {
  for (size_t j = 0; j < rets.size(); ++j) {
    auto in = args.get<ffi::AnyBuffer>(j);
    auto out = rets.get<ffi::AnyBuffer>(j);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("a wait's caches must be buffers");
    if (in->untyped_data() == (*out)->untyped_data()) continue;
    count_unaliased((*out)->size_bytes());
    const cudaError_t err = cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(), (*out)->size_bytes(),
                                            cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return cuda_error("cudaMemcpyAsync (unaliased output)", err);
  }
  return ffi::Error::Success();
}

static ffi::Error GatherWaitImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                 ffi::AnyBuffer after, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)src; (void)dst; (void)after;  // operands only to keep them alive and to order the wait
  if (rets.size() < 1 || args.size() != rets.size()) {
    return ffi::Error::InvalidArgument("a wait takes the started caches and returns them");
  }
  auto first = args.get<ffi::AnyBuffer>(0);
  if (!first.has_value()) return ffi::Error::InvalidArgument("a wait's caches must be buffers");
  std::lock_guard<std::mutex> lock(g_mu);
  SideStream* s = nullptr;
  cudaError_t err = side_stream(&s);
  if (err != cudaSuccess) return cuda_error("side stream", err);
  // the start's outputs are this call's inputs
  const auto it = s->in_flight.find(reinterpret_cast<uintptr_t>(first->untyped_data()));
  if (it == s->in_flight.end()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "no copy in flight into this cache (wait without start)");
  }
  if ((err = cudaStreamWaitEvent(stream, it->second, 0)) != cudaSuccess) return cuda_error("cudaStreamWaitEvent", err);
  s->spare.push_back(it->second);
  s->in_flight.erase(it);
  return wait_outputs(stream, args, rets);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherWait, GatherWaitImpl, wait_binding());

// ---------------------------------------------------------------- diagnostics

// A point on XLA's stream, in stream order (its operand is its result, aliased): "mark<id>" in
// the trace when tracing is on, nothing otherwise.
static ffi::Error MarkImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int32_t id) {
  if (x.untyped_data() != out->untyped_data()) {
    const cudaError_t err = cudaMemcpyAsync(out->untyped_data(), x.untyped_data(), x.size_bytes(),
                                            cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return cuda_error("cudaMemcpyAsync (unaliased mark)", err);
  }
  std::lock_guard<std::mutex> lock(g_mu);
  const cudaError_t err = trace_mark("mark" + std::to_string(id), stream);
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error("trace", err);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaMark, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("id"));

extern "C" void sparda_trace_enable(int on) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_trace_on = on != 0;
}

extern "C" int sparda_trace_count() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int>(g_trace.size());
}

// Entry i: its label (NUL-terminated, at most `cap` bytes) and its time in ms after entry 0.
// Synchronises on the events; -1 when i is out of range or an event failed.
extern "C" int sparda_trace_read(int i, char* label, int cap, float* ms) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (i < 0 || i >= static_cast<int>(g_trace.size()) || cap < 1) return -1;
  const auto& e = g_trace[i];
  std::snprintf(label, cap, "%s", e.first.c_str());
  if (cudaEventSynchronize(e.second) != cudaSuccess || cudaEventSynchronize(g_trace[0].second) != cudaSuccess) return -1;
  return cudaEventElapsedTime(ms, g_trace[0].second, e.second) == cudaSuccess ? 0 : -1;
}

// what 0: handler calls that copied an unaliased output first; 1: their bytes. reset: zero both.
extern "C" int64_t sparda_unaliased(int what) { return what == 0 ? g_unaliased_calls.load() : g_unaliased_bytes.load(); }

extern "C" void sparda_reset_unaliased() { g_unaliased_calls = 0; g_unaliased_bytes = 0; }

extern "C" void sparda_trace_reset() {
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& e : g_trace) cudaEventDestroy(e.second);
  g_trace.clear();
}

// ---------------------------------------------------------------- write-back into the host pool

// src: the cache slot of each task, dst: its pool block; from = caches, to = pools (aliased)
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaScatterBlocks, CopyImpl,
                              copy_call_binding());

// ---------------------------------------------------------------- the same two, inside CUDA graphs

// The synchronous gather and the write-back again, declared safe to record into XLA's command
// buffers (CUDA graphs): they only launch a kernel (and, if unaliased, a memcpy) on XLA's stream.
// Without the trait XLA cuts its graph at every call; at 32 layers a decode step's host time was
// 10-22 ms on the H200 (bench/results/decode_b8_32layers.json). Recorded, the host-side checks
// and the unaliased counter run when XLA records the graph, not at every replay.
// Opt-in (`copy_in_graph`) until timed on the GPU.
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherBlocksGraph, CopyImpl,
                              copy_call_binding(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaScatterBlocksGraph, CopyImpl,
                              copy_call_binding(),
                              {ffi::Traits::kCmdBufferCompatible});

// Where CUDA places a buffer (cudaPointerGetAttributes): a cudaMemoryType (0 unregistered, i.e.
// pageable host memory; 1 page-locked host; 2 device; 3 managed), or -1 if the query failed.
// The engine checks its host pools with it: XLA's VMM allocator, which its command-buffer
// update modes other than ALWAYS_UPDATE force, placed pinned_host arrays in device memory on the
// H200 (f43841a), where a gather from them is no offload.
extern "C" int sparda_memory_type(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for the next call's cudaGetLastError
    return -1;
  }
  return static_cast<int>(a.type);
}

// ---------------------------------------------------------------- doorbell copies (copy_kernels.cuh)
//
//   SpardaDoorbellServe  launches the step's server grid (num_ctas CTAs, n_jobs jobs) on its own
//                        high-priority stream, outside XLA's graphs; returns src (aliased), which
//                        the step's first ring takes, so the server is launched before any wait.
//                        A broken protocol stops the context from the device (doorbell_fail); the
//                        serve also refuses to go on once its error word is set.
//   SpardaDoorbellRing   posts job `job` (the gather's operands, as SpardaGatherBlocks's) on XLA's
//                        stream: a one-thread kernel, recordable into XLA's graphs.
//   SpardaDoorbellWait   XLA's stream spins (one thread) until job `job` is done; the operands of
//                        SpardaGatherWait. Recordable too.
// The doorbell (device memory) and the watchdog word (mapped host memory) are made by
// sparda_doorbell_init, called from Python before the first trace: nothing may be allocated
// while XLA records a graph.

namespace {

struct DoorbellState {
  Doorbell* bell = nullptr;
  int* error = nullptr;         // mapped pinned host memory, written by doorbell_fail
  int* error_device = nullptr;  // its device address
  cudaStream_t stream = nullptr;
};

std::unordered_map<int, DoorbellState> g_doorbell;

ffi::Error doorbell_of(DoorbellState** out) {
  int dev = 0;
  const cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return cuda_error("cudaGetDevice", err);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_doorbell.find(dev);
  if (it == g_doorbell.end()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "doorbell not initialised (sparda_doorbell_init)");
  }
  *out = &it->second;
  return ffi::Error::Success();
}

}  // namespace

// CUDA loads kernels lazily (CUDA_MODULE_LOADING=LAZY, the default since 12.2), at their first
// launch or graph capture, and a load may synchronise the context. A ring or wait loaded while
// the step's server spins would wait for the server, which waits for the ring: the first doorbell
// run on the H200 (329d606) deadlocked there until the watchdog (the CUDA guide's lazy-loading
// hazard "concurrent execution"). cudaFuncGetAttributes loads a kernel without running it; every
// kernel of this library is loaded here, as any of them may first run beside a server.
static cudaError_t preload_kernels() {
  cudaFuncAttributes a;
  cudaError_t err;
  if ((err = cudaFuncGetAttributes(&a, doorbell_server_kernel)) != cudaSuccess ||
      (err = cudaFuncGetAttributes(&a, doorbell_ring_kernel)) != cudaSuccess ||
      (err = cudaFuncGetAttributes(&a, doorbell_wait_kernel)) != cudaSuccess ||
      (err = cudaFuncGetAttributes(&a, copy_blocks_kernel)) != cudaSuccess ||
      (err = cudaFuncGetAttributes(&a, copy_groups_kernel)) != cudaSuccess) {
    return err;
  }
  return cudaSuccess;
}

// 0 on success, else a cudaError_t. Idempotent per device; for the device current on the calling
// thread (the engine runs on one GPU).
extern "C" int sparda_doorbell_init() {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return static_cast<int>(err);
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_doorbell.count(dev)) return 0;
  DoorbellState st;
  int least = 0, greatest = 0;
  if ((err = cudaMalloc(&st.bell, sizeof(Doorbell))) != cudaSuccess ||
      (err = cudaMemset(st.bell, 0, sizeof(Doorbell))) != cudaSuccess ||
      (err = cudaHostAlloc(&st.error, sizeof(int), cudaHostAllocMapped)) != cudaSuccess ||
      (err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.error_device), st.error, 0)) != cudaSuccess ||
      (err = cudaDeviceGetStreamPriorityRange(&least, &greatest)) != cudaSuccess ||
      (err = cudaStreamCreateWithPriority(&st.stream, cudaStreamNonBlocking, greatest)) != cudaSuccess ||
      (err = preload_kernels()) != cudaSuccess ||
      (err = cudaDeviceSynchronize()) != cudaSuccess) {
    return static_cast<int>(err);
  }
  *st.error = 0;
  g_doorbell[dev] = st;
  return 0;
}

// Diagnostics: the last step's timeline (Doorbell::t) for jobs 0..n_jobs-1 into
// out[n_jobs][kMarks], as signed ns after that step's server began (a ring may come before it);
// NaN for a job beyond the step's count or a mark not written. Read after the step has finished:
// a synchronous copy on the legacy stream, which waits on none of the (non-blocking) streams.
// 0 on success, -1 before any step (or n_jobs outside 1..kMaxJobs), else a cudaError_t.
extern "C" int sparda_doorbell_timeline(int n_jobs, double* out) {
  DoorbellState* st = nullptr;
  if (n_jobs < 1 || n_jobs > kMaxJobs || doorbell_of(&st).failure()) return -1;
  unsigned long long served = 0;
  int served_jobs = 0;
  std::vector<unsigned long long> t(static_cast<size_t>(n_jobs) * kMarks);
  cudaError_t err = cudaMemcpy(&served, &st->bell->served, sizeof(served), cudaMemcpyDeviceToHost);
  if (err == cudaSuccess) {
    err = cudaMemcpy(&served_jobs, &st->bell->served_jobs, sizeof(served_jobs), cudaMemcpyDeviceToHost);
  }
  if (err == cudaSuccess) {
    err = cudaMemcpy(t.data(), &st->bell->t[0][0], t.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
  }
  if (err != cudaSuccess) return static_cast<int>(err);
  if (served == 0) return -1;
  for (int j = 0; j < n_jobs; ++j) {
    for (int m = 0; m < kMarks; ++m) {
      const unsigned long long v = t[static_cast<size_t>(j) * kMarks + m];
      out[j * kMarks + m] = (j >= served_jobs || v == 0) ? std::nan("")
                                                         : static_cast<double>(static_cast<long long>(v - served));
    }
  }
  return 0;
}

static ffi::Error DoorbellServeImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Result<ffi::Buffer<ffi::S32>> out,
                                    int32_t n_jobs, int32_t num_ctas, int32_t threads) {
  if (n_jobs < 1 || n_jobs > kMaxJobs) return ffi::Error::InvalidArgument("n_jobs must be in 1..256");
  ffi::Error e = check_threads(threads);
  if (e.failure()) return e;
  DoorbellState* st = nullptr;
  if ((e = doorbell_of(&st)).failure()) return e;
  if (*reinterpret_cast<volatile int*>(st->error) != 0) {  // written by a spin of an earlier step
    return ffi::Error::Internal("doorbell copy: stopped by the device (error " +
                                std::to_string(*reinterpret_cast<volatile int*>(st->error)) +
                                ": 1 a spin waited > ~10 s, 2 a ring beyond the served jobs)");
  }
  cudaError_t err;
  if (src.typed_data() != out->typed_data() &&
      (err = cudaMemcpyAsync(out->typed_data(), src.typed_data(), src.size_bytes(), cudaMemcpyDeviceToDevice,
                             stream)) != cudaSuccess) {
    return cuda_error("cudaMemcpyAsync (unaliased serve)", err);
  }
  doorbell_server_kernel<<<num_ctas < 1 ? 1 : num_ctas, threads, 0, st->stream>>>(st->bell, n_jobs,
                                                                                  st->error_device);
  if ((err = cudaGetLastError()) != cudaSuccess) return cuda_error("doorbell server launch", err);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaDoorbellServe, DoorbellServeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("n_jobs")
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<int32_t>("threads"));

static ffi::Error DoorbellRingImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                   ffi::RemainingArgs args, ffi::RemainingRets rets,
                                   ffi::Span<const int64_t> block_bytes, int32_t job) {
  if (job < 0 || job >= kMaxJobs) return ffi::Error::InvalidArgument("job must be in 0..255");
  CopyPayloads p;
  ffi::Error e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), &p);
  if (e.failure()) return e;
  if ((e = alias_or_copy(stream, p)).failure()) return e;
  DoorbellState* st = nullptr;
  if ((e = doorbell_of(&st)).failure()) return e;
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
  doorbell_ring_kernel<<<1, 1, 0, stream>>>(st->bell, job, k, src.typed_data(), dst.typed_data(),
                                            static_cast<int64_t>(src.element_count()), p.n_from, p.n_to);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error("doorbell ring launch", err);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaDoorbellRing, DoorbellRingImpl,
                              copy_binding()
                                  .Attr<ffi::Span<const int64_t>>("block_bytes")
                                  .Attr<int32_t>("job"),
                              {ffi::Traits::kCmdBufferCompatible});

static ffi::Error DoorbellWaitImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                   ffi::AnyBuffer after, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                   int32_t job) {
  (void)src; (void)dst; (void)after;  // operands only to keep them alive and to order the wait
  if (job < 0 || job >= kMaxJobs) return ffi::Error::InvalidArgument("job must be in 0..255");
  if (rets.size() < 1 || args.size() != rets.size()) {
    return ffi::Error::InvalidArgument("a wait takes the rung caches and returns them");
  }
  DoorbellState* st = nullptr;
  ffi::Error e = doorbell_of(&st);
  if (e.failure()) return e;
  doorbell_wait_kernel<<<1, 1, 0, stream>>>(st->bell, job, st->error_device);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error("doorbell wait launch", err);
  return wait_outputs(stream, args, rets);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaDoorbellWait, DoorbellWaitImpl, wait_binding().Attr<int32_t>("job"),
                              {ffi::Traits::kCmdBufferCompatible});
