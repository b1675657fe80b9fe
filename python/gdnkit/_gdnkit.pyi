"""Type stub of the nanobind extension gdnkit._gdnkit (python/src/gdnkit_ext.cpp).

The low-level binding of the C++ API: outputs are passed in, every array is required to be given
explicitly and ``stream`` is an integer ``cudaStream_t`` (0: the legacy default stream). gdnkit.ops
is the API built on it, with the arguments documented there.

Arrays are anything nanobind's ``ndarray`` imports: objects exporting DLPack (``__dlpack__``), DLPack
capsules and buffer-protocol objects.
"""

import types
from typing import Any, Optional

_Array = Any

__version__: str
"""The version compiled into the extension (include/gdnkit/version.h); gdnkit.__version__ is this."""

class GdnkitError(ValueError):
    """Invalid arguments to a gdnkit op (gdnkit::ErrorCode::kInvalidArgument)."""

class GdnkitNotImplementedError(NotImplementedError):
    """A valid request the chosen backend does not implement."""

class GdnkitRuntimeError(RuntimeError):
    """No usable device, or a CUDA runtime call failed."""

def decode(
    q: _Array,
    k: _Array,
    v: _Array,
    o: _Array,
    state: _Array,
    state_indices: _Array,
    *,
    layout: str,
    g: Optional[_Array] = None,
    beta: Optional[_Array] = None,
    a: Optional[_Array] = None,
    b: Optional[_Array] = None,
    A_log: Optional[_Array] = None,
    dt_bias: Optional[_Array] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    state_scales: Optional[_Array] = None,
    error_flag: Optional[_Array] = None,
    stream: int = 0,
) -> None:
    """gdnkit::decode; see gdnkit.ops.decode."""

def verify(
    q: _Array,
    k: _Array,
    v: _Array,
    o: _Array,
    state: _Array,
    state_indices: _Array,
    *,
    layout: str,
    g: Optional[_Array] = None,
    beta: Optional[_Array] = None,
    a: Optional[_Array] = None,
    b: Optional[_Array] = None,
    A_log: Optional[_Array] = None,
    dt_bias: Optional[_Array] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: Optional[_Array] = None,
    parent: Optional[_Array] = None,
    intermediate: Optional[_Array] = None,
    intermediate_indices: Optional[_Array] = None,
    update_state: bool = False,
    num_draft_tokens: int = 0,
    state_scales: Optional[_Array] = None,
    intermediate_scales: Optional[_Array] = None,
    error_flag: Optional[_Array] = None,
    stream: int = 0,
) -> None:
    """gdnkit::verify; see gdnkit.ops.verify (num_draft_tokens 0: not given)."""

def commit(
    k: _Array,
    v: _Array,
    state: _Array,
    state_indices: _Array,
    accepted: _Array,
    *,
    layout: str,
    source: str,
    q: Optional[_Array] = None,
    g: Optional[_Array] = None,
    beta: Optional[_Array] = None,
    a: Optional[_Array] = None,
    b: Optional[_Array] = None,
    A_log: Optional[_Array] = None,
    dt_bias: Optional[_Array] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: Optional[_Array] = None,
    parent: Optional[_Array] = None,
    intermediate: Optional[_Array] = None,
    intermediate_indices: Optional[_Array] = None,
    accepted_path: Optional[_Array] = None,
    num_draft_tokens: int = 0,
    state_scales: Optional[_Array] = None,
    intermediate_scales: Optional[_Array] = None,
    error_flag: Optional[_Array] = None,
    stream: int = 0,
) -> None:
    """gdnkit::commit; see gdnkit.ops.commit (num_draft_tokens 0: not given)."""

def prefill(
    q: _Array,
    k: _Array,
    v: _Array,
    o: _Array,
    cu_seqlens: _Array,
    *,
    layout: str,
    state: Optional[_Array] = None,
    initial_indices: Optional[_Array] = None,
    final_indices: Optional[_Array] = None,
    g: Optional[_Array] = None,
    beta: Optional[_Array] = None,
    a: Optional[_Array] = None,
    b: Optional[_Array] = None,
    A_log: Optional[_Array] = None,
    dt_bias: Optional[_Array] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    checkpoints: Optional[_Array] = None,
    checkpoint_interval: int = 0,
    checkpoint_indices: Optional[_Array] = None,
    cu_seqlens_cpu: Optional[_Array] = None,
    cpu_algorithm: str = "auto",
    workspace: Optional[_Array] = None,
    state_scales: Optional[_Array] = None,
    checkpoint_scales: Optional[_Array] = None,
    error_flag: Optional[_Array] = None,
    stream: int = 0,
) -> None:
    """gdnkit::prefill; see gdnkit.ops.prefill."""

def split_prefill(
    q: _Array,
    k: _Array,
    v: _Array,
    o: _Array,
    cu_seqlens: _Array,
    *,
    begin: bool,
    rank: int,
    num_ranks: int,
    exchange: _Array,
    layout: str,
    state: Optional[_Array] = None,
    initial_indices: Optional[_Array] = None,
    final_indices: Optional[_Array] = None,
    g: Optional[_Array] = None,
    beta: Optional[_Array] = None,
    a: Optional[_Array] = None,
    b: Optional[_Array] = None,
    A_log: Optional[_Array] = None,
    dt_bias: Optional[_Array] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    checkpoints: Optional[_Array] = None,
    checkpoint_interval: int = 0,
    checkpoint_indices: Optional[_Array] = None,
    cu_seqlens_cpu: Optional[_Array] = None,
    piece_offsets: Optional[_Array] = None,
    piece_offsets_cpu: Optional[_Array] = None,
    final_on_every_rank: bool = False,
    workspace: Optional[_Array] = None,
    state_scales: Optional[_Array] = None,
    checkpoint_scales: Optional[_Array] = None,
    error_flag: Optional[_Array] = None,
    stream: int = 0,
) -> None:
    """gdnkit::split_prefill_begin (begin=True) or split_prefill_end; see gdnkit.distributed."""

def convert_layout(
    src: _Array,
    dst: _Array,
    *,
    src_layout: str,
    src_scales: Optional[_Array] = None,
    dst_scales: Optional[_Array] = None,
    stream: int = 0,
) -> None:
    """gdnkit::convert_layout; see gdnkit.ops.convert_layout."""

def cuda_compiled() -> bool:
    """True when the library was built with the CUDA backend."""

def cuda_available() -> bool:
    """True when the library has the CUDA backend and a usable sm_90 device is present."""

def build_info() -> str:
    """Version, compiler, CUDA version, architectures and devices of the library, as text."""

# Test hooks (gdnkit._testing); not part of the API.
_testing: types.ModuleType
