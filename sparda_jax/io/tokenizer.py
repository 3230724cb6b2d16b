"""A thin tokenizer wrapper over the `tokenizers` library, plus chat templating (jinja2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

__all__ = ["Tokenizer", "tokenizer_from_gguf_vocab", "tokenizer_from_file"]


@dataclass
class Tokenizer:
    """encode(str) -> list[int], decode(list[int]) -> str; special tokens are parsed in text."""

    backend: tokenizers.Tokenizer
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    _template: jinja2.Template | None = field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's own template (the GGUF/HF jinja string)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
        if self._template is None:
            env = jinja2.Environment(loader=jinja2.BaseLoader(), keep_trailing_newline=True)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, user: str) -> str:
        return self.apply_chat_template([{"role": "user", "content": user}])


def tokenizer_from_gguf_vocab(tokens: list[str], merges: list[str], token_types: list[int], *,
                              pre: str, bos_id: int | None, eos_ids: tuple[int, ...],
                              chat_template: str | None) -> Tokenizer:
    """Rebuild a GPT-2 style byte-level BPE from GGUF metadata.

    `pre` is llama.cpp's pre-tokenizer name. 'smollm' splits every digit on its own before the
    GPT-2 regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\\p{N}" then the GPT-2 pattern), which
    is HF's Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)].
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
    tok = tokenizers.Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default", "llama-bpe", "smaug-bpe"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, gpt2)")
    tok.decoder = decoders.ByteLevel()
    # Token type 3 = CONTROL in GGUF: register them so their text maps to one id.
    specials = [tokenizers.AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, token_types) if ty == 3]
    tok.add_special_tokens(specials)
    return Tokenizer(tok, bos_id=bos_id, eos_ids=eos_ids, chat_template=chat_template)


def tokenizer_from_file(path: str | Path, *, bos_id: int | None = None, eos_ids: tuple[int, ...] = (),
                        chat_template: str | None = None) -> Tokenizer:
    """An HF `tokenizer.json`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return Tokenizer(tokenizers.Tokenizer.from_file(str(path)), bos_id=bos_id, eos_ids=eos_ids,
                     chat_template=chat_template)
