"""flashrange: flash attention for masks written as ranges.

Core: :func:`range_attention` over ``(q_ranges, k_ranges, mask_types)``;
:class:`RangeMask` builds and inspects masks; :func:`flex_flash_attn_func`,
:func:`flash_attn_func` and :func:`flash_attn_varlen_func` are drop-in
front-ends for MagiAttention / FlashAttention-3 users. Importing the package
is cheap: Triton and matplotlib load only when first needed.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

from .compat import flash_attn_func, flash_attn_varlen_func, flex_flash_attn_func
from .constants import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL
from .interface import plan_mask, range_attention
from .mask import RangeMask, bucket_capacity
from .plan import RangePlan

__all__ = [
    "range_attention",
    "plan_mask",
    "RangePlan",
    "RangeMask",
    "bucket_capacity",
    "flex_flash_attn_func",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "FULL",
    "CAUSAL",
    "INV_CAUSAL",
    "BI_CAUSAL",
    "__version__",
]
try:
    __version__ = _dist_version("flashrange")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
