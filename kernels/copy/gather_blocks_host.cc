// sparda-jax copy engine, the CPU twin of gather_blocks.cu: the same four XLA FFI targets with
// the same operands, aliasing and start/wait bookkeeping, registered for the CPU platform, so
// that what XLA does to these calls inside the engine's jit (which buffers it aliases, copies or
// reuses between a start and its wait) is exercised in CI, on a machine without a GPU.
//
// The copies are plain memcpy, synchronous: a start completes its copy before it returns, and a
// wait only checks the pairing. What carries over from the GPU is the protocol: a start
// registers the address of the buffer it writes, its wait must receive that very buffer, and a
// second start into a buffer that is still registered is an error. On the GPU a buffer that XLA
// copied or reused between the two would be read or written while the side stream still writes
// it, so the CUDA handlers refuse it with the same messages as these.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "copy_tasks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The leading operands of every copy handler but the wait: the task lists src/dst (int32
// [n]), then per payload its `from` buffer x n and the aliased `to` inputs x n, and the `to`
// results x n (gather: pools -> caches; write-back: caches -> pools). Attributes follow.
static auto copy_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::S32>>()   // src
      .Arg<ffi::Buffer<ffi::S32>>()   // dst
      .RemainingArgs()
      .RemainingRets();
}

// The synchronous copies' whole signature: the leading operands, then their attributes
static auto copy_call_binding() { return with_copy_attrs(copy_binding()); }

namespace {

std::mutex g_mu;
std::unordered_set<uintptr_t> g_in_flight;  // the first buffer of each started copy, until its wait
int64_t g_unaliased[2] = {0, 0};           // handler calls that got an output apart from its input; their bytes

void count_unaliased(size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_unaliased[0] += 1;
  g_unaliased[1] += static_cast<int64_t>(bytes);
}

void alias_or_copy(const CopyPayloads& p) {
  for (int j = 0; j < p.n; ++j) {
    if (p.to_in[j] != p.to[j]) {
      std::memcpy(p.to[j], p.to_in[j], p.to_bytes[j]);
      count_unaliased(p.to_bytes[j]);
    }
  }
}

// to_j[dst[t]] = from_j[src[t]] for every payload j, the CUDA kernel's rules: whole blocks, a
// task with an index out of range is skipped
void copy_rows(const CopyPayloads& p, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst) {
  const int32_t* s = src.typed_data();
  const int32_t* d = dst.typed_data();
  for (size_t t = 0; t < src.element_count(); ++t) {
    if (s[t] < 0 || s[t] >= p.n_from || d[t] < 0 || d[t] >= p.n_to) continue;
    for (int j = 0; j < p.n; ++j) {
      const int64_t bb = p.block_bytes[j];
      std::memcpy(static_cast<char*>(p.to[j]) + d[t] * bb, static_cast<const char*>(p.from[j]) + s[t] * bb, bb);
    }
  }
}

}  // namespace

// The gather and the write-back: the same copy with the sides swapped (their operands say which)
static ffi::Error CopyImpl(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, int32_t num_ctas, ffi::Span<const int64_t> block_bytes,
                           int32_t threads, int32_t group) {
  (void)num_ctas;
  ffi::Error e = check_threads(threads);
  if (e.failure()) return e;
  if ((e = check_group(group)).failure()) return e;
  CopyPayloads p;
  e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), &p);
  if (e.failure()) return e;
  alias_or_copy(p);
  copy_rows(p, src, dst);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherBlocksHost, CopyImpl,
                              copy_call_binding());

static ffi::Error GatherStartImpl(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::RemainingArgs args,
                                  ffi::RemainingRets rets, int32_t num_ctas, ffi::Span<const int64_t> block_bytes,
                                  int32_t resident, int32_t lane, int32_t threads, int32_t group) {
  (void)num_ctas;
  (void)resident;
  ffi::Error e0 = check_threads(threads);
  if (e0.failure()) return e0;
  if ((e0 = check_group(group)).failure()) return e0;
  if ((e0 = check_lane(lane)).failure()) return e0;
  CopyPayloads p;
  ffi::Error e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), &p);
  if (e.failure()) return e;
  alias_or_copy(p);
  std::lock_guard<std::mutex> lock(g_mu);
  const auto key = reinterpret_cast<uintptr_t>(p.to[0]);  // a copy is known by its first cache
  if (g_in_flight.count(key)) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "a copy into this cache is already in flight");
  }
  copy_rows(p, src, dst);
  g_in_flight.insert(key);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherStartHost, GatherStartImpl,
                              copy_binding()
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<ffi::Span<const int64_t>>("block_bytes")
                                  .Attr<int32_t>("resident")
                                  .Attr<int32_t>("lane")
                                  .Attr<int32_t>("threads")
                                  .Attr<int32_t>("group"));

