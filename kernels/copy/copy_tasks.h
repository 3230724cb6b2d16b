// sparda-jax copy engine: the argument rules every copy obeys, shared by the CUDA handlers
// (gather_blocks.cu) and their CPU twin (gather_blocks_host.cc) so the two cannot drift apart.
// A copy moves whole blocks of block_bytes from `from` to `to` by task lists src/dst of equal
// length; a task with an index out of range is skipped by both.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

inline xla::ffi::Error check_copy_args(size_t from_bytes, size_t to_bytes, size_t n_src, size_t n_dst,
                                       int64_t block_bytes) {
  if (block_bytes <= 0 || block_bytes % 16 != 0) {
    return xla::ffi::Error::InvalidArgument("block_bytes must be a positive multiple of 16");
  }
  if (from_bytes % block_bytes != 0 || to_bytes % block_bytes != 0) {
    return xla::ffi::Error::InvalidArgument("pool and cache sizes must be whole blocks");
  }
  if (n_src != n_dst) {
    return xla::ffi::Error::InvalidArgument("src and dst must have the same length");
  }
  return xla::ffi::Error::Success();
}
