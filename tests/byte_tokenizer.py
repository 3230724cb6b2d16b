"""A byte-level tokenizer for the tiny presets (vocabulary 256), shared by the tests that run text."""


class ByteTokenizer:
    """A stand-in for the tiny model's 256-token vocabulary."""

    eos_ids = (0,)

    def encode(self, text):
        return [b if b else 1 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")
