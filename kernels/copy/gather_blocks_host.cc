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

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_set>

#include "copy_tasks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

void alias_or_copy(const void* in, void* out, size_t bytes) {
  if (in != out) std::memcpy(out, in, bytes);
}

// cache[dst[t]] = pool[src[t]] (or the reverse for the write-back), the CUDA kernel's rules:
// whole blocks of block_bytes, a task with an index out of range is skipped
ffi::Error copy_rows(const void* from, size_t from_bytes, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                     void* to, size_t to_bytes, int64_t block_bytes) {
  ffi::Error e = check_copy_args(from_bytes, to_bytes, src.element_count(), dst.element_count(), block_bytes);
  if (e.failure()) return e;
  const int64_t n_from = static_cast<int64_t>(from_bytes) / block_bytes;
  const int64_t n_to = static_cast<int64_t>(to_bytes) / block_bytes;
  const int32_t* s = src.typed_data();
  const int32_t* d = dst.typed_data();
  for (size_t t = 0; t < src.element_count(); ++t) {
    if (s[t] < 0 || s[t] >= n_from || d[t] < 0 || d[t] >= n_to) continue;
    std::memcpy(static_cast<char*>(to) + d[t] * block_bytes, static_cast<const char*>(from) + s[t] * block_bytes,
                block_bytes);
  }
  return ffi::Error::Success();
}

std::mutex g_mu;
std::unordered_set<uintptr_t> g_in_flight;  // the buffers started copies write, until their wait

}  // namespace

static ffi::Error GatherBlocksImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                   ffi::AnyBuffer cache_in, ffi::Result<ffi::AnyBuffer> cache_out, int32_t num_ctas,
                                   int64_t block_bytes) {
  (void)num_ctas;
  alias_or_copy(cache_in.untyped_data(), cache_out->untyped_data(), cache_out->size_bytes());
  return copy_rows(pool.untyped_data(), pool.size_bytes(), src, dst, cache_out->untyped_data(),
                   cache_out->size_bytes(), block_bytes);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherBlocksHost, GatherBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Arg<ffi::AnyBuffer>()          // cache (aliased)
                                  .Ret<ffi::AnyBuffer>()          // cache
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<int64_t>("block_bytes"));

static ffi::Error GatherStartImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                  ffi::AnyBuffer cache_in, ffi::Result<ffi::AnyBuffer> cache_out, int32_t num_ctas,
                                  int64_t block_bytes, int32_t resident) {
  (void)num_ctas;
  (void)resident;
  alias_or_copy(cache_in.untyped_data(), cache_out->untyped_data(), cache_out->size_bytes());
  std::lock_guard<std::mutex> lock(g_mu);
  const auto key = reinterpret_cast<uintptr_t>(cache_out->untyped_data());
  if (g_in_flight.count(key)) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "a copy into this cache is already in flight");
  }
  ffi::Error e = copy_rows(pool.untyped_data(), pool.size_bytes(), src, dst, cache_out->untyped_data(),
                           cache_out->size_bytes(), block_bytes);
  if (e.failure()) return e;
  g_in_flight.insert(key);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherStartHost, GatherStartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Arg<ffi::AnyBuffer>()          // cache (aliased)
                                  .Ret<ffi::AnyBuffer>()          // cache, "being written"
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<int64_t>("block_bytes")
                                  .Attr<int32_t>("resident"));

static ffi::Error GatherWaitImpl(ffi::AnyBuffer cache_in, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                 ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> cache_out) {
  (void)src;
  (void)dst;
  (void)after;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_in_flight.erase(reinterpret_cast<uintptr_t>(cache_in.untyped_data())) == 0) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "no copy in flight into this cache (wait without start)");
  }
  alias_or_copy(cache_in.untyped_data(), cache_out->untyped_data(), cache_out->size_bytes());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaGatherWaitHost, GatherWaitImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // cache being written (aliased)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Arg<ffi::AnyBuffer>()          // after
                                  .Ret<ffi::AnyBuffer>());        // cache, complete

static ffi::Error ScatterBlocksImpl(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst,
                                    ffi::AnyBuffer pool_in, ffi::Result<ffi::AnyBuffer> pool_out, int32_t num_ctas,
                                    int64_t block_bytes) {
  (void)num_ctas;
  alias_or_copy(pool_in.untyped_data(), pool_out->untyped_data(), pool_out->size_bytes());
  return copy_rows(cache.untyped_data(), cache.size_bytes(), src, dst, pool_out->untyped_data(),
                   pool_out->size_bytes(), block_bytes);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpardaScatterBlocksHost, ScatterBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src: cache slot per task
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst: pool block per task
                                  .Arg<ffi::AnyBuffer>()          // pool (aliased)
                                  .Ret<ffi::AnyBuffer>()          // pool
                                  .Attr<int32_t>("num_ctas")
                                  .Attr<int64_t>("block_bytes"));

// How many starts are still waiting for their wait: 0 after every complete engine step.
extern "C" int64_t sparda_host_copies_in_flight() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int64_t>(g_in_flight.size());
}

extern "C" void sparda_host_reset_in_flight() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_in_flight.clear();
}
