"""CUDA helpers shared by the torch test modules (imported after their importorskip of torch)."""

import pytest
import torch

import gdnkit


def cuda_or_skip(fn, *args, **kwargs):
    """Run a CUDA call; a request the CUDA backend does not implement skips the test with its message."""
    try:
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return out
    except gdnkit.GdnkitNotImplementedError as e:
        pytest.skip(f"CUDA kernel not available: {e}")