// The DMA start's twin: the same copy as the start (the CPU has one kind of copy)
static ffi::Error GatherDmaStartImpl(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::RemainingArgs args,
                                     ffi::RemainingRets rets, int32_t num_ctas, ffi::Span<const int64_t> block_bytes,
                                     int32_t lane) {
  return GatherStartImpl(src, dst, args, rets, num_ctas, block_bytes, 0, lane, 256, 1);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherDmaStartHost, GatherDmaStartImpl,
                              copy_binding()
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<ffi::Span<const int64_t>>("block_bytes")
                                  .Attr<int32_t>("lane"));

static ffi::Error GatherWaitImpl(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer after,
                                 ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)src;
  (void)dst;
  (void)after;
  if (rets.size() < 1 || args.size() != rets.size()) {
    return ffi::Error::InvalidArgument("a wait takes the started caches and returns them");
  }
  auto first = args.get<ffi::AnyBuffer>(0);
  if (!first.has_value()) return ffi::Error::InvalidArgument("a wait's caches must be buffers");
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_in_flight.erase(reinterpret_cast<uintptr_t>(first->untyped_data())) == 0) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "no copy in flight into this cache (wait without start)");
  }
  for (size_t j = 0; j < rets.size(); ++j) {
    auto in = args.get<ffi::AnyBuffer>(j);
    auto out = rets.get<ffi::AnyBuffer>(j);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("a wait's caches must be buffers");
    if (in->untyped_data() != (*out)->untyped_data()) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), (*out)->size_bytes());
      g_unaliased[0] += 1;  // g_mu is held
      g_unaliased[1] += static_cast<int64_t>((*out)->size_bytes());
    }
  }
  return ffi::Error::Success();
}

// A wait's operands: src, dst, after, the caches being written x n (aliased), the results
static auto wait_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::S32>>()   // src
      .Arg<ffi::Buffer<ffi::S32>>()   // dst
      .Arg<ffi::AnyBuffer>()          // after
      .RemainingArgs()
      .RemainingRets();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherWaitHost, GatherWaitImpl, wait_binding());

// src: the cache slot of each task, dst: its pool block; from = caches, to = pools (aliased)
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaScatterBlocksHost, CopyImpl,
                              copy_call_binding());

// The command-buffer variants' twins: the CPU has no graphs, so the same copies
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherBlocksGraphHost, CopyImpl,
                              copy_call_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaScatterBlocksGraphHost, CopyImpl,
                              copy_call_binding());

// The diagnostics mark's twin: the identity (the CPU has no timeline to record)
static ffi::Error MarkImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int32_t id) {
  (void)id;
  if (x.untyped_data() != out->untyped_data()) std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaMarkHost, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("id"));

// The doorbell copies' twins (gather_blocks.cu: serve, ring, wait). A ring is a start, its wait a
// wait; the serve checks what would hang the GPU's server: every serve's step must ring jobs
// 0..n_jobs-1 in order, each exactly once, before the next serve.
namespace {
int g_jobs_expected = 0, g_jobs_rung = 0;
bool g_served = false;
std::unordered_map<uintptr_t, int> g_ring_job;  // the job rung into each cache, until its wait
// the GPU's timeline (Doorbell::t) on the host clock: serve, then per job ring, copy begin and
// end (the twin copies inside its ring), wait begin and end
// copy_kernels.cuh's limits and marks (a CUDA header this file cannot include)
constexpr int kMaxJobs = 256;
enum DoorbellMark { kRing = 0, kCopyBegin, kCopyEnd, kWaitBegin, kWaitEnd, kMarks };
long long g_served_ns = 0;
long long g_t[kMaxJobs][kMarks] = {};

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

static ffi::Error DoorbellServeImpl(ffi::Buffer<ffi::S32> src, ffi::Result<ffi::Buffer<ffi::S32>> out,
                                    int32_t n_jobs, int32_t num_ctas, int32_t threads) {
  (void)num_ctas;
  if (n_jobs < 1 || n_jobs > 256) return ffi::Error::InvalidArgument("n_jobs must be in 1..256");
  ffi::Error e = check_threads(threads);
  if (e.failure()) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_served && g_jobs_rung != g_jobs_expected) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "doorbell: the previous step rang " + std::to_string(g_jobs_rung) + " of its " +
                          std::to_string(g_jobs_expected) + " jobs (its server would never finish)");
  }
  g_served = true;
  g_jobs_expected = n_jobs;
  g_jobs_rung = 0;
  g_served_ns = now_ns();
  if (src.typed_data() != out->typed_data()) std::memcpy(out->typed_data(), src.typed_data(), src.size_bytes());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaDoorbellServeHost, DoorbellServeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("n_jobs")
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<int32_t>("threads"));

