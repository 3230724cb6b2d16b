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
import sys
import threading
import time
import warnings
from pathlib import Path

import jax

__all__ = ["ProgramStore", "enable_program_store", "disable_program_store", "program_store", "stored_jit"]

FORMAT = 1  # of a stored file: (FORMAT, key, payload, in_tree, out_tree, device ids)
LOAD_EVENT = "/sparda/program_store/load_duration"    # seconds to read and load one stored program
STORE_EVENT = "/sparda/program_store/store_duration"  # seconds to serialize and write one
# The folders whose Python generate's programs trace (pyproject's package-dir), the CLI module left
# out: editing the benchmarks, the evaluation or the command line leaves stored programs valid.
# A static argument of a type defined elsewhere brings its own module's file into the key.
SOURCE_PACKAGES = ("sparda_jax", "sparda_jax.kernels", "sparda_jax.infer", "sparda_jax.train")
SOURCE_LEFT_OUT = ("sparda_jax/cli.py",)
# jax settings that do not change what a trace makes (where programs are cached, what is logged)
_SETTINGS_IGNORED = ("jax_compilation_cache", "jax_persistent_cache", "jax_enable_compilation_cache",
                     "jax_raise_persistent_cache", "jax_log_", "jax_logging", "jax_debug_log", "jax_explain_cache")
# the dispatch failure of an executable serialized without its code (XLA CPU: "Function ... not found")
_NO_CODE = "not found"
_MEMO_LIMIT = 256  # call signatures kept in memory per function (the jit's own caches are bounded too)

_store: ProgramStore | None = None


def _stem(name: str) -> str:
    """A function's qualified name as its stored files and events name it."""
    return name.rsplit(".", 1)[-1].strip("_")


@functools.cache
def _load_kernel_runtimes() -> None:
    """Register the custom-call handlers a stored program may call that JAX registers only as a
    side effect of lowering a kernel: Mosaic GPU's "mosaic_gpu_v2" (its extension, and the path of
    its runtime library). A process that loads a program before it has traced any kernel needs
    them first."""
    if jax.default_backend() != "gpu":
        return
    try:
        importlib.import_module("jax.experimental.mosaic.gpu")  # its import registers both
    except Exception:  # noqa: BLE001 - a jax without (a working) Mosaic GPU: the load itself then says why
        pass


