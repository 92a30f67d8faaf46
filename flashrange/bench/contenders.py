"""The contenders: every way of computing a case's attention that the benchmark compares.

Each contender is called through its public API, as its users call it, on
the same ``q, k, v`` (moved to its layout outside the timed region):

- ``flashrange``: ``flashrange.range_attention(q, k, v, *mask.tensors())``,
  planning included, as a user writes it;
- ``flashrange+plan``: the same with ``plan=flashrange.plan_mask(...)``
  built once outside the timed region (what a model with many layers pays
  per layer);
- ``flashrange-op``: the raw ``torch.ops.flashrange.fwd`` op with a plan from
  ``torch.ops.flashrange.plan``: no Python front-end at all;
- ``sdpa-cudnn`` / ``sdpa-flash``: ``scaled_dot_product_attention`` pinned to
  one backend; full and causal masks only (``is_causal``; every case has
  ``Tq == Tk``, where SDPA's top-left causal alignment equals flashrange's
  bottom-right one); ``sdpa-math`` on the CPU, for the harness check;
- ``flex``: ``flex_attention`` under ``torch.compile``, its block mask built
  once outside the timed region; ``flex+mask``: ``create_block_mask`` inside
  the timed region, as a training step whose mask changes every step pays;
- optional peers, only where importable: FlashAttention-4
  (``flash_attn.cute.interface``), FlashAttention-3 (``flash_attn_interface``),
  FlashAttention-2 (``flash_attn``) — dense API for full, causal and
  sliding-window masks, varlen API for documents — and MagiAttention's
  ``flex_flash_attn_func`` (the same ranges as flashrange).

A contender that cannot express a case without a dense mask says why
(:meth:`Contender.unsupported`) and the table shows ``n/a``.
"""

from __future__ import annotations

import importlib
import inspect
import time

import torch

from .timing import measure, synchronize

__all__ = [
    "Contender",
    "FlashRangePublic",
    "FlashRangePlanned",
    "FlashRangeOp",
    "SDPA",
    "Flex",
    "FlashAttnPeer",
    "MagiFFA",
    "contenders_for",
    "optional_peers",
    "time_create_block_mask",
    "short_error",
]


def short_error(e: BaseException) -> str:
    """``Type: first line`` of an exception, short enough for a table cell."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:160]


def _kwargs_for(fn, kwargs):
    """``kwargs`` restricted to the parameters ``fn`` declares (peers' signatures drift between versions)."""
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
    """A way of computing attention.

    ``layout``: ``thd`` `(T, H, D)`, ``bshd`` `(1, T, H, D)` or ``bhsd``
    `(1, H, T, D)` (contiguous). ``compiles``: compiled per case (slow to
    start; ``--check`` skips it unless named). ``extra``: numbers the last
    :meth:`make` measured on the way (e.g. a block mask's first build).
    """

    name = "?"
    layout = "thd"
    is_flashrange = False
    compiles = False

    def __init__(self):
        self.extra = {}

    def unsupported(self, case, cm, device, dtype) -> str | None:
        """Why this contender cannot run the case (shown as ``n/a``), or ``None``."""
        return None

    def backward_on(self, device) -> bool:
        """Whether this contender can differentiate on ``device``."""
        return True

    def make(self, case, cm):
        """A function ``(q, k, v) -> out`` in this contender's layout, for case ``case`` with mask ``cm``."""
        raise NotImplementedError

    def to_layout(self, t):
        if self.layout == "bhsd":
            return t.transpose(0, 1).unsqueeze(0).contiguous()
        if self.layout == "bshd":
            return t.unsqueeze(0)
        return t

    def from_layout(self, t):
        if self.layout == "bhsd":
            return t[0].transpose(0, 1)
        if self.layout == "bshd":
            return t[0]
        return t


# ---------------------------------------------------------------------------
# flashrange, three ways


class FlashRangePublic(Contender):
    """``flashrange.range_attention`` on the ranges; with ``plan_once``, the plan is made once, outside the call."""

    name = "flashrange"
    is_flashrange = True
    plan_once = False

    def make(self, case, cm):
        import flashrange

        mask = cm.mask
        kwargs = {"plan": flashrange.plan_mask(*mask.tensors(), case.T, case.T)} if self.plan_once else {}

        def fn(q, k, v):
            return flashrange.range_attention(q, k, v, *mask.tensors(), **kwargs)[0]

        return fn


class FlashRangePlanned(FlashRangePublic):
    name = "flashrange+plan"
    plan_once = True


class FlashRangeOp(Contender):
    name = "flashrange-op"
    is_flashrange = True

    def make(self, case, cm):
        import flashrange  # noqa: F401 (registers the ops)

        qr, kr, mt = cm.mask.tensors()
        plan = list(torch.ops.flashrange.plan(qr, kr, mt, case.T, case.T))
        scale = case.D ** -0.5
        fwd = torch.ops.flashrange.fwd

        def fn(q, k, v):
            return fwd(q, k, v, qr, kr, mt, plan, scale, 0.0)[0]

        return fn


# ---------------------------------------------------------------------------
# PyTorch peers


class SDPA(Contender):
    layout = "bhsd"

    def __init__(self, name, backend):
        super().__init__()
        self.name = name
        self.backend = backend

    def unsupported(self, case, cm, device, dtype):
        if cm.sdpa_causal is None:
            return "needs a dense attn_mask"
        if self.backend.name != "MATH" and torch.device(device).type != "cuda":
            return "needs CUDA"
        return None

    def make(self, case, cm):
        from torch.nn.attention import sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        kwargs = {"is_causal": bool(cm.sdpa_causal)}
        if case.Hq != case.Hkv:
            kwargs["enable_gqa"] = True
        backend = self.backend

        def fn(q, k, v):
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, **kwargs)

        return fn


