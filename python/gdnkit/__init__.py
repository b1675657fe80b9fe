"""gdnkit: Gated DeltaNet kernels for serving (decode, speculative verify/commit, chunked prefill).

The ops take any DLPack array (torch, CuPy, JAX, NumPy): CPU arrays run the CPU reference backend,
CUDA arrays the CUDA backend, on the caller's current stream. See python/README.md.

    import gdnkit
    o = gdnkit.decode(q, k, v, state, state_indices, layout="k_last",
                      a=a, b=b, A_log=A_log, dt_bias=dt_bias)

``gdnkit.distributed`` runs a prefill split over the ranks of a ``torch.distributed`` group (each rank a piece of
every sequence). With PyTorch installed, ``import gdnkit.torch_ops`` registers ``torch.ops.gdnkit.*`` custom ops
(torch.compile / CUDA graphs), and ``gdnkit.adapters.fla`` / ``gdnkit.adapters.sglang`` offer the call
signatures of FLA's and SGLang's kernels.
"""

from ._gdnkit import (GdnkitError, GdnkitNotImplementedError, GdnkitRuntimeError, build_info, cuda_available,
                      cuda_compiled)
from ._gdnkit import __version__ as __version__  # compiled in from include/gdnkit/version.h
from .ops import commit, convert_layout, decode, prefill, verify

__all__ = [
    "GdnkitError",
    "GdnkitNotImplementedError",
    "GdnkitRuntimeError",
    "build_info",
    "commit",
    "convert_layout",
    "cuda_available",
    "cuda_compiled",
    "decode",
    "prefill",
    "verify",
]