static ffi::Error DoorbellRingImpl(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::RemainingArgs args,
                                   ffi::RemainingRets rets, ffi::Span<const int64_t> block_bytes, int32_t job) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_served || job != g_jobs_rung || job >= g_jobs_expected) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "doorbell: ring of job " + std::to_string(job) + " where the server expects job " +
                            std::to_string(g_jobs_rung) + " of " + std::to_string(g_jobs_expected));
    }
    g_jobs_rung += 1;
    g_t[job][kRing] = g_t[job][kCopyBegin] = now_ns();
  }
  ffi::Error e = GatherStartImpl(src, dst, args, rets, 1, block_bytes, 0, 0, 256, 1);
  if (e.failure()) return e;
  auto first = rets.get<ffi::AnyBuffer>(0);
  std::lock_guard<std::mutex> lock(g_mu);
  g_t[job][kCopyEnd] = now_ns();
  g_ring_job[reinterpret_cast<uintptr_t>((*first)->untyped_data())] = job;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaDoorbellRingHost, DoorbellRingImpl,
                              copy_binding()
                                  .Attr<ffi::Span<const int64_t>>("block_bytes")
                                  .Attr<int32_t>("job"));

static ffi::Error DoorbellWaitImpl(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer after,
                                   ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t job) {
  auto first = args.get<ffi::AnyBuffer>(0);
  if (!first.has_value()) return ffi::Error::InvalidArgument("a wait's caches must be buffers");
  {
    std::lock_guard<std::mutex> lock(g_mu);
    const auto it = g_ring_job.find(reinterpret_cast<uintptr_t>(first->untyped_data()));
    if (it == g_ring_job.end() || it->second != job) {  // on the GPU: a wait on another job's flag
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "doorbell: wait for job " + std::to_string(job) + " on a cache rung as job " +
                            (it == g_ring_job.end() ? std::string("none") : std::to_string(it->second)));
    }
    g_ring_job.erase(it);
    g_t[job][kWaitBegin] = now_ns();
  }
  ffi::Error e = GatherWaitImpl(src, dst, after, args, rets);
  std::lock_guard<std::mutex> lock(g_mu);
  g_t[job][kWaitEnd] = now_ns();
  return e;
}

// The last step's timeline as sparda_doorbell_timeline's (ns after the serve; NaN beyond the
// step's jobs or where a mark was not written).
extern "C" int sparda_doorbell_timelineHost(int n_jobs, double* out) {
  if (n_jobs < 1 || n_jobs > kMaxJobs) return -1;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_served_ns == 0) return -1;
  for (int j = 0; j < n_jobs; ++j) {
    for (int m = 0; m < kMarks; ++m) {
      out[j * kMarks + m] = (j >= g_jobs_expected || g_t[j][m] == 0) ? std::nan("")
                                                                     : static_cast<double>(g_t[j][m] - g_served_ns);
    }
  }
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaDoorbellWaitHost, DoorbellWaitImpl, wait_binding().Attr<int32_t>("job"));

// How many starts are still waiting for their wait: 0 after every complete engine step.
extern "C" int64_t sparda_host_copies_in_flight() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int64_t>(g_in_flight.size());
}

// Handler calls whose output XLA placed apart from its aliased input (each copied the whole buffer
// first), and the bytes so copied: `what` 0 calls, 1 bytes (the CUDA handlers' sparda_unaliased).
extern "C" int64_t sparda_unaliasedHost(int what) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_unaliased[what == 0 ? 0 : 1];
}

extern "C" void sparda_reset_unaliasedHost() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_unaliased[0] = g_unaliased[1] = 0;
}

extern "C" void sparda_host_reset_in_flight() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_in_flight.clear();
  g_served = false;  // and the doorbell's step bookkeeping
  g_jobs_expected = g_jobs_rung = 0;
  g_ring_job.clear();
}