class ProgramStore:
    """A folder of compiled programs, `<function>-<key>.prog`, the least recently used removed
    once they hold more than `max_bytes`. `stats`: this process's loads, stores and refusals.
    File operations race with other processes using the folder: each is best effort."""

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int = 4 << 30):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.sources = _Sources.now()  # the package's code as this process loaded it (near enough)
        self.stats = {"loaded": 0, "stored": 0, "compiled": 0, "unkeyed": 0, "discarded": 0, "not_stored": 0}
        self.events: list[tuple[str, str, str]] = []  # (stats entry and why, program file stem, key's start)

    def count(self, what: str, name: str, key: str = "", why: str = "") -> None:
        """One more `what` in stats, and its event: which program, and why where stats do not say."""
        self.stats[what] += 1
        self.events.append((f"{what}: {why}" if why else what, _stem(name), key[:12]))

    def path(self, name: str, key: str) -> Path:
        return self.directory / f"{_stem(name)}-{key[:40]}.prog"

    def load(self, name: str, key: str):
        """The stored program (a `jax.stages.Compiled`) or None. A file that cannot be loaded
        is removed and its key refused (`discard`), unless the failure was for want of memory."""
        p = self.path(name, key)
        t0 = time.perf_counter()
        try:
            data = p.read_bytes()
        except OSError:  # none stored (or removed by another process meanwhile)
            return None
        from jax.experimental import serialize_executable

        _load_kernel_runtimes()

        try:
            fmt, stored_key, payload, in_tree, out_tree, ids = pickle.loads(data)
            if fmt != FORMAT or stored_key != key:
                raise ValueError(f"format {fmt}, key {stored_key[:12]}")
            by_id = {d.id: d for d in jax.devices()}
            program = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                execution_devices=[by_id[i] for i in ids])
        except Exception as e:  # a truncated file, another jaxlib's format, a stale device
            if any(m in str(e) for m in ("RESOURCE_EXHAUSTED", "out of memory")):
                return None  # a passing shortage: compiled now, the file kept
            self.discard(name, key, e)
            return None
        try:
            os.utime(p)  # recently used: pruned last
        except OSError:
            pass
        self.count("loaded", name, key)
        jax.monitoring.record_event_duration_secs(LOAD_EVENT, time.perf_counter() - t0)
        return program

    def discard(self, name: str, key: str, why: Exception) -> None:
        """Remove a stored program that could not be loaded or run, saying so, and mark its key:
        later calls of it go through the jit (and XLA's cache), so a program this backend cannot
        store costs one extra compile, not one every run."""
        p = self.path(name, key)
        reason = f"{type(why).__name__}: {str(why)[:300]}"
        warnings.warn(f"program store: {p.name} could not be loaded or run ({reason}); it is removed and the "
                      "program compiled by the jit from now on", stacklevel=4)
        self.count("discarded", name, key, reason)
        try:
            p.unlink(missing_ok=True)
            p.with_suffix(".refused").write_text(f"{type(why).__name__}: {why}\n")
        except OSError:
            pass

    def refused(self, name: str, key: str) -> bool:
        """Whether this key's program failed once (`discard`): not stored again."""
        return self.path(name, key).with_suffix(".refused").exists()

    def store(self, name: str, key: str, compiled) -> bool:
        """Write `compiled`; False where it cannot be serialized or written, or where the
        package's files changed since the store was opened (the program still runs)."""
        from jax.experimental import serialize_executable

        if self.sources.changed():
            self.count("not_stored", name, key, "the package's files changed")
            return False
        t0 = time.perf_counter()
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            # the devices it was compiled for (the default: every device of the backend)
            shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
            ids = sorted({d.id for s in shardings for d in s.device_set})
            data = pickle.dumps((FORMAT, key, payload, in_tree, out_tree, ids))
        except Exception as e:  # closed-over constants, an unpicklable tree node: kept in memory only
            self.count("not_stored", name, key, f"not serializable ({type(e).__name__})")
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
        self.count("stored", name, key)
        self.prune()
        jax.monitoring.record_event_duration_secs(STORE_EVENT, time.perf_counter() - t0)
        return True

    def prune(self) -> None:
        """Remove the least recently used programs past max_bytes (the newest stays), and
        temporary files an interrupted write left an hour ago or more."""
        now, files = time.time(), []
        for f in self.directory.iterdir():
            try:
                st = f.stat()
            except OSError:  # removed by another process meanwhile
                continue
            if f.suffix == ".prog":
                files.append((st.st_mtime, st.st_size, f))
            elif f.name.endswith(".tmp") and now - st.st_mtime > 3600:
                f.unlink(missing_ok=True)
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, f in files[:-1]:
            if total <= self.max_bytes:
                break
            total -= size
            try:
                f.unlink(missing_ok=True)
            except OSError:
                pass


def enable_program_store(directory: str | os.PathLike | None = None, *, max_bytes: int = 4 << 30) -> ProgramStore:
    """Keep programs of `stored_jit` functions under `directory` (None: the cache folder's
    programs/, `runtime.default_cache_dir()`) for this process and later ones. Call it at the
    start of a process: the package's source is hashed now, and nothing is stored once a file
    of it changes. Raises OSError naming the folder when it cannot be created or written."""
    global _store  # one per process, like jax's own compilation cache setting
    from .runtime import default_cache_dir, writable_dir

    d = writable_dir(directory if directory is not None else default_cache_dir() / "programs", "program store")
    _store = ProgramStore(d, max_bytes=max_bytes)
    return _store


def disable_program_store() -> None:
    global _store
    _store = None


def program_store() -> ProgramStore | None:
    """The store in effect, or None."""
    return _store


class _Sources:
    """The package's traced Python: one hash of paths and contents, and each file's mtime."""

    def __init__(self, digest: str, mtimes: dict):
        self.digest, self.mtimes = digest, mtimes

    @classmethod
    def now(cls) -> _Sources:
        h, mtimes = hashlib.sha256(), {}
        for pkg in SOURCE_PACKAGES:
            spec = importlib.util.find_spec(pkg)
            for root in spec.submodule_search_locations or ():
                for f in sorted(Path(root).rglob("*.py")):
                    rel = f"{pkg.replace('.', '/')}/{f.relative_to(root)}"
                    if rel in SOURCE_LEFT_OUT:
                        continue
                    h.update(f"{rel}\0".encode())
                    h.update(f.read_bytes())
                    mtimes[f] = f.stat().st_mtime_ns
        return cls(h.hexdigest(), mtimes)

    def changed(self) -> bool:
        for f, m in self.mtimes.items():
            try:
                if f.stat().st_mtime_ns != m:
                    return True
            except OSError:
                return True
        return False


