"""``flashrange bench``: every contender, one process, the same inputs (DESIGN §7).

Contenders, each run only where it can express the mask without a dense
``attn_mask`` (otherwise the cell reads ``n/a`` with the reason):

- ``flashrange``: :func:`flashrange.range_attention` (plan + kernels, end to
  end). The ranges are validated once on the host; timed calls skip that
  eager check (a device sync that no peer pays and that compiled or captured
  calls skip too), and one warm fwd+bwd runs under CUDA sync-debug mode so
  that any host sync left on the GPU path is reported;
- ``sdpa-cudnn`` / ``sdpa-flash``: ``scaled_dot_product_attention`` pinned to
  one backend with ``sdpa_kernel``; full and causal masks only (SDPA's
  ``is_causal`` is top-left aligned, which equals flashrange's bottom-right
  alignment here since every case has ``Sq == Sk``);
- ``flex``: ``flex_attention`` compiled with ``torch.compile``, block mask
  built once outside the timed region; ``flex+mask``: the same with
  ``create_block_mask`` (compiled) inside the timed region, i.e. what a
  training step whose mask changes every step pays;
- optional peers, only when importable: FlashAttention-4 (``flash_attn.cute``),
  FlashAttention-3 (``flash_attn_interface``), FlashAttention-2
  (``flash_attn``), MagiAttention (``magi_attention.functional``);
- ``sdpa-math``: on the CPU only (plumbing check of the smoke test).

Timing: CUDA events around each call, L2 flushed before each repetition,
warm-ups first, median reported. The forward is timed with inputs that
require grad (the training forward, which also saves what the backward
needs); the backward re-runs ``torch.autograd.grad`` on a retained graph with a
fixed upstream gradient; ``fwd+bwd`` times both. TFLOP/s are counted on the
mask's real area: ``2 * area * Hq * (D + Dv)`` forward (``4 * area * D * Hq``
when ``Dv == D``), 2.5x that backward, 3.5x fwd+bwd. Ratios are
``peer ms / flashrange ms`` (above 1: flashrange is faster).

``build_plan`` alone (4096 slices over 128k tokens) is timed first, as wall
time per back-to-back call, eager and as a CUDA-graph replay.

Every peer's output (and gradients) is compared with flashrange's on the same
inputs; a difference beyond the dtype's tolerance is reported loudly and makes
the command exit with status 1 (``--fail-fast`` stops at once).

Run ``flashrange bench --help`` for options; ``--tiny --device cpu --quick``
runs the harness on the CPU at toy sizes (the smoke test of the CI).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import gc
import inspect
import json
import math
import platform
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from .reference import CAUSAL

__all__ = ["main", "CASES", "Case", "MaskSpec", "build_mask", "time_plan"]

# Relative Frobenius difference allowed between flashrange and a peer: two
# correct low-precision kernels differ by a few output roundings.
_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-3}
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
_COLUMNS = ("fwd", "bwd", "fwdbwd")
_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
_L2_FLUSH_BYTES = 256 << 20


# ---------------------------------------------------------------------------
# Cases and their masks
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark problem. ``kind``: full | causal | document | window | shared_question."""

    name: str
    T: int
    Hq: int
    Hkv: int
    D: int
    kind: str
    n_docs: int = 0
    window: int = 0
    question: int = 0
    n_answers: int = 0
    seed: int = 0

    def tiny(self) -> "Case":
        """The same mask shape at toy size (odd lengths) for the CPU smoke test."""
        return dataclasses.replace(
            self,
            T=self.T // 256 + 7,
            Hq=max(1, self.Hq // 8),
            Hkv=max(1, self.Hkv // 8),
            D=max(16, self.D // 4),
            n_docs=min(self.n_docs, 17) if self.n_docs else 0,
            window=max(2, self.window // 256) if self.window else 0,
            question=max(1, self.question // 256) if self.question else 0,
            n_answers=min(self.n_answers, 3) if self.n_answers else 0,
        )


# In priority order: under a time budget the last ones are dropped first.
CASES = (
    Case("full-8k", 8192, 16, 16, 128, "full"),
    Case("causal-8k", 8192, 16, 16, 128, "causal"),
    Case("doc16-32k", 32768, 16, 16, 128, "document", n_docs=16, seed=16),
    Case("doc128-32k", 32768, 16, 16, 128, "document", n_docs=128, seed=128),
    Case("swa2048-32k", 32768, 16, 16, 128, "window", window=2048),
    Case("sharedq-32k", 32768, 16, 16, 128, "shared_question", question=4096, n_answers=8),
    Case("full-16k-gqa32:8", 16384, 32, 8, 128, "full"),
    Case("causal-32k", 32768, 16, 16, 128, "causal"),
    Case("full-32k", 32768, 16, 16, 128, "full"),
    Case("causal-8k-d64", 8192, 16, 16, 64, "causal"),
    Case("full-8k-d64", 8192, 16, 16, 64, "full"),
)


@dataclasses.dataclass
class MaskSpec:
    """A case's mask in every form a contender needs.

    ``q_ranges``/``k_ranges`` `(S, 2)` and ``mask_types`` `(S,)` int32 are the
    flashrange form; the rest are the same mask for peers: ``sdpa_causal``
    (``None`` when SDPA cannot express it), ``cu_seqlens`` (documents),
    ``window`` (keys visible per query, the query included), ``mask_mod``
    (FlexAttention; ``None`` for full attention) and ``area`` (covered cells).
    """

    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    mask_types: torch.Tensor
    area: int
    sdpa_causal: bool | None
    cu_seqlens: torch.Tensor | None
    window: int
    mask_mod: object
    description: str


def _doc_lengths(T, n_docs, seed):
    """``n_docs`` positive lengths summing to ``T``, random-ish from ``seed`` (ratio of extremes <= 3)."""
    if n_docs > T:
        raise ValueError(f"cannot split {T} tokens into {n_docs} non-empty documents")
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(n_docs)]
    total = sum(weights)
    cuts = [0] + [round(T * sum(weights[: i + 1]) / total) for i in range(n_docs - 1)] + [T]
    # Rounding can collapse a document at toy sizes: force strictly increasing cuts.
    for i in range(1, n_docs):
        cuts[i] = min(max(cuts[i], cuts[i - 1] + 1), T - (n_docs - i))
    return [b - a for a, b in zip(cuts, cuts[1:])]


def build_mask(case: Case, device) -> MaskSpec:
    """``case``'s mask on ``device``: ranges from the :class:`flashrange.RangeMask` builders, and the peer forms."""
    from .mask import RangeMask

    T = case.T
    cu = None
    window = 0
    sdpa_causal = None
    if case.kind == "full":
        rm = RangeMask.full(T, device=device)
        sdpa_causal, mask_mod = False, None
        desc = "full"
    elif case.kind == "causal":
        rm = RangeMask.causal(T, device=device)
        sdpa_causal = True

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        desc = "causal"
    elif case.kind == "document":
        lengths = _doc_lengths(T, case.n_docs, case.seed)
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        rm = RangeMask.varlen(bounds, causal=True, device=device)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths)).to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        desc = f"{case.n_docs} causal documents, lengths {min(lengths)}..{max(lengths)}"
    elif case.kind == "window":
        W = window = case.window
        # Query i sees keys (i - W, i]: W keys, its own included.
        rm = RangeMask.sliding_window(T, W, causal=True, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < W)

        desc = f"causal sliding window of {W} keys"
    elif case.kind == "shared_question":
        Q, n = case.question, case.n_answers
        if not (0 < Q < T and 0 < n <= T - Q):
            raise ValueError(f"shared-question case {case.name}: question {Q} and {n} answers do not fit in {T}")
        base, extra = divmod(T - Q, n)
        lengths = [base + (1 if a < extra else 0) for a in range(n)]
        rm = RangeMask.shared_question(Q, lengths, causal=True, device=device)
        seg = [0] * Q
        for a, L in enumerate(lengths, start=1):
            seg += [a] * L
        part = torch.tensor(seg, dtype=torch.int32, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & ((part[kv_idx] == 0) | (part[kv_idx] == part[q_idx]))

        desc = f"causal question of {Q} + {n} answers of ~{base} (each sees the question and itself)"
    else:
        raise ValueError(f"unknown case kind {case.kind!r}")
    q_ranges, k_ranges, mask_types = rm.tensors()
    return MaskSpec(q_ranges, k_ranges, mask_types, rm.area(), sdpa_causal, cu, window, mask_mod, desc)


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


class _Timer:
    """Median of ``reps`` timed calls after ``warmup`` untimed ones, in milliseconds."""

    def __init__(self, device, warmup, reps):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warmup, self.reps = warmup, reps
        self._flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=self.device) if self.cuda else None

    def __call__(self, fn, reps=None, warmup=None):
        reps = self.reps if reps is None else reps
        warmup = self.warmup if warmup is None else warmup
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize(self.device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            self._flush.zero_()  # a cold L2 for every repetition
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in events)


@contextlib.contextmanager
def _sync_watch(active):
    """Collects the messages of host syncs seen under CUDA sync-debug "warn" mode (nothing when inactive)."""
    found = []
    if not active:
        yield found
        return
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# Contenders
# ---------------------------------------------------------------------------


def _to_bhsd(t):
    """`(T, H, D)` -> `(1, H, T, D)`, contiguous (the layout SDPA and Flex are written for)."""
    return t.transpose(0, 1).unsqueeze(0).contiguous()


def _from_bhsd(t):
    return t[0].transpose(0, 1)


def _kwargs_for(fn, kwargs):
    """``kwargs`` restricted to the parameters ``fn`` declares (peers' signatures drift)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class Contender:
    """A way of computing attention. ``layout``: ``thd`` `(T, H, D)`, ``bshd`` `(1, T, H, D)` or ``bhsd`` `(1, H, T, D)`."""

    name = "?"
    layout = "thd"
    is_peer = True

    def unsupported(self, case: Case, mask: MaskSpec, device, dtype) -> str | None:
        """Why this contender cannot run the case (shown as ``n/a``), or ``None``."""
        return None

    def backward_on(self, device) -> bool:
        """Whether this contender can differentiate on ``device``."""
        return True

    def make(self, case: Case, mask: MaskSpec):
        """A function ``(q, k, v) -> out`` in this contender's layout."""
        raise NotImplementedError

    def to_layout(self, t):
        if self.layout == "bhsd":
            return _to_bhsd(t)
        if self.layout == "bshd":
            return t.unsqueeze(0)
        return t

    def from_layout(self, t):
        if self.layout == "bhsd":
            return _from_bhsd(t)
        if self.layout == "bshd":
            return t[0]
        return t


class FlashRange(Contender):
    name = "flashrange"
    is_peer = False

    def make(self, case, mask):
        from . import range_attention
        from .interface import check_range_values

        qr, kr, mt = mask.q_ranges, mask.k_ranges, mask.mask_types
        check_range_values(qr, kr, mt, case.T, case.T)  # once, on the host, like a data loader would

        def call(q, k, v):
            return range_attention(q, k, v, qr, kr, mt, max_seqlen_q=case.T, max_seqlen_k=case.T)[0]

        def fn(q, k, v):
            if not q.is_cuda:
                return call(q, k, v)
            # Sync-debug "warn" makes range_attention skip its eager host-side
            # range check (a device sync no peer pays, as under compile or
            # CUDA graphs) and would report any host sync of the GPU path.
            prev = torch.cuda.get_sync_debug_mode()
            if prev == 0:
                torch.cuda.set_sync_debug_mode(1)
            try:
                return call(q, k, v)
            finally:
                torch.cuda.set_sync_debug_mode(prev)

        return fn


class SDPA(Contender):
    layout = "bhsd"

    def __init__(self, name, backend):
        self.name = name
        self.backend = backend

    def unsupported(self, case, mask, device, dtype):
        if mask.sdpa_causal is None:
            return "needs a dense attn_mask"
        if self.backend_name() != "MATH" and torch.device(device).type != "cuda":
            return "needs CUDA"
        return None

    def backend_name(self):
        return self.backend.name

    def make(self, case, mask):
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        kwargs = {"is_causal": bool(mask.sdpa_causal)}
        if case.Hq != case.Hkv:
            kwargs["enable_gqa"] = True
        backend = self.backend

        def fn(q, k, v):
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, **kwargs)

        return fn


_COMPILED = {}


def _compiled(name):
    """One shared ``torch.compile`` wrapper per function: Flex, Flex+mask and the
    block-mask timing then reuse each other's compiled graphs instead of compiling again."""
    if name not in _COMPILED:
        from torch.nn.attention import flex_attention as fa

        _COMPILED[name] = torch.compile(getattr(fa, name), dynamic=False)
    return _COMPILED[name]


class Flex(Contender):
    """FlexAttention; ``end_to_end`` builds the block mask inside the timed call."""

    layout = "bhsd"

    def __init__(self, device, end_to_end=False):
        self.end_to_end = end_to_end
        self.name = "flex+mask" if end_to_end else "flex"
        self.compiled = torch.device(device).type == "cuda"
        self._flex = None
        self._cbm = None

    def backward_on(self, device):
        return torch.device(device).type == "cuda"  # no FlexAttention backward on the CPU

    def unsupported(self, case, mask, device, dtype):
        if self.end_to_end and mask.mask_mod is None:
            return "no block mask for full attention"
        return None

    def _functions(self):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if self._flex is None:
            if self.compiled:
                self._flex = _compiled("flex_attention")
                self._cbm = _compiled("create_block_mask")
            else:
                # CPU smoke test: the unfused eager path (slow, materialises scores).
                self._flex = flex_attention
                self._cbm = create_block_mask
        return self._flex, self._cbm

    def make(self, case, mask):
        flex, cbm = self._functions()
        kwargs = {"enable_gqa": True} if case.Hq != case.Hkv else {}
        mm, T = mask.mask_mod, case.T
        device = mask.q_ranges.device
        if self.end_to_end:
            def fn(q, k, v):
                return flex(q, k, v, block_mask=cbm(mm, None, None, T, T, device=device), **kwargs)

            return fn
        block_mask = None
        if mm is not None:
            t0 = time.perf_counter()
            block_mask = cbm(mm, None, None, T, T, device=device)  # compiles create_block_mask for this mask
            _sync(device)
            self.extra = {"block_mask_first_call_s": time.perf_counter() - t0}

        def fn(q, k, v):
            return flex(q, k, v, block_mask=block_mask, **kwargs)

        return fn


class FlashAttnPeer(Contender):
    """FlashAttention 2/3/4 through their ``flash_attn_func`` / ``flash_attn_varlen_func``."""

    def __init__(self, name, module):
        self.name = name
        self.module = module

    def unsupported(self, case, mask, device, dtype):
        if torch.device(device).type != "cuda":
            return "needs CUDA"
        if case.kind == "shared_question":
            return "mask not expressible"
        return None

    def make(self, case, mask):
        mod = self.module
        if case.kind == "document":
            self.layout = "thd"
            cu = mask.cu_seqlens
            f = mod.flash_attn_varlen_func
            max_len = int((cu[1:] - cu[:-1]).max())
            kw = _kwargs_for(f, {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max_len,
                                 "max_seqlen_k": max_len, "causal": True})

            def fn(q, k, v):
                return _first(f(q, k, v, **kw))

            return fn
        self.layout = "bshd"
        f = mod.flash_attn_func
        args = {"causal": case.kind in ("causal", "window")}
        if case.kind == "window":
            # FlashAttention windows count keys left of the diagonal.
            args["window_size"] = (mask.window - 1, 0)
        kw = _kwargs_for(f, args)

        def fn(q, k, v):
            return _first(f(q, k, v, **kw))

        return fn


class MagiFFA(Contender):
    """MagiAttention's ``flex_flash_attn_func``: takes the same ranges as flashrange."""

    name = "magi-ffa"

    def __init__(self, fn):
        self.fn = fn

    def unsupported(self, case, mask, device, dtype):
        return None if torch.device(device).type == "cuda" else "needs CUDA"

    def make(self, case, mask):
        kw = _kwargs_for(self.fn, {"q_ranges": mask.q_ranges, "k_ranges": mask.k_ranges,
                                   "attn_type_map": mask.mask_types, "max_seqlen_q": case.T,
                                   "max_seqlen_k": case.T})
        f = self.fn

        def fn(q, k, v):
            return _first(f(q, k, v, **kw))

        return fn


def _optional_peers():
    """Installed optional peers; a missing package is skipped silently."""
    import importlib

    peers = []
    for name, module in (("fa4", "flash_attn.cute"), ("fa3", "flash_attn_interface"), ("fa2", "flash_attn")):
        try:
            mod = importlib.import_module(module)
            mod.flash_attn_func, mod.flash_attn_varlen_func  # noqa: B018
        except Exception:  # noqa: BLE001 (missing or broken install: not a contender)
            continue
        peers.append(FlashAttnPeer(name, mod))
    try:
        from magi_attention.functional import flex_flash_attn_func

        peers.append(MagiFFA(flex_flash_attn_func))
    except Exception:  # noqa: BLE001
        pass
    return peers


def contenders_for(device):
    from torch.nn.attention import SDPBackend

    out = [FlashRange()]
    if torch.device(device).type == "cuda":
        out += [SDPA("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), SDPA("sdpa-flash", SDPBackend.FLASH_ATTENTION)]
    else:
        out += [SDPA("sdpa-math", SDPBackend.MATH)]
    out += [Flex(device), Flex(device, end_to_end=True)]
    out += _optional_peers()
    return out


# ---------------------------------------------------------------------------
# Running one case
# ---------------------------------------------------------------------------


def _short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(e).__name__}: {first}"[:160]


def _rel_err(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / max(den, 1e-30)


def _free(device, collect=False):
    # gc.collect costs ~0.5 s once Dynamo has run: only between cases.
    if collect:
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _flops(case, area, column):
    return 2.0 * area * case.Hq * (case.D + case.D) * _FLOP_FACTOR[column]


def _block_mask_times(case, mask, device, timer):
    """``create_block_mask`` alone: eager, and compiled on CUDA (ms); ``None`` where not run."""
    if mask.mask_mod is None:
        return {"eager_ms": None, "compiled_ms": None, "first_call_s": None, "note": "full: no block mask"}
    from torch.nn.attention.flex_attention import create_block_mask

    T, mm = case.T, mask.mask_mod
    res = {"eager_ms": None, "compiled_ms": None, "first_call_s": None, "note": ""}
    try:
        res["eager_ms"] = timer(lambda: create_block_mask(mm, None, None, T, T, device=device), reps=3, warmup=1)
    except Exception as e:  # noqa: BLE001
        res["note"] = f"eager: {_short_error(e)}"
    if torch.device(device).type == "cuda":
        try:
            cbm = _compiled("create_block_mask")  # already compiled for this mask by the Flex contenders
            t0 = time.perf_counter()
            cbm(mm, None, None, T, T, device=device)
            _sync(device)
            res["first_call_s"] = time.perf_counter() - t0
            res["compiled_ms"] = timer(lambda: cbm(mm, None, None, T, T, device=device))
        except Exception as e:  # noqa: BLE001
            res["note"] += f" compiled: {_short_error(e)}"
    else:
        res["note"] = "compiled: needs CUDA"
    _free(device)
    return res


def _run_contender(c, case, mask, q, k, v, dout, timer, backward, ref):
    """Times one contender on one case; returns its result record (never raises for the contender's own errors)."""
    device = q.device
    rec = {"status": "ok", "note": ""}
    if backward and not c.backward_on(device):
        backward, rec["note"] = False, f"forward only on {device.type}"
    for col in _COLUMNS:
        rec[f"{col}_ms"] = None
    rec.update({"peak_mem_bytes": None, "err_out": None, "err_grad": None, "first_call_s": None})
    fn = None
    try:
        c.extra = {}
        fn = c.make(case, mask)
        rec.update(c.extra)
        leaves = [c.to_layout(t).detach().requires_grad_(backward) for t in (q, k, v)]
        dout_l = c.to_layout(dout)
        t0 = time.perf_counter()
        out = fn(*leaves)  # compiles / autotunes: neither timed nor watched for syncs
        _sync(device)
        rec["first_call_s"] = time.perf_counter() - t0
        out_thd = c.from_layout(out.detach())
        if c.is_peer and ref.get("out") is not None:
            rec["err_out"] = _rel_err(out_thd, ref["out"])
        del out
        rec["fwd_ms"] = timer(lambda: fn(*leaves))
        if backward:
            out = fn(*leaves)
            try:
                rec["bwd_ms"] = timer(lambda: torch.autograd.grad(out, leaves, dout_l, retain_graph=True))
            except RuntimeError as e:  # no retained graph: derive from fwd+bwd below
                rec["note"] = f"bwd derived (retain_graph: {_short_error(e)[:60]})"
            del out
            rec["fwdbwd_ms"] = timer(lambda: torch.autograd.grad(fn(*leaves), leaves, dout_l))
            if rec["bwd_ms"] is None:
                rec["bwd_ms"] = max(rec["fwdbwd_ms"] - rec["fwd_ms"], 0.0)
        # Peak extra memory of one call (fwd+bwd when timed), inputs excluded.
        _free(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        # flashrange's warm GPU path must not sync with the host (DESIGN §5).
        with _sync_watch(device.type == "cuda" and not c.is_peer) as syncs:
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, dout_l) if backward else None
        if syncs:
            rec["note"] = (rec["note"] + " " if rec["note"] else "") + f"HOST SYNC: {syncs[0][:60]}"
            rec["host_syncs"] = len(syncs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            rec["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device) - base
        if c.is_peer:
            if ref.get("grads") is not None and grads is not None:
                rec["err_grad"] = max(_rel_err(c.from_layout(g), r) for g, r in zip(grads, ref["grads"]))
        else:
            ref["out"] = out_thd
            ref["grads"] = [c.from_layout(g).detach() for g in grads] if grads is not None else None
        del out, grads, leaves, dout_l
    except torch.cuda.OutOfMemoryError as e:
        rec.update(status="n/a", note=f"out of memory: {_short_error(e)[:80]}")
    except Exception as e:  # noqa: BLE001 (a peer failing is a result, not a crash)
        rec.update(status="error" if not c.is_peer else "n/a", note=_short_error(e))
    del fn
    _free(device)
    return rec


def _inputs(case, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(1234 + case.T + case.Hq + case.D)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    q = randn(case.T, case.Hq, case.D)
    k = randn(case.T, case.Hkv, case.D)
    v = randn(case.T, case.Hkv, case.D)
    dout = randn(case.T, case.Hq, case.D)
    return q, k, v, dout


# ---------------------------------------------------------------------------
# The plan alone
# ---------------------------------------------------------------------------


def _per_call_us(fn, device, n):
    """Wall time per call of ``n`` back-to-back calls, launches included (µs); median of 3 rounds."""
    fn()
    _sync(device)
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(rounds)


def time_plan(device, timer, *, tiny=False, n_slices=4096, T=131072, block=128):
    """``build_plan`` for ``n_slices`` causal documents over ``T`` tokens, µs per call.

    Launch-bound work: timed as the wall time of back-to-back calls (what a
    training loop pays), eager and as a CUDA-graph replay.
    """
    from .plan import build_plan

    n = max(timer.reps, 20)
    if tiny:
        n_slices, T = 33, 1031
    lengths = _doc_lengths(T, n_slices, seed=4096)
    bounds = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    qr = torch.stack([bounds[:-1], bounds[1:]], dim=1).to(device=device, dtype=torch.int32)
    kr = qr.clone()
    mt = torch.full((n_slices,), CAUSAL, dtype=torch.int32, device=device)
    res = {"n_slices": n_slices, "T": T, "block": block, "bar_us": 50.0}
    variants = [("fwd", False, None), ("bwd_kv", True, None)]
    if torch.device(device).type == "cuda":
        variants.append(("fwd_torchops", False, "torch"))  # the plain-PyTorch plan, for comparison
    for label, transpose, backend in variants:

        def call():
            return build_plan(qr, kr, mt, T, T, block, transpose=transpose, backend=backend)

        res[f"{label}_eager_us"] = _per_call_us(call, device, n)
        res[f"{label}_graph_us"] = None
        if torch.device(device).type == "cuda":
            try:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        call()
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call()
                res[f"{label}_graph_us"] = _per_call_us(graph.replay, device, n)
                del graph
            except Exception as e:  # noqa: BLE001
                res[f"{label}_graph_note"] = _short_error(e)
    best = [res[k] for k in ("fwd_eager_us", "fwd_graph_us") if res.get(k) is not None]
    res["meets_bar"] = bool(best) and min(best) <= res["bar_us"]
    return res


# ---------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------


def _fmt(x, nd=2):
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{nd}f}"


def _fmt_err(x):
    return "" if x is None else f"{x:.1e}"


def _tflops(case_rec, rec, col):
    ms = rec.get(f"{col}_ms")
    if ms is None or ms <= 0:
        return None
    return case_rec["flops"][col] / (ms * 1e-3) / 1e12


def _ratios(case_rec):
    """``{peer: {col: peer_ms / flashrange_ms}}`` for every peer with numbers."""
    res = case_rec["results"]
    fr = res.get("flashrange", {})
    out = {}
    for name, rec in res.items():
        if name == "flashrange":
            continue
        r = {}
        for col in _COLUMNS:
            a, b = rec.get(f"{col}_ms"), fr.get(f"{col}_ms")
            r[col] = (a / b) if (a is not None and b) else None
        out[name] = r
    return out


def _cell_note(rec):
    if rec.get("status") == "ok":
        return rec.get("note", "")
    return f"{rec.get('status')}: {rec.get('note', '')}"


def markdown_report(data) -> str:
    """The full markdown: header, one table per case, block masks, plan, ratios."""
    h = data["header"]
    lines = ["# flashrange bench", ""]
    lines.append(
        f"{h['date']} | {h['device_name']} | torch {h['torch']} | triton {h['triton']} | "
        f"flashrange {h['flashrange']} | cuda {h.get('cuda')} | cudnn {h.get('cudnn')} | dtype {h['dtype']}"
        + (" | tiny" if h.get("tiny") else "")
    )
    lines.append("")
    lines.append(
        "ms: median; TFLOP/s on the mask's real area (fwd 4·area·D·Hq, bwd 2.5x, fwd+bwd 3.5x); "
        "mem: peak extra GiB of one fwd+bwd; err: relative L2 difference to flashrange (out / worst grad); "
        "1st call: wall time of the untimed first call (compilation)."
    )
    for c in data["cases"]:
        lines += ["", f"## {c['name']}: T={c['T']} Hq={c['Hq']} Hkv={c['Hkv']} D={c['D']}, "
                      f"{c['description']}, {c['slices']} slices, density {100 * c['density']:.1f}%", ""]
        if c.get("skipped"):
            lines.append(f"skipped: {c['skipped']}")
            continue
        lines.append("| contender | fwd ms | fwd TF/s | bwd ms | bwd TF/s | f+b ms | f+b TF/s | mem GiB | err out "
                     "| err grad | 1st call s | note |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, rec in c["results"].items():
            if rec.get("status") != "ok":
                lines.append(f"| {name} | n/a | | | | | | | | | | {_cell_note(rec)} |")
                continue
            mem = rec.get("peak_mem_bytes")
            lines.append(
                f"| {name} | {_fmt(rec['fwd_ms'], 3)} | {_fmt(_tflops(c, rec, 'fwd'), 1)} | "
                f"{_fmt(rec['bwd_ms'], 3)} | {_fmt(_tflops(c, rec, 'bwd'), 1)} | "
                f"{_fmt(rec['fwdbwd_ms'], 3)} | {_fmt(_tflops(c, rec, 'fwdbwd'), 1)} | "
                f"{_fmt(None if mem is None else mem / 2**30, 2)} | "
                f"{_fmt_err(rec.get('err_out'))} | {_fmt_err(rec.get('err_grad'))} | "
                f"{_fmt(rec.get('first_call_s'), 1)} | {_cell_note(rec)} |"
            )
        ratios = c.get("ratios", {})
        if any(v for r in ratios.values() for v in r.values()):
            lines.append("")
            lines.append("peer ms / flashrange ms (above 1: flashrange faster): " + "; ".join(
                f"{p} " + "/".join(_fmt(r[col]) for col in _COLUMNS)
                for p, r in ratios.items() if any(r.values())
            ) + " (fwd/bwd/f+b)")
        bm = c.get("block_mask")
        if bm and (bm.get("eager_ms") is not None or bm.get("compiled_ms") is not None):
            lines.append(
                f"create_block_mask: eager {_fmt(bm['eager_ms'], 3)} ms, compiled {_fmt(bm['compiled_ms'], 3)} ms"
                + (f" (first compiled call {bm['first_call_s']:.1f} s)" if bm.get("first_call_s") else "")
                + (f"; {bm['note']}" if bm.get("note") else "")
            )
    p = data.get("plan")
    if p:
        lines += ["", "## plan alone", ""]
        lines.append(
            f"build_plan, {p['n_slices']} slices over {p['T']} tokens, block {p['block']}: "
            f"forward plan eager {_fmt(p.get('fwd_eager_us'), 1)} µs, CUDA graph {_fmt(p.get('fwd_graph_us'), 1)} µs; "
            f"dK/dV plan eager {_fmt(p.get('bwd_kv_eager_us'), 1)} µs, CUDA graph {_fmt(p.get('bwd_kv_graph_us'), 1)} µs; "
            + (f"plain-PyTorch forward plan eager {_fmt(p.get('fwd_torchops_eager_us'), 1)} µs, "
               f"CUDA graph {_fmt(p.get('fwd_torchops_graph_us'), 1)} µs; " if "fwd_torchops_eager_us" in p else "")
            + "wall time per back-to-back call; "
            f"bar {p['bar_us']:.0f} µs: {'met' if p.get('meets_bar') else 'NOT met'}"
        )
    lines += ["", short_table(data)]
    return "\n".join(lines)


_SHORT_PEERS = ("sdpa-cudnn", "sdpa-flash", "flex", "flex+mask")


def short_table(data) -> str:
    """A compact table: flashrange TFLOP/s and its speed ratio to each peer, per case."""
    peers = list(_SHORT_PEERS)
    for c in data["cases"]:
        for name in c.get("results", {}):
            if name not in peers and name != "flashrange" and name != "sdpa-math":
                peers.append(name)
    if data["header"].get("device_type") != "cuda":
        peers = [p for p in peers if not p.startswith("sdpa-c") and p != "sdpa-flash"] + ["sdpa-math"]
    lines = [
        f"flashrange bench: {data['header']['device_name']}, {data['header']['dtype']}, torch "
        f"{data['header']['torch']}, triton {data['header']['triton']} "
        "(TF/s fwd / fwd+bwd; peer columns: peer ms / flashrange ms, fwd / fwd+bwd, >1 = flashrange faster)",
        "",
        "| case | flashrange TF/s | " + " | ".join(peers) + " |",
        "|---|---:|" + "---:|" * len(peers),
    ]
    for c in data["cases"]:
        if c.get("skipped"):
            lines.append(f"| {c['name']} | skipped |" + " |" * len(peers))
            continue
        fr = c["results"].get("flashrange", {})
        if fr.get("status") != "ok":
            fr_cell = "ERROR"
        else:
            fr_cell = f"{_fmt(_tflops(c, fr, 'fwd'), 0)} / {_fmt(_tflops(c, fr, 'fwdbwd'), 0)}"
        cells = []
        ratios = c.get("ratios", {})
        for p in peers:
            r = ratios.get(p)
            if r is None or (r.get("fwd") is None and r.get("fwdbwd") is None):
                cells.append("n/a")
            else:
                cells.append(f"{_fmt(r.get('fwd'))} / {_fmt(r.get('fwdbwd'))}")
        name = c["name"] + (" (interrupted)" if c.get("interrupted") else "")
        lines.append(f"| {name} | {fr_cell} | " + " | ".join(cells) + " |")
    p = data.get("plan")
    if p:
        lines.append("")
        lines.append(
            f"plan ({p['n_slices']} slices / {p['T']} tokens): eager {_fmt(p.get('fwd_eager_us'), 1)} µs, "
            f"graph {_fmt(p.get('fwd_graph_us'), 1)} µs (bar {p['bar_us']:.0f} µs: "
            f"{'met' if p.get('meets_bar') else 'NOT met'})"
        )
    bad = data.get("failures", [])
    lines.append("correctness vs peers: " + ("OK" if not bad else f"FAILED ({len(bad)}): " + "; ".join(bad)[:400]))
    return "\n".join(lines)


def plot(data, path):
    """TFLOP/s bars per case per contender (forward, and fwd+bwd when measured) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in data["cases"] if not c.get("skipped")]
    names = []
    for c in cases:
        for n, rec in c["results"].items():
            if rec.get("status") == "ok" and n not in names:
                names.append(n)
    cols = ["fwd"] + (["fwdbwd"] if data["header"].get("backward") else [])
    fig, axes = plt.subplots(len(cols), 1, figsize=(max(8, 1.3 * len(cases) + 3), 4 * len(cols)), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, col in zip(axes[:, 0], cols):
        for j, n in enumerate(names):
            ys = []
            for c in cases:
                rec = c["results"].get(n, {})
                t = _tflops(c, rec, col) if rec.get("status") == "ok" else None
                ys.append(t or 0.0)
            ax.bar([i + j * width for i in range(len(cases))], ys, width, label=n)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([c["name"] for c in cases], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"{'forward' if col == 'fwd' else 'fwd+bwd'} TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
        if names:
            ax.legend(fontsize=7, ncol=min(4, len(names)))
    h = data["header"]
    fig.suptitle(f"flashrange bench — {h['device_name']}, {h['dtype']}, torch {h['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def _header(device, dtype, args):
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    from . import __version__

    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_name": name,
        "device_type": dev.type,
        "torch": torch.__version__,
        "triton": triton_v,
        "flashrange": __version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None,
        "python": platform.python_version(),
        "dtype": str(dtype).replace("torch.", ""),
        "backward": not args.no_backward,
        "tiny": args.tiny,
        "warmup": args.warmup,
        "reps": args.reps,
    }


class _Progress:
    """tqdm on a terminal, otherwise one printed line per step (readable in logs)."""

    def __init__(self, total):
        self.total, self.n, self.bar = total, 0, None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="step")
            except ImportError:
                pass

    def step(self, label):
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(label[:40])
            self.bar.update(1)
        else:
            print(f"[{self.n}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _select_cases(spec):
    if not spec:
        return list(CASES)
    chosen = []
    for pat in [s.strip() for s in spec.split(",") if s.strip()]:
        hits = [c for c in CASES if fnmatch.fnmatchcase(c.name, pat)]
        if not hits:
            raise SystemExit(f"flashrange bench: no case matches {pat!r}; cases: {', '.join(c.name for c in CASES)}")
        chosen += [c for c in hits if c not in chosen]
    return chosen


def _parser():
    p = argparse.ArgumentParser(prog="flashrange bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="", help="comma-separated case names or globs (default: all): "
                   + ", ".join(c.name for c in CASES))
    p.add_argument("--contenders", default="", help="comma-separated contender names (default: all available)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (2 warm-ups, 5 reps)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per measurement (default 3)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 15)")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--no-plan", action="store_true", help="skip timing build_plan alone")
    p.add_argument("--out", default="out/bench", help="directory for bench.json, bench.md, bench.png (default out/bench)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; once spent, remaining work is skipped and the report still written (0: none)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first mismatch with flashrange")
    p.add_argument("--report-only", metavar="JSON", default=None,
                   help="print the markdown and short tables of an earlier run's bench.json and exit")
    p.add_argument("--short", action="store_true", help="with --report-only: the short table alone")
    return p


def _write(data, out_dir, with_plot=True):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(data, indent=1, default=str))
    (out_dir / "bench.md").write_text(markdown_report(data) + "\n")
    if with_plot:
        try:
            plot(data, out_dir / "bench.png")
        except Exception as e:  # noqa: BLE001 (no matplotlib: tables and JSON still written)
            print(f"flashrange bench: no plot ({_short_error(e)})", file=sys.stderr)


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.report_only:
        data = json.loads(Path(args.report_only).read_text())
        print(short_table(data) if args.short else markdown_report(data))
        return 1 if data.get("failures") or data.get("errors") else 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("flashrange bench: --device cuda but no CUDA GPU is visible; use --device cpu --tiny")
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("flashrange bench: the full-size cases need a CUDA GPU; on the CPU add --tiny (toy sizes)")
    dtype = _DTYPES[args.dtype]
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (5 if args.quick else 15)
    if args.warmup < 1 or args.reps < 1:
        raise SystemExit("flashrange bench: --warmup and --reps must be >= 1")
    cases = _select_cases(args.cases)
    if args.tiny:
        cases = [c.tiny() for c in cases]
    backward = not args.no_backward
    out_dir = Path(args.out)

    # Every case compiles Flex anew: lift Dynamo's recompile limit, and fail
    # rather than silently fall back to the unfused eager path.
    import torch._dynamo.config as dcfg

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, knob):
            setattr(dcfg, knob, max(getattr(dcfg, knob), 64))
            break
    if hasattr(dcfg, "fail_on_recompile_limit_hit"):
        dcfg.fail_on_recompile_limit_hit = True
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

    contenders = contenders_for(device)
    if args.contenders:
        wanted = [s.strip() for s in args.contenders.split(",") if s.strip()]
        known = {c.name for c in contenders}
        for w in wanted:
            if w not in known:
                raise SystemExit(f"flashrange bench: unknown or unavailable contender {w!r}; available: {', '.join(sorted(known))}")
        contenders = [c for c in contenders if c.name in wanted or c.name == "flashrange"]

    timer = _Timer(device, args.warmup, args.reps)
    data = {"header": _header(device, dtype, args), "cases": [], "plan": None, "failures": [], "errors": []}
    h = data["header"]
    print(f"flashrange bench: {h['device_name']} | torch {h['torch']} | triton {h['triton']} | "
          f"flashrange {h['flashrange']} | {h['date']} | dtype {h['dtype']} | "
          f"contenders {', '.join(c.name for c in contenders)}", flush=True)
    t_start = time.perf_counter()
    tol = _TOLERANCE[dtype]
    progress = _Progress(len(cases) * (len(contenders) + 1) + (0 if args.no_plan else 1))

    def over_budget():
        return args.time_budget > 0 and time.perf_counter() - t_start > args.time_budget

    stop = None
    try:
        # The plan first: a few seconds, and never the part a time budget drops.
        if not args.no_plan:
            progress.step("build_plan alone")
            try:
                data["plan"] = time_plan(device, timer, tiny=args.tiny)
            except Exception as e:  # noqa: BLE001
                data["errors"].append(f"plan: {_short_error(e)}")
        for case in cases:
            mask = build_mask(case, device)
            crec = {
                "name": case.name, "T": case.T, "Hq": case.Hq, "Hkv": case.Hkv, "D": case.D,
                "kind": case.kind, "description": mask.description, "slices": int(mask.mask_types.numel()),
                "area": mask.area, "density": mask.area / float(case.T * case.T),
                "flops": {col: _flops(case, mask.area, col) for col in _COLUMNS},
                "results": {}, "block_mask": None,
            }
            data["cases"].append(crec)
            if stop or over_budget():
                stop = stop or "time budget spent"
                crec["skipped"] = stop
                for _ in range(len(contenders) + 1):
                    progress.step(f"{case.name}: skipped")
                continue
            t_case = time.perf_counter()
            q, k, v, dout = _inputs(case, device, dtype)
            ref = {}
            for c in contenders:
                progress.step(f"{case.name}: {c.name}")
                why = c.unsupported(case, mask, device, dtype)
                if why is None and over_budget():
                    why, stop = "skipped: time budget spent", "time budget spent"
                if why is not None:
                    crec["results"][c.name] = {"status": "n/a", "note": why}
                    continue
                rec = _run_contender(c, case, mask, q, k, v, dout, timer, backward, ref)
                crec["results"][c.name] = rec
                if rec["status"] == "error":
                    data["errors"].append(f"{case.name}/{c.name}: {rec['note']}")
                    print(f"!!! flashrange failed on {case.name}: {rec['note']}", file=sys.stderr, flush=True)
                for key in ("err_out", "err_grad"):
                    e = rec.get(key)
                    if e is not None and not e <= tol:
                        msg = f"{case.name}/{c.name}: {key} {e:.2e} > {tol:.0e}"
                        data["failures"].append(msg)
                        print(f"!!! MISMATCH flashrange vs {msg}", file=sys.stderr, flush=True)
                        if args.fail_fast:
                            stop = "stopped at the first mismatch (--fail-fast)"
            progress.step(f"{case.name}: create_block_mask")
            if not stop and not over_budget() and any(isinstance(c, Flex) for c in contenders):
                crec["block_mask"] = _block_mask_times(case, mask, device, timer)
            crec["ratios"] = _ratios(crec)
            crec["wall_s"] = time.perf_counter() - t_case
            del q, k, v, dout, ref
            _free(device, collect=True)
            _write(data, out_dir, with_plot=False)  # partial results survive a kill
    except KeyboardInterrupt:
        data["interrupted"] = True
        data["errors"].append("interrupted (time limit): later cases missing")
        for crec in data["cases"]:
            if "wall_s" not in crec and not crec.get("skipped"):
                crec["interrupted"] = True
            crec.setdefault("ratios", _ratios(crec))
    finally:
        progress.close()
    data["wall_s"] = time.perf_counter() - t_start
    _write(data, out_dir)
    print(markdown_report(data), flush=True)
    if data["failures"] or data["errors"]:
        print("!!! flashrange bench: " + "; ".join(data["errors"] + data["failures"])[:2000], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
