"""Shared pytest set-up.

Without a GPU, Triton kernels run under the interpreter: ``TRITON_INTERPRET``
must be set before any ``@triton.jit`` function is defined, so it is set here,
before test modules import the kernels. With a GPU it is left alone.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny tensors: one intra-op thread is faster, and much faster on a busy machine (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