@functools.cache
def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def _type_source(v, sources: _Sources) -> str:
    """The hash of the file defining a static argument's type, when it is not one of the
    package's hashed files (a tap defined in a script, say); "" otherwise."""
    module = sys.modules.get(type(v).__module__)
    f = getattr(module, "__file__", None)
    if f is None or Path(f) in sources.mtimes or type(v).__module__ == "builtins":
        return ""
    return _file_digest(f)


def _environment(sources: _Sources) -> str:
    import flax
    import jaxlib
    import numpy

    backend = jax.devices()[0].client
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if not k.startswith(_SETTINGS_IGNORED))
    # XLA_FLAGS and jax's own variables; not XLA_PYTHON_CLIENT_* (the allocator's, not the compiler's)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("JAX_") or k == "XLA_FLAGS")
    devices = [(d.id, d.platform, d.device_kind) for d in jax.devices()]
    return repr((sources.digest, jax.__version__, jaxlib.__version__, flax.__version__, numpy.__version__,
                 sys.version, backend.platform, backend.platform_version, devices, settings, env))


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


_FRESH_LOCK = threading.Lock()  # one fresh compile at a time: each sets a process-wide decision
_compiles = threading.local()   # this thread's compile events while a fresh compile is open
_listening = False
_COMPILED = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _on_duration(event: str, seconds: float, **_) -> None:
    seen = getattr(_compiles, "seen", None)
    if seen is not None and event == _COMPILED:
        seen.add("compiled")


def _on_event(event: str, **_) -> None:
    seen = getattr(_compiles, "seen", None)
    if seen is not None and event == _CACHE_HIT:
        seen.add("cache hit")


@contextlib.contextmanager
def _fresh_compile():
    """Compile without XLA's persistent cache and say whether XLA really compiled: yields a set
    that holds "compiled" (and not "cache hit") only then. An executable the persistent cache
    hands back serializes without its code on the CPU (it loads, then fails to run: "Function
    ... not found"), and so does one the jit already holds in memory from there. jax decides
    once per process whether it uses the cache (`compilation_cache._cache_used`); no public
    setting turns it off for one compile, so this sets that decision for the block, under a
    lock (jit compiles of other threads meanwhile skip the cache too: slower, not wrong)."""
    global _listening
    try:
        from jax._src import compilation_cache as cc

        lock, _ = cc._cache_initialized_mutex, (cc._cache_checked, cc._cache_used)
    except (ImportError, AttributeError) as e:
        raise _NoFreshCompile from e
    with _FRESH_LOCK:
        if not _listening:  # listeners run in the thread that compiles; registered once a process
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
        with lock:
            saved = cc._cache_checked, cc._cache_used
            cc._cache_checked, cc._cache_used = True, False
        _compiles.seen = set()
        try:
            yield _compiles.seen
        finally:
            _compiles.seen = None
            with lock:
                cc._cache_checked, cc._cache_used = saved


def _trace_context():
    """jax's thread-local settings a jit keys its own cache on (precision, x64, ...)."""
    try:
        from jax._src import config

        return config.trace_context()
    except (ImportError, AttributeError):  # another jax: then only the settings at key time count
        return None


