"""Dense causal GQA attention (`api.dense_attention`) and its jnp reference."""

from .api import dense_attention
from .reference import NEG_INF, dense_attention_reference

__all__ = ["dense_attention", "dense_attention_reference", "NEG_INF"]