_COMPILED: dict = {}


def _compiled(name):
    """One ``torch.compile`` wrapper per FlexAttention function, shared by ``flex``, ``flex+mask``
    and the block-mask timing, so that they reuse each other's compiled graphs."""
    if name not in _COMPILED:
        from torch.nn.attention import flex_attention as fa

        _COMPILED[name] = torch.compile(getattr(fa, name), dynamic=False)
    return _COMPILED[name]


def _flex_functions(device):
    """``(flex_attention, create_block_mask)``: compiled on CUDA, eager elsewhere (the CPU harness check)."""
    if torch.device(device).type == "cuda":
        return _compiled("flex_attention"), _compiled("create_block_mask")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return flex_attention, create_block_mask


class Flex(Contender):
    """FlexAttention; ``end_to_end`` builds the block mask inside the timed call."""

    layout = "bhsd"
    compiles = True

    def __init__(self, end_to_end=False):
        super().__init__()
        self.end_to_end = end_to_end
        self.name = "flex+mask" if end_to_end else "flex"

    def backward_on(self, device):
        return torch.device(device).type == "cuda"  # the eager CPU path is a harness check, forward only

    def unsupported(self, case, cm, device, dtype):
        if self.end_to_end and cm.mask_mod is None:
            return "no block mask for full attention"
        return None

    def make(self, case, cm):
        device = cm.mask.device
        flex, cbm = _flex_functions(device)
        kwargs = {"enable_gqa": True} if case.Hq != case.Hkv else {}
        mm, T = cm.mask_mod, case.T
        if self.end_to_end:
            def fn(q, k, v):
                return flex(q, k, v, block_mask=cbm(mm, None, None, T, T, device=device), **kwargs)

            return fn
        block_mask = None
        if mm is not None:
            t0 = time.perf_counter()
            block_mask = cbm(mm, None, None, T, T, device=device)
            synchronize(device)
            self.extra = {"block_mask_first_call_s": time.perf_counter() - t0}

        def fn(q, k, v):
            return flex(q, k, v, block_mask=block_mask, **kwargs)

        return fn


