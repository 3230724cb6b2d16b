"""Where a `generate` call's time goes: prefill, the first decode call, and the steady state.

The first call of a compiled program pays its compile (and, on a GPU, the copy library's build);
a decode rate that includes it says nothing about the steady state, so it is reported apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from sparda_jax.programs import LOAD_EVENT

__all__ = ["CompileClock", "DecodeTiming", "StepTimer"]


@dataclass(frozen=True)
class DecodeTiming:
    """One `generate` call's timing, in seconds.

    prefill_s: start to the first token (the prompt's, drawn from the prefill's logits) read on
    the host: prefill compile and run. first_decode_s: from there to the end of the first decode
    device call (its `steps_per_call` tokens): the decode program's compile, the copy library's
    build and the first step; None without a decode step. first_call_steps: the steps of that
    call (0 without one). steady_steps and steady_s: the tokens
    and time of the decode calls after the first, over calls of the full `steps_per_call` size
    only (a shorter last call compiles a program of its own, so it is left out); steady_s counts
    from the end of the first call. steady_tokens_per_s: steady_steps / steady_s, None when fewer
    than 2 steps remain. total_s: start to the last token.
    """

    prefill_s: float
    first_decode_s: float | None
    first_call_steps: int
    steady_steps: int
    steady_s: float
    total_s: float

    @property
    def steady_tokens_per_s(self) -> float | None:
        if self.steady_steps < 2 or self.steady_s <= 0:
            return None
        return self.steady_steps / self.steady_s

    @classmethod
    def from_stamps(cls, t0: float, stamps: Sequence[float], *, steps_per_call: int = 1,
                    max_new_tokens: int | None = None, end: float | None = None) -> "DecodeTiming":
        """From the start time t0 and the time each token was read on the host (`generate`'s
        on_step calls: stamps[0] the prompt's token, stamps[i] decode step i's). max_new_tokens:
        the call's budget, to find a shorter last call (None: every call has the full size). end:
        the call's end (default: the last stamp). Raises ValueError for steps_per_call < 1 or
        stamps out of order."""
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        if any(b < a for a, b in zip([t0, *stamps], stamps)):
            raise ValueError("the stamps must not decrease, nor come before t0")
        end = (stamps[-1] if stamps else t0) if end is None else end
        if not stamps:
            return cls(end - t0, None, 0, 0, 0.0, end - t0)
        n = len(stamps) - 1  # decode steps read
        if n == 0:
            return cls(stamps[0] - t0, None, 0, 0, 0.0, end - t0)
        k = steps_per_call
        first = min(k, n)
        last = n  # the last stamp inside the steady window
        if max_new_tokens is not None:  # calls of k steps cover steps 1 .. full; the rest is a shorter call
            last = min(n, (max_new_tokens - 1) // k * k)
        steady_steps = max(0, last - first)
        steady_s = stamps[last] - stamps[first] if steady_steps else 0.0
        return cls(stamps[0] - t0, stamps[first] - stamps[0], first, steady_steps, steady_s, end - t0)

    def summary(self) -> str:
        """One line: 'prefill 1.23 s, first step 4.56 s, steady 78.9 tok/s over 30 steps' ('first
        call of 4 steps' for a longer first call; '-' for what was not measured)."""
        first = "-" if self.first_decode_s is None else f"{self.first_decode_s:.2f} s"
        what = "first step" if self.first_call_steps <= 1 else f"first call of {self.first_call_steps} steps"
        rate = self.steady_tokens_per_s
        steady = "-" if rate is None else f"{rate:.1f} tok/s over {self.steady_steps} steps"
        return f"prefill {self.prefill_s:.2f} s, {what} {first}, steady {steady}"


class CompileClock:
    """JAX's own compile events while open (`jax.monitoring`): tracing, lowering to MLIR, and the
    backend step (an XLA compile, or on a persistent-cache hit the executable's load), each with
    the time it ended. A context manager; `between(a, b)` sums what ended in (a, b]. What a first
    call costs beyond these is the program's run and what the runtime does on first use (CUDA
    graphs recorded, libraries loaded)."""

    KINDS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
             "/jax/core/compile/backend_compile_duration": "compile",
             LOAD_EVENT: "load"}  # a program of the program store, loaded without a trace
    HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self, clock: Callable[[], float] | None = None):
        self.clock = clock or (lambda: time.perf_counter())
        self.events: list[tuple[float, str, float]] = []  # (end, kind, seconds)

    def _duration(self, event: str, seconds: float, **_) -> None:
        kind = self.KINDS.get(event)
        if kind is not None:
            self.events.append((self.clock(), kind, float(seconds)))
            if kind == "load":
                self.events.append((self.clock(), "stored", 1.0))

    def _event(self, event: str, **_) -> None:
        if event == self.HIT:
            self.events.append((self.clock(), "cache_hits", 1.0))

    def __enter__(self) -> "CompileClock":
        import jax.monitoring as m

        m.register_event_duration_secs_listener(self._duration)
        m.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring as m

        m.unregister_event_duration_listener(self._duration)
        m.unregister_event_listener(self._event)

    def between(self, a: float, b: float) -> dict:
        """{"trace", "lower", "compile", "load": seconds, "cache_hits", "stored": counts} of the
        events that ended in (a, b]."""
        out = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "load": 0.0, "cache_hits": 0, "stored": 0}
        for end, kind, v in self.events:
            if a < end <= b:
                out[kind] += int(v) if kind in ("cache_hits", "stored") else v
        return out


