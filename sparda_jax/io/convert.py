"""HF tensor layout -> our parameter tree, shared by the GGUF and safetensors loaders.

Both loaders hand over a getter that returns one tensor by its HF name, in HF layout
(linear weights [out, in]); this module checks every shape and builds the stacked tree of
`sparda_jax.model`.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from ..config import ModelConfig

__all__ = ["CheckpointError", "params_from_hf", "hf_tensor_shapes"]

Getter = Callable[[str], np.ndarray]


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing tensor, wrong shape, bad file."""


def hf_tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Llama/MiniCPM checkpoint of this config holds, with its shape."""
    d, h, k, dh, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (h * dh, d),
            p + "self_attn.k_proj.weight": (k * dh, d),
            p + "self_attn.v_proj.weight": (k * dh, d),
            p + "self_attn.o_proj.weight": (d, h * dh),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
        if c.has_cis:
            shapes[p + "self_attn.A"] = (k,)
            shapes[p + "self_attn.delta.weight"] = (k, k * dh)
    return shapes


def params_from_hf(get: Getter, c: ModelConfig, dtype=np.float32, progress: bool = False,
                   source: Callable[[str], str] = lambda name: "checkpoint") -> dict:
    """Build the parameter tree (numpy arrays of `dtype`) from HF-named tensors. Raises
    CheckpointError for a missing tensor, a wrong shape or a non-finite value (NaN or inf),
    naming the tensor and `source(name)`, the file that holds it."""
    shapes = hf_tensor_shapes(c)

    def take(name: str) -> np.ndarray:
        try:
            a = get(name)
        except KeyError:
            raise CheckpointError(f"{source(name)} has no tensor {name!r} (config {c.name!r} needs it)") from None
        if tuple(a.shape) != shapes[name]:
            raise CheckpointError(f"{source(name)}: tensor {name!r} has shape {tuple(a.shape)}, config {c.name!r} "
                                  f"expects {shapes[name]}")
        a = np.asarray(a, dtype=dtype)
        bad = a.size - int(np.count_nonzero(np.isfinite(a)))
        if bad:
            raise CheckpointError(f"{source(name)}: tensor {name!r} has {bad} non-finite values (NaN or inf)")
        return a

    d, h, k, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        w = lambda n: take(p + n)
        extra = {}
        if c.has_cis:
            extra = {"cis_A": w("self_attn.A"), "cis_delta": {"kernel": w("self_attn.delta.weight").T}}
        return extra | {
            "attn_norm": {"scale": w("input_layernorm.weight")},
            "q_proj": {"kernel": w("self_attn.q_proj.weight").T.reshape(d, h, dh)},
            "k_proj": {"kernel": w("self_attn.k_proj.weight").T.reshape(d, k, dh)},
            "v_proj": {"kernel": w("self_attn.v_proj.weight").T.reshape(d, k, dh)},
            "o_proj": {"kernel": w("self_attn.o_proj.weight").T.reshape(h, dh, d)},
            "mlp_norm": {"scale": w("post_attention_layernorm.weight")},
            "mlp": {
                "gate_proj": {"kernel": w("mlp.gate_proj.weight").T},
                "up_proj": {"kernel": w("mlp.up_proj.weight").T},
                "down_proj": {"kernel": w("mlp.down_proj.weight").T},
            },
        }

    layers = [layer(i) for i in tqdm(range(c.num_layers), desc=f"loading {c.name}", unit="layer",
                                     disable=not progress, leave=False)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *layers)
    params = {
        "embed": {"embedding": take("model.embed_tokens.weight")},
        "layers": stacked,
        "final_norm": {"scale": take("model.norm.weight")},
    }
    if not c.tie_embeddings:
        params["lm_head"] = {"kernel": take("lm_head.weight").T}
    return params

