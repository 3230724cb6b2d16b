"""The KV copy op: KV blocks between a (pinned) host pool and device cache slots.

`api` holds the calls (each with one `implementation=` argument: "xla" | "host_ffi" | "cuda"),
`reference` their jnp semantics, `cuda` the FFI backends (built from `csrc/` on first use) and
their tuning, `KVCopyConfig`.
"""

from .api import (CTA_CANDIDATES, DEFAULT_ORDER, IMPLEMENTATIONS, after_start, autotune_num_ctas, gather_blocks,
                  gather_blocks_start, gather_blocks_wait, host_pool, join_tokens, lane_ctas, paper_num_ctas,
                  pick_num_ctas, resolve_implementation, scatter_blocks, unaliased_copies)
from .cuda import (FFI_IMPLEMENTATIONS, KVCopyConfig, build_host_library, build_in_background, build_library,
                   host_copies_in_flight,
                   memory_type, nvcc_path, reset_host_copies_in_flight)
from .reference import MAX_PAYLOADS, gather_blocks_reference, scatter_blocks_reference

__all__ = ["gather_blocks", "gather_blocks_start", "gather_blocks_wait", "scatter_blocks", "gather_blocks_reference",
           "scatter_blocks_reference", "after_start", "join_tokens", "host_pool", "memory_type", "KVCopyConfig",
           "resolve_implementation", "IMPLEMENTATIONS", "DEFAULT_ORDER", "FFI_IMPLEMENTATIONS", "MAX_PAYLOADS",
           "lane_ctas", "paper_num_ctas", "pick_num_ctas", "autotune_num_ctas", "CTA_CANDIDATES", "build_library", "build_in_background",
           "build_host_library", "nvcc_path", "unaliased_copies", "host_copies_in_flight",
           "reset_host_copies_in_flight"]
