"""Names and limits shared by every layer: mask-type codes, size limits, plan granularity.

One home for these values: the reference, the plan, the kernels (as
constexpr arguments), the front-ends, the scripts and the tests import them
from here (docs/design.md §2).
"""

from __future__ import annotations

import torch

__all__ = [
    "FULL",
    "CAUSAL",
    "INV_CAUSAL",
    "BI_CAUSAL",
    "MASK_TYPES",
    "TYPE_NAMES",
    "MAX_TOKENS",
    "MIN_HEAD_DIM",
    "MAX_HEAD_DIM",
    "MAX_HEAD_DIM_V",
    "WIDE_V_MAX_HEAD_DIM",
    "kernel_head_dims_ok",
    "KERNEL_DTYPES",
    "PLAN_BLOCK",
    "FWD_DYNAMIC_MIN_LEN",
    "BWD_DYNAMIC_MAX_LEN",
    "SHORT_SLICES_MEAN_LEN",
    "has_short_slices",
    "STRICT_ENV",
]

# Mask-type codes, as in MagiAttention's ``attn_type_map``.
FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3
MASK_TYPES = (FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL)
TYPE_NAMES = {FULL: "FULL", CAUSAL: "CAUSAL", INV_CAUSAL: "INV_CAUSAL", BI_CAUSAL: "BI_CAUSAL"}

# Tokens per tensor: the plan packs two coordinates of 30 bits each into one
# int64 sort key, and the kernels bound |key - row| by 2**30.
MAX_TOKENS = (1 << 30) - 1

# Head dims the kernels are built for; the reference takes any. Every pair with
# D and Dv up to MAX_HEAD_DIM, and wide values (Dv up to MAX_HEAD_DIM_V) when the
# query/key head dim is small (D up to WIDE_V_MAX_HEAD_DIM), as FlashAttention-3's
# d=64 / dv=512. DeepSeek's MLA shape (D=192, Dv=128) is inside the first set.
MIN_HEAD_DIM = 1
MAX_HEAD_DIM = 256
MAX_HEAD_DIM_V = 512
WIDE_V_MAX_HEAD_DIM = 64


def kernel_head_dims_ok(D: int, Dv: int) -> bool:
    """Whether the GPU kernels serve query/key head dim ``D`` with value head dim ``Dv``."""
    if D < MIN_HEAD_DIM or Dv < MIN_HEAD_DIM:
        return False
    if D <= MAX_HEAD_DIM and Dv <= MAX_HEAD_DIM:
        return True
    return D <= WIDE_V_MAX_HEAD_DIM and Dv <= MAX_HEAD_DIM_V

# Dtypes the GPU kernels run; float64 always runs the reference.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Rows (or keys) per block of the plan's work lists. Every kernel tile along
# the major axis divides it, so one plan serves the forward and both
# gradient kernels whatever their tile sizes.
PLAN_BLOCK = 128

# The Hopper kernels' adaptive schedules (docs/design.md, "Dynamic schedule") take work items from a shared
# counter or by a fixed share, by the length along the kernel's major axis (rows, or keys for dK/dV) of the
# slice where the mask's work is (the first of the plan's heaviest block's window). The forward takes the
# counter from this length up: short slices make short items, where its order was measured slower than the
# fixed share ...
FWD_DYNAMIC_MIN_LEN = 512
# ... and the backward up to this one: it gained on documents and lost a few percent on long slices.
BWD_DYNAMIC_MAX_LEN = 4096

# The Hopper defaults at head dim 128 pick their schedule per call from shapes alone (no host read of the
# ranges): a mask whose slots average at most this many tokens along the longer axis takes the short-slice
# schedules (forward: split key and value barriers; backward: the dynamic schedule), which were measured
# faster on documents of up to 2048 tokens and slower on single slices of 8192 tokens and more
# (BENCHMARKS.md, twenty-fifth session; docs/design.md, "Schedules chosen by shape").
SHORT_SLICES_MEAN_LEN = 4096


def has_short_slices(Tq: int, Tk: int, n_slots: int) -> bool:
    """Whether ``n_slots`` slots over ``Tq x Tk`` tokens average at most :data:`SHORT_SLICES_MEAN_LEN`
    tokens along the longer axis. Empty and padding slots count: they only make a mask look shorter."""
    return n_slots > 0 and max(Tq, Tk) <= SHORT_SLICES_MEAN_LEN * n_slots

# Environment variable that turns strict value checks on for every call.
STRICT_ENV = "FLASHRANGE_STRICT"
