"""Triton kernels for the CUDA slot of the ``flashrange`` ops.

Nothing here is imported by ``import flashrange``: the ops import the kernels
lazily on the first CUDA call, so the package works without Triton.
"""