def time_create_block_mask(case, cm, device, *, warmup, reps) -> dict:
    """``create_block_mask`` alone for this case: eager and compiled (CUDA only) timings, as dicts."""
    if cm.mask_mod is None:
        return {"eager": None, "compiled": None, "note": "full attention: no block mask"}
    from torch.nn.attention.flex_attention import create_block_mask

    T, mm = case.T, cm.mask_mod
    res = {"eager": None, "compiled": None, "compiled_first_call_s": None, "note": ""}
    try:
        res["eager"] = measure(lambda: create_block_mask(mm, None, None, T, T, device=device), device=device,
                               warmup=1, reps=max(1, min(reps, 5))).as_dict()
    except Exception as e:  # noqa: BLE001 (a peer failing is a result)
        res["note"] = f"eager: {short_error(e)}"
    if torch.device(device).type == "cuda":
        try:
            cbm = _compiled("create_block_mask")
            t0 = time.perf_counter()
            cbm(mm, None, None, T, T, device=device)
            synchronize(device)
            res["compiled_first_call_s"] = time.perf_counter() - t0
            res["compiled"] = measure(lambda: cbm(mm, None, None, T, T, device=device), device=device,
                                      warmup=warmup, reps=reps).as_dict()
        except Exception as e:  # noqa: BLE001
            res["note"] += f" compiled: {short_error(e)}"
    return res


# ---------------------------------------------------------------------------
# Optional peers


class FlashAttnPeer(Contender):
    """FlashAttention 2/3/4 through ``flash_attn_func`` / ``flash_attn_varlen_func``."""

    def __init__(self, name, func, varlen_func):
        super().__init__()
        self.name = name
        self.func = func
        self.varlen_func = varlen_func

    def unsupported(self, case, cm, device, dtype):
        if torch.device(device).type != "cuda":
            return "needs CUDA"
        if case.kind in ("shared_question", "block_causal"):
            return "mask not expressible"
        return None

    def make(self, case, cm):
        if cm.cu_seqlens is not None:
            self.layout = "thd"
            f = self.varlen_func
            kw = _kwargs_for(f, {"cu_seqlens_q": cm.cu_seqlens, "cu_seqlens_k": cm.cu_seqlens,
                                 "max_seqlen_q": cm.max_seqlen, "max_seqlen_k": cm.max_seqlen, "causal": True})

            def fn(q, k, v):
                return _first(f(q, k, v, **kw))

            return fn
        self.layout = "bshd"
        f = self.func
        args = {"causal": case.kind in ("causal", "window")}
        if cm.window:
            # FlashAttention counts the keys left of the diagonal: W keys in all.
            args["window_size"] = (cm.window - 1, 0)
        kw = _kwargs_for(f, args)

        def fn(q, k, v):
            return _first(f(q, k, v, **kw))

        return fn


class MagiFFA(Contender):
    """MagiAttention's ``flex_flash_attn_func``: the same ranges as flashrange."""

    name = "magi-ffa"

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def unsupported(self, case, cm, device, dtype):
        return None if torch.device(device).type == "cuda" else "needs CUDA"

    def make(self, case, cm):
        qr, kr, mt = cm.mask.tensors()
        kw = _kwargs_for(self.fn, {"q_ranges": qr, "k_ranges": kr, "attn_type_map": mt,
                                   "max_seqlen_q": case.T, "max_seqlen_k": case.T})
        f = self.fn

        def fn(q, k, v):
            return _first(f(q, k, v, **kw))

        return fn


def optional_peers():
    """Installed optional peers; a missing or broken install is skipped silently."""
    peers = []
    for name, module in (("fa4", "flash_attn.cute.interface"), ("fa3", "flash_attn_interface"),
                         ("fa2", "flash_attn")):
        try:
            mod = importlib.import_module(module)
            peers.append(FlashAttnPeer(name, mod.flash_attn_func, mod.flash_attn_varlen_func))
        except Exception:  # noqa: BLE001 (not installed, or unusable here: not a contender)
            continue
    try:
        from magi_attention.functional import flex_flash_attn_func

        peers.append(MagiFFA(flex_flash_attn_func))
    except Exception:  # noqa: BLE001
        pass
    return peers


def contenders_for(device) -> list[Contender]:
    """Every contender available on ``device``, flashrange's first."""
    from torch.nn.attention import SDPBackend

    out: list[Contender] = [FlashRangePublic(), FlashRangePlanned(), FlashRangeOp()]
    if torch.device(device).type == "cuda":
        out += [SDPA("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), SDPA("sdpa-flash", SDPBackend.FLASH_ATTENTION)]
    else:
        out += [SDPA("sdpa-math", SDPBackend.MATH)]
    out += [Flex(), Flex(end_to_end=True)]
    out += optional_peers()
    return out
