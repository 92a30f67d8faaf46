"""flashrange: flash attention for masks written as ranges."""

from .interface import range_attention

__all__ = ["range_attention"]
__version__ = "0.1.0"
