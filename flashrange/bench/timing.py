"""One timing function for every contender and direction, and a host-time helper.

:func:`measure` is the only way the benchmark times GPU work: warm-up calls,
then one CUDA-event pair per repetition around the call, with the L2 cache
flushed (a buffer of :data:`L2_FLUSH_BYTES` written) before each repetition, so that no
contender profits from inputs left in cache by the previous repetition. It
reports the median and the spread (20th and 80th percentiles, min, max).
On the CPU the same function times with ``time.perf_counter``.

:func:`host_us_per_call` measures what a call costs the CPU: back-to-back
calls with no synchronisation in between, the time the Python thread
spends issuing them (launch overhead, argument checks, planning on the
host). It does not wait for the GPU.

:class:`Budget` is the wall-clock budget (``--time-budget``) every table
checks before starting new work.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

__all__ = ["Timing", "Budget", "measure", "host_us_per_call", "synchronize", "sm_clock_mhz", "L2_FLUSH_BYTES"]

# Larger than the L2 of any current GPU (H100/H200: 50 MiB, B200: 126 MiB).
L2_FLUSH_BYTES = 256 << 20

_FLUSH_BUFFERS: dict = {}


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over ``reps`` repetitions, measured by ``clock``."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    max_ms: float
    reps: int
    clock: str

    def as_dict(self) -> dict:
        return asdict(self)


def _quantile(sorted_xs, q):
    """Linear-interpolated quantile of an already sorted, non-empty list."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _summary(times_ms, clock) -> Timing:
    xs = sorted(times_ms)
    return Timing(
        median_ms=statistics.median(xs), p20_ms=_quantile(xs, 0.2), p80_ms=_quantile(xs, 0.8),
        min_ms=xs[0], max_ms=xs[-1], reps=len(xs), clock=clock,
    )


def synchronize(device) -> None:
    """Wait for ``device`` (a no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sm_clock_mhz(device):
    """The SM clock of a CUDA ``device`` now, in MHz (NVML, through ``torch.cuda.clock_rate``); ``None``
    elsewhere or without NVML. A sample, not an average: read right after a timed run, it shows a GPU that
    lowered its clock under sustained load (power or heat), which slows whatever runs then."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - no pynvml, or NVML refused: the reading is only informative
        return None


def _flush_buffer(device):
    key = str(device)
    if key not in _FLUSH_BUFFERS:
        _FLUSH_BUFFERS[key] = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    return _FLUSH_BUFFERS[key]


def measure(fn, *, device, warmup: int = 3, reps: int = 15, flush: bool = True) -> Timing:
    """Time ``fn()`` (no arguments; its result is dropped): ``warmup`` untimed calls, then ``reps`` timed ones.

    On CUDA each repetition is bracketed by its own pair of CUDA events
    recorded on the current stream, after the L2 flush (when ``flush``), and
    everything is read after one synchronisation at the end. Elsewhere each
    repetition is timed with ``time.perf_counter``.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return _summary(times, "perf_counter")
    buf = _flush_buffer(device) if flush else None
    with torch.cuda.device(device):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        torch.cuda.synchronize(device)
        for start, end in events:
            if buf is not None:
                buf.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
    return _summary([s.elapsed_time(e) for s, e in events], "cuda-events")


def host_us_per_call(fn, *, device, n: int = 50, rounds: int = 3) -> float:
    """CPU microseconds per call: ``n`` back-to-back calls timed with ``perf_counter``, no sync in between.

    One warm call first; the device is drained before each round (outside
    the timed region) so that a full launch queue never stalls the host.
    Median of ``rounds`` rounds.
    """
    fn()
    per_call = []
    for _ in range(rounds):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call.append((time.perf_counter() - t0) / n * 1e6)
    synchronize(device)
    return statistics.median(per_call)


class Budget:
    """A wall-clock budget in seconds (``<= 0``: unlimited); work already started always finishes."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = float(seconds or 0.0)
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.seconds > 0 and self.elapsed() > self.seconds

    def skips(self, row: dict) -> bool:
        """Whether the work of result ``row`` is skipped because the budget is spent (its note then says so)."""
        if self.spent():
            row["note"] = "skipped: time budget spent"
            return True
        return False
