"""Compiled programs kept on disk with their calling convention, loaded without tracing.

JAX's persistent compilation cache is consulted only after a function has been traced and
lowered, so a warm process still pays Python for every program it calls (the engine's: the
Mosaic kernels' Pallas bodies and the decode step's unrolled layers; docs/decisions.md, "Compiled
programs stored with their calling convention"). A `ProgramStore` keeps the compiled executable itself
(`jax.experimental.serialize_executable`) under a key computed from the call alone, so a later
process loads it and calls it.

The key holds what decides the program: the function's name, a hash of the package's Python
source, the jax and jaxlib versions, the backend and its devices, jax's settings and the JAX_* /
XLA_* environment, each static argument's type and repr, and each dynamic argument's tree,
shape, dtype, weak type, sharding and commitment. Calls the key cannot describe safely go
through `jax.jit` as before: under a trace (arguments are tracers), an array not on one device,
a static argument passed by position or whose repr names a memory address (a function, an
object without a value repr). A stored program that cannot be loaded or dispatched is removed
and its key left to the jit from then on.

The store is off unless `enable_program_store` is called (the CLI does, beside the compilation
cache; `--no-compile-cache` turns both off, `--no-program-store` this one). Files are loaded with pickle: the store's directory
must be as trusted as the code (it is the user's own cache).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import os
import pickle
import time
import warnings
from pathlib import Path

import jax

__all__ = ["ProgramStore", "enable_program_store", "disable_program_store", "program_store", "stored_jit"]

FORMAT = 1  # of a stored file: (FORMAT, key, payload, in_tree, out_tree, device ids)
LOAD_EVENT = "/sparda/program_store/load_duration"    # seconds to read and load one stored program
STORE_EVENT = "/sparda/program_store/store_duration"  # seconds to serialize and write one
# the package's folders whose Python a traced program runs (pyproject's package-dir)
SOURCE_PACKAGES = ("sparda_jax", "sparda_jax.kernels", "sparda_jax.train", "sparda_jax.infer", "sparda_jax.eval",
                   "sparda_jax.bench")
# jax settings that do not change what a trace makes (where programs are cached, what is logged)
_SETTINGS_IGNORED = ("jax_compilation_cache", "jax_persistent_cache", "jax_enable_compilation_cache",
                     "jax_raise_persistent_cache", "jax_log_", "jax_logging", "jax_debug_log", "jax_explain_cache")

_store: ProgramStore | None = None


class ProgramStore:
    """A folder of compiled programs, `<function>-<key>.prog`, the least recently used removed
    once they hold more than `max_bytes`. `stats`: this process's loads, stores and refusals."""

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int = 4 << 30):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.stats = {"loaded": 0, "stored": 0, "compiled": 0, "unkeyed": 0, "discarded": 0}

    def path(self, name: str, key: str) -> Path:
        return self.directory / f"{name.rsplit('.', 1)[-1].strip('_')}-{key[:40]}.prog"

    def load(self, name: str, key: str):
        """The stored program (a `jax.stages.Compiled`) or None; an unreadable file is removed."""
        p = self.path(name, key)
        t0 = time.perf_counter()
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        from jax.experimental import serialize_executable

        try:
            fmt, stored_key, payload, in_tree, out_tree, ids = pickle.loads(data)
            if fmt != FORMAT or stored_key != key:
                raise ValueError(f"format {fmt}, key {stored_key[:12]}")
            by_id = {d.id: d for d in jax.devices()}
            program = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                execution_devices=[by_id[i] for i in ids])
        except Exception as e:  # a truncated write, another jaxlib's format, a stale device: compile again
            self.discard(name, key, e)
            return None
        os.utime(p)  # recently used: pruned last
        self.stats["loaded"] += 1
        jax.monitoring.record_event_duration_secs(LOAD_EVENT, time.perf_counter() - t0)
        return program

    def discard(self, name: str, key: str, why: Exception) -> None:
        """Remove a stored program that could not be loaded or run, saying so, and mark its key:
        later calls of it go through the jit (and XLA's cache), so a program this backend cannot
        store costs one extra compile, not one every run."""
        p = self.path(name, key)
        warnings.warn(f"program store: {p.name} could not be loaded or run ({type(why).__name__}: "
                      f"{str(why)[:300]}); it is removed and the program compiled by the jit from now on",
                      stacklevel=4)
        self.stats["discarded"] += 1
        p.unlink(missing_ok=True)
        try:
            p.with_suffix(".refused").write_text(f"{type(why).__name__}: {why}\n")
        except OSError:
            pass

    def refused(self, name: str, key: str) -> bool:
        """Whether this key's program failed once (`discard`): not stored again."""
        return self.path(name, key).with_suffix(".refused").exists()

    def store(self, name: str, key: str, compiled) -> bool:
        """Write `compiled` (False where it cannot be serialized: the program still runs)."""
        from jax.experimental import serialize_executable

        t0 = time.perf_counter()
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            # the devices it was compiled for (the default: every device of the backend)
            shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
            ids = sorted({d.id for s in shardings for d in s.device_set})
            data = pickle.dumps((FORMAT, key, payload, in_tree, out_tree, ids))
        except Exception:  # closed-over constants, an unpicklable tree node: kept in memory only
            self.stats["unkeyed"] += 1
            return False
        p = self.path(name, key)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, p)  # readers see a whole file or none
        except OSError as e:
            tmp.unlink(missing_ok=True)
            warnings.warn(f"program store: could not write {p} ({e})", stacklevel=4)
            return False
        self.stats["stored"] += 1
        self.prune()
        jax.monitoring.record_event_duration_secs(STORE_EVENT, time.perf_counter() - t0)
        return True

    def prune(self) -> None:
        files = sorted(self.directory.glob("*.prog"), key=lambda f: f.stat().st_mtime)
        total = sum(f.stat().st_size for f in files)
        for f in files[:-1]:  # the newest stays, even if larger than the bound
            if total <= self.max_bytes:
                break
            total -= f.stat().st_size
            f.unlink(missing_ok=True)


