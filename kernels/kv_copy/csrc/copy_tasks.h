// sparda-jax KV copy: the argument rules every copy obeys, shared by the CUDA handlers
// (gather_blocks.cu) and their CPU twin (gather_blocks_host.cc) so the two cannot drift apart.
//
// One copy moves whole blocks by task lists src/dst of equal length, for up to kMaxPayloads
// payloads at once (a layer's K, V and NOSA's cis): task t moves block src[t] of every payload's
// `from` buffer to block dst[t] of its `to` buffer, in one launch (the synchronous gather, the
// write-back and an asynchronous start: gather_blocks.cu).
// The payloads of one copy have the same number of blocks on each side, of their own byte
// sizes. A task with an index out of range on either side is skipped by both implementations.
//
// Operands of every handler, after its fixed ones (src, dst, ...): `from` x n, then the
// inputs aliased to the results x n; results: the `to` buffers x n.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

constexpr int kMaxPayloads = 4;

// The synchronous copies' (gather, write-back) attributes, after the leading operands that each
// library binds its own way (the CUDA handlers take XLA's stream first): one list for both.
template <typename Binding>
auto with_copy_attrs(Binding leading) {
  return std::move(leading)  // a binding grows by rvalue only
      .template Attr<int32_t>("num_ctas")
      .template Attr<xla::ffi::Span<const int64_t>>("block_bytes")
      .template Attr<int32_t>("threads");
}

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

// Threads per copy CTA (each keeps 4 16-byte loads in flight): a warp multiple CUDA can launch.
inline xla::ffi::Error check_threads(int32_t threads) {
  if (threads < 32 || threads > 1024 || threads % 32 != 0) {
    return xla::ffi::Error::InvalidArgument("threads must be a multiple of 32 in 32..1024");
  }
  return xla::ffi::Error::Success();
}

// The side stream ("lane") an asynchronous start names: one per payload at most.
inline xla::ffi::Error check_lane(int32_t lane) {
  if (lane < 0 || lane >= kMaxPayloads) {
    return xla::ffi::Error::InvalidArgument("lane must be in 0.." + std::to_string(kMaxPayloads - 1));
  }
  return xla::ffi::Error::Success();
}

// A wait's operands after its fixed ones: more arrays to order it after (read never), then the
// caches its start wrote (1..kMaxPayloads), each aliased to a result of the same size.
// wait_cache(args, rets, j): the cache of result j (the caches come last).
inline auto wait_cache(const xla::ffi::RemainingArgs& args, const xla::ffi::RemainingRets& rets, size_t j) {
  return args.get<xla::ffi::AnyBuffer>(args.size() - rets.size() + j);
}

inline xla::ffi::Error check_wait_payloads(const xla::ffi::RemainingArgs& args, const xla::ffi::RemainingRets& rets) {
  namespace ffi = xla::ffi;
  const size_t n = rets.size();
  if (n < 1 || n > static_cast<size_t>(kMaxPayloads) || args.size() < n) {
    return ffi::Error::InvalidArgument("a wait takes the 1.." + std::to_string(kMaxPayloads) +
                                       " caches its start wrote and returns them");
  }
  for (size_t j = 0; j < n; ++j) {
    auto in = wait_cache(args, rets, j);
    auto out = rets.get<ffi::AnyBuffer>(j);
    if (!in.has_value() || !out.has_value() || in->size_bytes() != (*out)->size_bytes()) {
      return ffi::Error::InvalidArgument("a wait's caches must be buffers the size of its results");
    }
  }
  return ffi::Error::Success();
}

// The buffers of one multi-payload copy, decoded and checked.
struct CopyPayloads {
  int n = 0;
  const void* from[kMaxPayloads] = {};
  const void* to_in[kMaxPayloads] = {};  // the inputs aliased to `to` (the same buffers, unless XLA split them)
  void* to[kMaxPayloads] = {};
  size_t from_bytes[kMaxPayloads] = {};
  size_t to_bytes[kMaxPayloads] = {};
  int64_t block_bytes[kMaxPayloads] = {};
  int64_t n_from = 0;  // blocks in each `from`
  int64_t n_to = 0;    // blocks in each `to`
};

// args: from x n, to_in x n (what follows the handler's fixed operands); rets: to x n;
// block_bytes: one per payload.
inline xla::ffi::Error decode_payloads(const xla::ffi::RemainingArgs& args, const xla::ffi::RemainingRets& rets,
                                       xla::ffi::Span<const int64_t> block_bytes, size_t n_src, size_t n_dst,
                                       CopyPayloads* p) {
  namespace ffi = xla::ffi;
  const size_t n = rets.size();
  if (n < 1 || n > static_cast<size_t>(kMaxPayloads) || args.size() != 2 * n || block_bytes.size() != n) {
    return ffi::Error::InvalidArgument("a copy takes 1.." + std::to_string(kMaxPayloads) +
                                       " payloads: from x n, aliased inputs x n, results x n, block_bytes x n");
  }
  p->n = static_cast<int>(n);
  for (size_t j = 0; j < n; ++j) {
    auto from = args.get<ffi::AnyBuffer>(j);
    auto to_in = args.get<ffi::AnyBuffer>(n + j);
    auto to = rets.get<ffi::AnyBuffer>(j);
    if (!from.has_value() || !to_in.has_value() || !to.has_value()) {
      return ffi::Error::InvalidArgument("copy payload operands must be buffers");
    }
    p->from[j] = from->untyped_data();
    p->from_bytes[j] = from->size_bytes();
    p->to_in[j] = to_in->untyped_data();
    p->to[j] = (*to)->untyped_data();
    p->to_bytes[j] = (*to)->size_bytes();
    p->block_bytes[j] = block_bytes[j];
    ffi::Error e = check_copy_args(p->from_bytes[j], p->to_bytes[j], n_src, n_dst, block_bytes[j]);
    if (e.failure()) return e;
    if (to_in->size_bytes() != p->to_bytes[j]) {
      return ffi::Error::InvalidArgument("an aliased input and its result differ in size");
    }
    const int64_t nf = static_cast<int64_t>(p->from_bytes[j]) / block_bytes[j];
    const int64_t nt = static_cast<int64_t>(p->to_bytes[j]) / block_bytes[j];
    if (j == 0) {
      p->n_from = nf;
      p->n_to = nt;
    } else if (nf != p->n_from || nt != p->n_to) {
      return ffi::Error::InvalidArgument("the payloads of one copy must have the same number of blocks");
    }
  }
  return ffi::Error::Success();
}