class StoredJit:
    """`jax.jit(fn, ...)` whose compiled programs go through the `program_store()` when one is
    enabled (the module docstring says when a call does not); without one, exactly the jit.
    `lower`, `trace` and the jit's other attributes are the jit's. A function with a closure or
    defined inside another is never stored: its code is not all of what it computes."""

    def __init__(self, fn, *, static_argnames=(), donate_argnames=()):
        self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.static_argnames = frozenset(static_argnames)
        self.storable = not getattr(fn, "__closure__", None) and "<locals>" not in fn.__qualname__
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # positional arguments past this many would include a static one: not keyed
        self._max_positional = min([positional.index(n) for n in self.static_argnames if n in positional],
                                   default=len(positional))
        self._programs: dict = {}  # call signature -> a Compiled, or the jit with the statics bound
        self._last: dict = {}      # (statics, context, tree) -> the last program: Compiled checks the rest
        self._owner: ProgramStore | None = None  # the store these came from
        functools.update_wrapper(self, fn)

    def __getattr__(self, attr):
        return getattr(self.jitted, attr)

    def __call__(self, *args, **kwargs):
        store = _store
        if store is None or not self.storable or len(args) > self._max_positional:
            return self.jitted(*args, **kwargs)
        if self._owner is not store:  # another store: its programs (and memory) only
            self._programs, self._last, self._owner = {}, {}, store
        statics = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, tree = jax.tree.flatten((args, dynamic))
        try:
            fast_key = (tuple(sorted(statics.items())), _trace_context(), tree)
            fast = self._last.get(fast_key)
        except TypeError:  # an unhashable static: the jit raises its own error
            return self.jitted(*args, **kwargs)
        if fast is not None:
            try:  # a Compiled checks shapes, dtypes and shardings itself, before it runs anything
                return fast(*args, **dynamic)
            except (TypeError, ValueError):
                pass
        sigs = tuple(_leaf_signature(x) for x in leaves)
        if any(s is None for s in sigs):
            return self.jitted(*args, **kwargs)
        call_key = (fast_key, sigs)
        program = self._programs.get(call_key)
        ran = False
        if program is None:
            program, ran, out = self._find(store, statics, tree, sigs, args, dynamic)
            if len(self._programs) >= _MEMO_LIMIT:
                self._programs.clear()
                self._last.clear()
            self._programs[call_key] = program
        self._last[fast_key] = program
        return out if ran else program(*args, **dynamic)

    def _find(self, store: ProgramStore, statics, tree, sigs, args, dynamic):
        """(program, ran, out) for a call not in memory: the program loaded, or compiled and
        stored, or the jit; ran: finding it ran the call already (a loaded program's first
        call), with the result out."""
        jit = functools.partial(self.jitted, **statics)
        try:
            key = self._key(statics, tree, sigs, store.sources)
        except _Unkeyable as e:
            store.count("unkeyed", self.name, "", f"static {e} has no stable repr")
            return jit, False, None
        refused = store.refused(self.name, key)
        program = None if refused else store.load(self.name, key)
        if refused or (program is None and store.refused(self.name, key)):  # before, or just now by load
            store.count("unkeyed", self.name, key, "refused")
            return jit, False, None
        if program is None:
            return self._compile(store, key, jit, args, statics, dynamic), False, None
        try:  # its first call, awaited (its failure may come after the dispatch): one that cannot run goes to the jit
            return program, True, jax.block_until_ready(program(*args, **dynamic))
        except jax.errors.JaxRuntimeError as e:
            if _NO_CODE not in str(e):  # a real failure of the program (memory, ...): the caller's
                raise
            store.discard(self.name, key, e)
            if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves((args, dynamic))):
                raise RuntimeError(f"program store: a stored {self.name} failed to dispatch ({e}) after its "
                                   "donated arguments were consumed; run again (its key is refused now) or "
                                   "turn the store off (--no-program-store)") from e
            return jit, True, jit(*args, **dynamic)

    def _compile(self, store: ProgramStore, key: str, jit, args, statics, dynamic):
        lowered = self.jitted.lower(*args, **statics, **dynamic)
        try:
            with _fresh_compile() as seen:
                program = lowered.compile()
        except _NoFreshCompile:  # another jax: the jit runs it, nothing is stored
            store.count("unkeyed", self.name, key, "compiled from XLA's cache, not fresh")
            return jit
        store.count("compiled", self.name, key)
        if seen == {"compiled"}:  # XLA compiled it now: not an executable from a cache
            store.store(self.name, key, program)
        else:
            store.count("not_stored", self.name, key, "an executable from XLA's cache")
        return program

    def _key(self, statics, tree, sigs, sources: _Sources) -> str:
        static_part = []
        for name in sorted(statics):
            v = statics[name]
            r = repr(v)
            if " at 0x" in r:  # a repr naming an address says nothing about the value
                raise _Unkeyable(name)
            static_part.append((name, f"{type(v).__module__}.{type(v).__qualname__}", r, _type_source(v, sources)))
        text = repr((FORMAT, self.name, _environment(sources), static_part, str(tree), sigs))
        return hashlib.sha256(text.encode()).hexdigest()


def stored_jit(fn=None, *, static_argnames=(), donate_argnames=()):
    """Decorator: `StoredJit(fn, ...)`, usable bare or with the jit's argument names."""
    if fn is None:
        return lambda f: StoredJit(f, static_argnames=static_argnames, donate_argnames=donate_argnames)
    return StoredJit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