def enable_program_store(directory: str | os.PathLike | None = None, *, max_bytes: int = 4 << 30) -> ProgramStore:
    """Keep programs of `stored_jit` functions under `directory` (None: the cache folder's
    programs/, `runtime.default_cache_dir()`) for this process and later ones. Raises OSError
    naming the folder when it cannot be created or written."""
    global _store  # one per process, like jax's own compilation cache setting
    from .runtime import default_cache_dir

    d = Path(directory) if directory is not None else default_cache_dir() / "programs"
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OSError(f"the program store directory {d} is not writable: {e}") from e
    _store = ProgramStore(d, max_bytes=max_bytes)
    return _store


def disable_program_store() -> None:
    global _store
    _store = None


def program_store() -> ProgramStore | None:
    """The store in effect, or None."""
    return _store


@functools.cache
def source_hash() -> str:
    """SHA-256 over the package's Python files (paths and contents)."""
    h = hashlib.sha256()
    for pkg in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(pkg)
        for root in spec.submodule_search_locations or ():
            for f in sorted(Path(root).rglob("*.py")):
                h.update(f"{pkg}/{f.relative_to(root)}\0".encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def _environment() -> str:
    import jaxlib

    backend = jax.devices()[0].client
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if not k.startswith(_SETTINGS_IGNORED))
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_")))
    devices = [(d.id, d.platform, d.device_kind) for d in jax.devices()]
    return repr((source_hash(), jax.__version__, jaxlib.__version__, backend.platform, backend.platform_version,
                 devices, settings, env))


try:  # the concrete jax.Array type: `type(x) is` costs a tenth of the ABC's isinstance
    from jax._src.array import ArrayImpl as _ARRAY
except ImportError:  # another jax: every array takes the isinstance path below and is not keyed
    _ARRAY = None
_ONE_DEVICE = jax.sharding.SingleDeviceSharding


def _leaf_signature(x):
    """A dynamic argument's part of a call's signature; None: not one the store can key. Run on
    every leaf of every call (a decode step's state and weights: hundreds), so cheap first."""
    if type(x) is _ARRAY or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)):  # typed PRNG keys too
        sharding = x.sharding
        if type(sharding) is not _ONE_DEVICE:
            return None
        # not the aval itself: an output of a loaded program carries one that compares unequal
        a = x.aval
        return ("array", a.shape, a.dtype, a.weak_type, sharding, x.committed)
    if isinstance(x, jax.core.Tracer):
        return None
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # NumPy arrays and scalars
        return ("numpy", tuple(x.shape), str(x.dtype))
    if isinstance(x, (bool, int, float, complex)):
        return ("python", type(x).__name__)
    return None


class _Unkeyable(Exception):
    pass


class _NoFreshCompile(Exception):
    pass


