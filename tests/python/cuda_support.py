"""CUDA helpers shared by the torch test modules (imported after their importorskip of torch)."""

import pytest
import torch

import gdnkit

CUDA = torch.cuda.is_available() and gdnkit.cuda_compiled()
NO_CUDA = "needs a CUDA device and a CUDA build of gdnkit"
needs_cuda = pytest.mark.skipif(not CUDA, reason=NO_CUDA)


def skip_without_peer(available: bool, why_missing: str):
    """Skip mark of the tests against a peer's own functions: they need CUDA and the peer."""
    return pytest.mark.skipif(not available, reason=why_missing if CUDA else NO_CUDA)


def cuda_or_skip(fn, *args, **kwargs):
    """Run a CUDA call; a request the CUDA backend does not implement skips the test with its message."""
    try:
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return out
    except gdnkit.GdnkitNotImplementedError as e:
        pytest.skip(f"CUDA kernel not available: {e}")
