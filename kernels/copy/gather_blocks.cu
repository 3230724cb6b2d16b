// sparda-jax copy engine: gather KV blocks from pinned host memory into device cache slots.
//
// An XLA FFI handler. The host pool is an ordinary operand in the pinned_host memory kind:
// XLA hands the handler its host pointer, which the GPU reads directly over unified virtual
// addressing (UVA). One launch of a bounded, persistent grid: `num_ctas` CTAs loop over the
// copy tasks, so the copy holds few SMs while attention and FFN run beside it (the paper's
// CTA quota). Each task moves one block of `block_bytes` with 16-byte loads and stores.
//
//   pool   [n_pool, block_bytes]   host (pinned), any dtype, viewed as bytes
//   src    int32 [n]               pool block per task (< 0: no task)
//   dst    int32 [n]               cache slot per task
//   cache  [n_slots, block_bytes]  device, aliased to the output (updated in place)

#include <cstdint>
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

__global__ void gather_blocks_kernel(const uint4* __restrict__ pool, const int32_t* __restrict__ src,
                                     const int32_t* __restrict__ dst, uint4* __restrict__ cache, int64_t n_tasks,
                                     int64_t vecs_per_block, int64_t n_pool, int64_t n_slots) {
  for (int64_t t = blockIdx.x; t < n_tasks; t += gridDim.x) {
    const int32_t s = src[t];
    const int32_t d = dst[t];
    if (s < 0 || s >= n_pool || d < 0 || d >= n_slots) continue;
    const uint4* from = pool + static_cast<int64_t>(s) * vecs_per_block;
    uint4* to = cache + static_cast<int64_t>(d) * vecs_per_block;
    for (int64_t i = threadIdx.x; i < vecs_per_block; i += blockDim.x) {
      to[i] = from[i];
    }
  }
}

static ffi::Error GatherBlocksImpl(cudaStream_t stream, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src,
                                   ffi::Buffer<ffi::S32> dst, ffi::AnyBuffer cache_in,
                                   ffi::Result<ffi::AnyBuffer> cache_out, int32_t num_ctas, int64_t block_bytes) {
  if (block_bytes <= 0 || block_bytes % 16 != 0) {
    return ffi::Error::InvalidArgument("block_bytes must be a positive multiple of 16");
  }
  if (pool.size_bytes() % block_bytes != 0 || cache_out->size_bytes() % block_bytes != 0) {
    return ffi::Error::InvalidArgument("pool and cache sizes must be whole blocks");
  }
  if (src.element_count() != dst.element_count()) {
    return ffi::Error::InvalidArgument("src and dst must have the same length");
  }
  if (cache_in.untyped_data() != cache_out->untyped_data()) {
    return ffi::Error::InvalidArgument("the cache must be aliased to the output (input_output_aliases)");
  }
  const auto p = reinterpret_cast<uintptr_t>(pool.untyped_data());
  const auto c = reinterpret_cast<uintptr_t>(cache_out->untyped_data());
  if (p % 16 != 0 || c % 16 != 0) {
    return ffi::Error::InvalidArgument("pool and cache must be 16-byte aligned");
  }
  const int64_t n = static_cast<int64_t>(src.element_count());
  if (n == 0) return ffi::Error::Success();
  const int grid = static_cast<int>(num_ctas < 1 ? 1 : (num_ctas > n ? n : num_ctas));
  gather_blocks_kernel<<<grid, 256, 0, stream>>>(
      static_cast<const uint4*>(pool.untyped_data()), src.typed_data(), dst.typed_data(),
      static_cast<uint4*>(cache_out->untyped_data()), n, block_bytes / 16,
      static_cast<int64_t>(pool.size_bytes() / block_bytes), static_cast<int64_t>(cache_out->size_bytes() / block_bytes));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("gather_blocks launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
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
