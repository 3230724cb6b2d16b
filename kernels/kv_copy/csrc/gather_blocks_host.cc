// sparda-jax KV copy, the CPU twin of gather_blocks.cu: the same four XLA FFI targets with the
// same operands, aliasing and start/wait bookkeeping, registered for the CPU platform, so that
// what XLA does to these calls inside the engine's jit (which buffers it aliases, copies or
// reuses between a start and its wait) is exercised on a machine without a GPU.
//
// The copies are plain memcpy, synchronous: a start completes its copy before it returns, and a
// wait only checks the pairing. What carries over from the GPU is the protocol: a start
// registers the address of the buffer it writes, its wait must receive that very buffer, and a
// second start into a buffer that is still registered is an error. On the GPU a buffer that XLA
// copied or reused between the two would be read or written while the side stream still writes
// it, so the CUDA handlers refuse it with the same messages as these.

#include <cstdint>
#include <cstring>
#include <mutex>
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

namespace {

std::mutex g_mu;
std::unordered_set<uintptr_t> g_in_flight;  // the buffer of each started copy, until its wait
int64_t g_unaliased[2] = {0, 0};           // handler calls that got an output apart from its input; their bytes

void count_unaliased(size_t bytes) {  // g_mu held
  g_unaliased[0] += 1;
  g_unaliased[1] += static_cast<int64_t>(bytes);
}

void alias_or_copy(const CopyPayloads& p) {
  std::lock_guard<std::mutex> lock(g_mu);
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
                           int32_t threads) {
  (void)num_ctas;
  ffi::Error e = check_threads(threads);
  if (e.failure()) return e;
  CopyPayloads p;
  if ((e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), &p)).failure()) return e;
  alias_or_copy(p);
  copy_rows(p, src, dst);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherBlocksHost, CopyImpl, with_copy_attrs(copy_binding()));

// src: the cache slot of each task, dst: its pool block; from = caches, to = pools (aliased)
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaScatterBlocksHost, CopyImpl, with_copy_attrs(copy_binding()));

static ffi::Error GatherStartImpl(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::RemainingArgs args,
                                  ffi::RemainingRets rets, int32_t num_ctas, ffi::Span<const int64_t> block_bytes,
                                  int32_t lane, int32_t threads) {
  (void)num_ctas;
  CopyPayloads p;
  ffi::Error e = decode_payloads(args, rets, block_bytes, src.element_count(), dst.element_count(), &p);
  if (e.failure()) return e;
  if ((e = check_lane(lane)).failure()) return e;
  if ((e = check_threads(threads)).failure()) return e;
  alias_or_copy(p);
  std::lock_guard<std::mutex> lock(g_mu);
  for (int j = 0; j < p.n; ++j) {
    if (g_in_flight.count(reinterpret_cast<uintptr_t>(p.to[j]))) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "a copy into this cache is already in flight");
    }
  }
  copy_rows(p, src, dst);
  for (int j = 0; j < p.n; ++j) g_in_flight.insert(reinterpret_cast<uintptr_t>(p.to[j]));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherStartHost, GatherStartImpl,
                              copy_binding()
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<ffi::Span<const int64_t>>("block_bytes")
                                  .Attr<int32_t>("lane")
                                  .Attr<int32_t>("threads"));

// A wait takes arrays to order it after (`after` and any more), then the caches of its start (all
// of them, or one per wait of a one-payload start).
static ffi::Error GatherWaitImpl(ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer after,
                                 ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)src;
  (void)dst;
  (void)after;
  ffi::Error e = check_wait_payloads(args, rets);
  if (e.failure()) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  for (size_t j = 0; j < rets.size(); ++j) {
    auto in = wait_cache(args, rets, j);
    auto out = rets.get<ffi::AnyBuffer>(j);
    if (g_in_flight.erase(reinterpret_cast<uintptr_t>(in->untyped_data())) == 0) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "no copy in flight into this cache (wait without start)");
    }
    if (in->untyped_data() != (*out)->untyped_data()) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), (*out)->size_bytes());
      count_unaliased((*out)->size_bytes());
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherWaitHost, GatherWaitImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Arg<ffi::AnyBuffer>()          // after
                                  .RemainingArgs()
                                  .RemainingRets());

// How many starts are still waiting for their wait: 0 after every complete engine step.
extern "C" int64_t sparda_host_copies_in_flight() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int64_t>(g_in_flight.size());
}

extern "C" void sparda_host_reset_in_flight() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_in_flight.clear();
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