@contextlib.contextmanager
def _fresh_compile():
    """Compile without XLA's persistent cache: an executable it hands back serializes without
    its code on the CPU (the stored program loads, then fails to run: "Function ... not found").
    jax decides once per process whether it uses the cache (`compilation_cache._cache_used`);
    no public setting turns it off for one compile, so this sets that decision for the block."""
    try:
        from jax._src import compilation_cache as cc

        lock, _ = cc._cache_initialized_mutex, (cc._cache_checked, cc._cache_used)
    except (ImportError, AttributeError) as e:
        raise _NoFreshCompile from e
    with lock:
        saved = cc._cache_checked, cc._cache_used
        cc._cache_checked, cc._cache_used = True, False
    try:
        yield
    finally:
        with lock:
            cc._cache_checked, cc._cache_used = saved


class StoredJit:
    """`jax.jit(fn, ...)` whose compiled programs go through the `program_store()` when one is
    enabled (the module docstring says when a call does not); without one, exactly the jit.
    `lower`, `trace` and the jit's other attributes are the jit's."""

    def __init__(self, fn, *, static_argnames=(), donate_argnames=()):
        self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.static_argnames = frozenset(static_argnames)
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # positional arguments past this many would include a static one: not keyed
        self._max_positional = min([positional.index(n) for n in self.static_argnames if n in positional],
                                   default=len(positional))
        self._programs: dict = {}  # call signature -> a Compiled, or the jit with the statics bound
        self._owner: ProgramStore | None = None  # the store self._programs came from
        functools.update_wrapper(self, fn)

    def __getattr__(self, attr):
        return getattr(self.jitted, attr)

    def __call__(self, *args, **kwargs):
        store = _store
        if store is None or len(args) > self._max_positional:
            return self.jitted(*args, **kwargs)
        statics = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, tree = jax.tree.flatten((args, dynamic))
        sigs = tuple(_leaf_signature(x) for x in leaves)
        if any(s is None for s in sigs):
            return self.jitted(*args, **kwargs)
        if self._owner is not store:  # another store: its programs (and memory) only
            self._programs, self._owner = {}, store
        try:
            call_key = (tuple(sorted(statics.items())), tree, sigs)
            program = self._programs.get(call_key)
        except TypeError:  # an unhashable static: the jit raises its own error
            return self.jitted(*args, **kwargs)
        if program is not None:
            return program(*args, **dynamic)
        jit = functools.partial(self.jitted, **statics)
        try:
            key = self._key(statics, tree, sigs)
        except _Unkeyable:
            store.stats["unkeyed"] += 1
            program = self._programs[call_key] = jit
            return program(*args, **dynamic)
        program = None if store.refused(self.name, key) else store.load(self.name, key)
        if program is None and store.refused(self.name, key):  # before, or just now by load
            store.stats["unkeyed"] += 1
            program = self._programs[call_key] = jit
            return program(*args, **dynamic)
        if program is not None:
            try:  # a program that loads but cannot run (its dispatch fails at once) goes to the jit
                out = program(*args, **dynamic)
                self._programs[call_key] = program
                return out
            except jax.errors.JaxRuntimeError as e:
                store.discard(self.name, key, e)
                program = self._programs[call_key] = jit
                return program(*args, **dynamic)
        program = self._programs[call_key] = self._compile(store, key, args, statics, dynamic)
        return program(*args, **dynamic)

    def _compile(self, store: ProgramStore, key: str, args, statics, dynamic):
        lowered = self.jitted.lower(*args, **statics, **dynamic)
        try:
            with _fresh_compile():
                program = lowered.compile()
        except _NoFreshCompile:  # another jax: the program runs, but is not stored
            store.stats["unkeyed"] += 1
            return lowered.compile()
        store.stats["compiled"] += 1
        store.store(self.name, key, program)
        return program

    def _key(self, statics, tree, sigs) -> str:
        static_part = []
        for name in sorted(statics):
            v = statics[name]
            r = repr(v)
            if " at 0x" in r:  # a repr naming an address says nothing about the value
                raise _Unkeyable(name)
            static_part.append((name, f"{type(v).__module__}.{type(v).__qualname__}", r))
        text = repr((FORMAT, self.name, _environment(), static_part, str(tree), sigs))
        return hashlib.sha256(text.encode()).hexdigest()


def stored_jit(fn=None, *, static_argnames=(), donate_argnames=()):
    """Decorator: `StoredJit(fn, ...)`, usable bare or with the jit's argument names."""
    if fn is None:
        return lambda f: StoredJit(f, static_argnames=static_argnames, donate_argnames=donate_argnames)
    return StoredJit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
