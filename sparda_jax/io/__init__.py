"""Checkpoint loaders (GGUF, HF safetensors) and the tokenizer wrapper."""

from .convert import CheckpointError, params_from_hf
from .gguf import load_gguf
from .tokenizer import Tokenizer

__all__ = ["CheckpointError", "params_from_hf", "load_gguf", "Tokenizer"]
