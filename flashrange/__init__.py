"""flashrange: flash attention for masks written as ranges.

Core: :func:`range_attention` over ``(q_ranges, k_ranges, mask_types)``;
:class:`RangeMask` builds and inspects masks; :func:`flex_flash_attn_func`,
:func:`flash_attn_func` and :func:`flash_attn_varlen_func` are drop-in
front-ends for MagiAttention / FlashAttention-3 users. Importing the package
is cheap: Triton and matplotlib load only when first needed.
"""

from .compat import flash_attn_func, flash_attn_varlen_func, flex_flash_attn_func
from .interface import range_attention
from .mask import RangeMask, bucket_capacity
from .reference import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL

__all__ = [
    "range_attention",
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
__version__ = "0.1.0"