def phase_line(name: str, seconds: float, jax_s: dict) -> str:
    """'prefill 3.43 s = trace 0.50 + lower 0.90 + compile 0.05 (2 cached) + the rest 1.98': a first
    call's seconds split by `CompileClock.between` ('+ load 0.20 (3 stored)' before the rest when
    programs came from the program store); the rest is the run and first-use work."""
    load = jax_s.get("load", 0.0)
    rest = seconds - jax_s["trace"] - jax_s["lower"] - jax_s["compile"] - load
    hits = f" ({jax_s['cache_hits']} cached)" if jax_s["cache_hits"] else ""
    stored = f" + load {load:.2f} ({jax_s.get('stored', 0)} stored)" if jax_s.get("stored") else ""
    return (f"{name} {seconds:.2f} s = trace {jax_s['trace']:.2f} + lower {jax_s['lower']:.2f} + "
            f"compile {jax_s['compile']:.2f}{hits}{stored} + the rest {rest:.2f}")


class StepTimer:
    """Stamps each token of a `generate` call: pass it as on_step (it calls `then(generated)`
    after stamping, e.g. a streaming printer). `start()` just before the call, `timing(...)`
    after it. clock: a perf_counter-like function (default `time.perf_counter`, looked up at
    each stamp)."""

    def __init__(self, then: Callable | None = None, clock: Callable[[], float] | None = None):
        self.then = then
        self.clock = clock or (lambda: time.perf_counter())
        self.t0: float | None = None
        self.stamps: list[float] = []

    def first_calls(self, compiles: CompileClock, timing: DecodeTiming) -> str:
        """The prefill's and the first decode call's seconds, each split into JAX's trace, lower and
        compile (`compiles` open over the call, on this timer's clock) and the rest."""
        if self.t0 is None or not self.stamps:
            return "first calls: -"
        parts = [phase_line("prefill", timing.prefill_s, compiles.between(self.t0, self.stamps[0]))]
        if timing.first_decode_s is not None:
            what = "first step" if timing.first_call_steps <= 1 else f"first call of {timing.first_call_steps} steps"
            end = self.stamps[timing.first_call_steps]
            parts.append(phase_line(what, timing.first_decode_s, compiles.between(self.stamps[0], end)))
        return "first calls: " + "; ".join(parts)

    def start(self) -> None:
        self.t0, self.stamps = self.clock(), []

    def __call__(self, generated) -> None:
        self.stamps.append(self.clock())
        if self.then is not None:
            self.then(generated)

    def timing(self, *, steps_per_call: int = 1, max_new_tokens: int | None = None) -> DecodeTiming:
        """The call's `DecodeTiming`, ending now. Raises RuntimeError before `start()`."""
        if self.t0 is None:
            raise RuntimeError("StepTimer.timing() before start()")
        return DecodeTiming.from_stamps(self.t0, self.stamps, steps_per_call=steps_per_call,
                                        max_new_tokens=max_new_tokens, end=self.clock())
