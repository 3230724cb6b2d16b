"""A cache of converted checkpoints: (config, parameters, tokenizer) as the loaders made them.

Reading a GGUF file means parsing its metadata (tens of thousands of vocabulary entries) and
dequantizing every tensor; for SmolLM2 that is seconds of every start. The cache keeps the
result once per (file name, its size and modification time, the parameter dtype, the loader's
source; not the file's folder, so clones of the project share an entry), so a later process loads
it in a fraction of a second. The least recently used entries go once the folder holds more
than MAX_BYTES. A cache entry that cannot be read is rebuilt from the file, never trusted.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np

__all__ = ["entry_path", "load_cached", "store"]

_VERSION = 2
MAX_BYTES = 2 << 30  # a float32 SmolLM2 entry is ~0.5 GB: a few models and dtypes
# the loader code whose output the cache holds: a change to any of it is a new key
_SOURCES = ("gguf.py", "hf.py", "convert.py", "tokenizer.py", "weights_cache.py")


def _code_hash() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    h.update((here.parent / "config.py").read_bytes())
    return h.hexdigest()[:12]


def entry_path(source: str | Path, dtype, cache_dir: str | Path) -> Path:
    """Where the converted `source` (a file or checkpoint directory) in `dtype` is kept."""
    source = Path(source).absolute()
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    stamp = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{_VERSION}|{source.name}|{stamp}|{np.dtype(dtype).name}|{_code_hash()}".encode()).hexdigest()
    return Path(cache_dir) / "weights" / f"{source.stem}-{key[:16]}.pkl"


def load_cached(path: Path):
    """(config, params, tokenizer) from a cache entry, or None when it is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            config, params, tok = pickle.load(f)
    except Exception:  # noqa: BLE001 - a torn or foreign entry is rebuilt, not trusted
        return None
    try:
        os.utime(path)  # recently used: pruned last
    except OSError:
        pass
    return config, params, tok


def store(path: Path, config, params, tok) -> None:
    """Write an entry atomically (a temporary file renamed into place); an unwritable cache
    costs the next start its conversion, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump((config, params, tok), f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(path)
    except OSError:
        return
    prune(path.parent, keep=path)


def prune(folder: Path, *, keep: Path | None = None, max_bytes: int = MAX_BYTES) -> None:
    """Remove the least recently used entries until the folder holds at most max_bytes (`keep`
    stays whatever its size). Best effort: other processes may remove entries meanwhile."""
    entries = []
    for p in folder.glob("*.pkl"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    entries.sort()
    total = sum(size for _, size, _ in entries)
    for _, size, p in entries:
        if total <= max_bytes:
            break
        if p == keep:
            continue
        try:
            p.unlink()
            total -= size
        except OSError:
            pass
