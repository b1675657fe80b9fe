"""The gdnkit ops over DLPack arrays: allocate outputs, pick the caller's stream, call the extension.

Shapes use the spec's names (H q/k heads, HV value heads, K, V head dims, B sequences, T tokens, P pool
slots). Token arrays are ``[T_total, heads, dim]`` or ``[B, T, heads, dim]`` with the last dim
contiguous; the token and head strides are read from the arrays, so views of one fused projection
work without copies. State pools are ``[P, HV, V, K]`` (``layout="k_last"``) or ``[P, HV, K, V]``
(``layout="v_last"``), fp32 or bf16, updated in place. Index arrays are int32 and live on the same
device as the data.

Gates: either ``g`` (log-space decay, fp32) and ``beta``, or the fused path ``a``, ``b`` (raw
projections) with ``A_log`` and ``dt_bias`` ([HV] fp32):
``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.

CUDA arrays run on ``stream`` (an integer ``cudaStream_t``); by default on the current stream of the
arrays' framework (torch / CuPy), else the legacy default stream. No call synchronizes the host.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _gdnkit as _C

__all__ = ["decode", "verify", "commit", "prefill", "convert_layout"]


# ---- arrays crossing into the extension --------------------------------------------------------

def _framework(x: Any) -> str:
    return type(x).__module__.split(".", 1)[0]


def _dl(x: Any) -> Any:
    """The array as the extension should import it.

    torch's and CuPy's ``__dlpack__()`` with no stream argument make the legacy default stream wait
    for the current one (an event record + wait per tensor), which breaks CUDA-graph capture on a side
    stream and costs time. Their legacy exporters hand over the same memory without any stream work;
    the caller's stream is passed to the op explicitly instead.
    """
    if x is None:
        return None
    fw = _framework(x)
    if fw == "torch":
        import torch.utils.dlpack

        if x.requires_grad:
            x = x.detach()
        return torch.utils.dlpack.to_dlpack(x)
    if fw == "cupy":
        return x.toDlpack()
    return x


def _is_cuda(x: Any) -> bool:
    try:
        dev = x.__dlpack_device__()
    except AttributeError:
        return False
    return int(dev[0]) in (2, 13)  # kDLCUDA, kDLCUDAManaged


def _stream(stream: Optional[int], ref: Any) -> int:
    """The CUDA stream to run on: explicit, else the current stream of the array's framework."""
    if stream is not None:
        return int(stream)
    if not _is_cuda(ref):
        return 0
    fw = _framework(ref)
    if fw == "torch":
        import torch

        return int(torch.cuda.current_stream(ref.device).cuda_stream)
    if fw == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _empty(like: Any, shape, dtype=None, name: str = "o") -> Any:
    """A new array of ``shape`` (dtype of ``like`` unless given) in like's framework and device."""
    fw = _framework(like)
    dtype = like.dtype if dtype is None else dtype
    if fw == "torch":
        import torch

        return torch.empty(tuple(shape), dtype=dtype, device=like.device)
    if fw == "numpy":
        import numpy

        return numpy.empty(tuple(shape), dtype=dtype)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(tuple(shape), dtype=dtype)
    raise _C.GdnkitError(
        f"{name}: cannot allocate an output for arrays of type {type(like).__module__}.{type(like).__name__}; "
        f"pass {name}= explicitly")


def _arange(like: Any, stop: int, step: int = 1, dtype: str = "int32") -> Any:
    fw = _framework(like)
    if fw == "torch":
        import torch

        return torch.arange(0, stop, step, dtype=getattr(torch, dtype), device=like.device)
    if fw == "numpy":
        import numpy

        return numpy.arange(0, stop, step, dtype=dtype)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.arange(0, stop, step, dtype=dtype)
    raise _C.GdnkitError(f"cu_seqlens: cannot build one for arrays of type {type(like).__name__}; pass it")


def _gates(g, beta, a, b, A_log, dt_bias) -> dict:
    return dict(g=_dl(g), beta=_dl(beta), a=_dl(a), b=_dl(b), A_log=_dl(A_log), dt_bias=_dl(dt_bias))


# ---- ops ----------------------------------------------------------------------------------------

def decode(q, k, v, state, state_indices, *, layout: str = "k_last", g=None, beta=None, a=None, b=None,
           A_log=None, dt_bias=None, scale: Optional[float] = None, use_qk_l2norm: bool = True, o=None,
           error_flag=None, stream: Optional[int] = None):
    """One token per sequence: ``S = state[state_indices[i]]``, one step of the recurrence, S stored back.

    q, k ``[B, H, K]`` (or ``[B, 1, H, K]``), v ``[B, HV, V]``, gates ``[B, HV]``, state_indices ``[B]``
    int32 (negative: padding row, o = 0, no state I/O). Returns o (v's shape and dtype; written into
    ``o`` when given). ``error_flag``: optional int32 ``[1]``, incremented per slot >= P.
    """
    if o is None:
        o = _empty(v, v.shape)
    _C.decode(_dl(q), _dl(k), _dl(v), _dl(o), _dl(state), _dl(state_indices), layout=layout,
              **_gates(g, beta, a, b, A_log, dt_bias), scale=scale, use_qk_l2norm=use_qk_l2norm,
              error_flag=_dl(error_flag), stream=_stream(stream, v))
    return o


def verify(q, k, v, state, state_indices, *, layout: str = "k_last", g=None, beta=None, a=None, b=None,
           A_log=None, dt_bias=None, scale: Optional[float] = None, use_qk_l2norm: bool = True,
           cu_seqlens=None, parent=None, intermediate=None, intermediate_indices=None,
           update_state: bool = False, num_draft_tokens: Optional[int] = None, o=None, error_flag=None,
           stream: Optional[int] = None):
    """Speculative verify: T draft tokens per sequence scored at once; returns o for every token.

    Tokens are ``[B*T, ...]`` or ``[B, T, ...]`` (fixed T), or packed by ``cu_seqlens`` ``[B+1]`` int32
    with every length <= ``num_draft_tokens``. ``parent`` ``[B, T]`` int32: tree drafts (-1 = pool
    state). ``intermediate`` ``[Q, T, HV, <layout>]`` + ``intermediate_indices`` ``[B]``: the state after
    every token. ``update_state`` (chains only): store the state after the last token in the pool.
    """
    if o is None:
        o = _empty(v, v.shape)
    _C.verify(_dl(q), _dl(k), _dl(v), _dl(o), _dl(state), _dl(state_indices), layout=layout,
              **_gates(g, beta, a, b, A_log, dt_bias), scale=scale, use_qk_l2norm=use_qk_l2norm,
              cu_seqlens=_dl(cu_seqlens), parent=_dl(parent), intermediate=_dl(intermediate),
              intermediate_indices=_dl(intermediate_indices), update_state=update_state,
              num_draft_tokens=int(num_draft_tokens or 0), error_flag=_dl(error_flag),
              stream=_stream(stream, v))
    return o


def commit(k, v, state, state_indices, accepted, *, source: str = "cache", layout: str = "k_last", q=None,
           g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None, scale: Optional[float] = None,
           use_qk_l2norm: bool = True, cu_seqlens=None, parent=None, intermediate=None,
           intermediate_indices=None, accepted_path=None, num_draft_tokens: Optional[int] = None,
           error_flag=None, stream: Optional[int] = None) -> None:
    """After verification ``accepted[b]`` (0..T) draft tokens were kept; update the pool in place.

    ``source="cache"``: ``state[slot] = intermediate[islot, accepted-1]``; ``source="recompute"``: replay
    the kept tokens (k, v, gates of the verify call) from ``state[slot]``. Trees: ``accepted_path``
    ``[B, T]`` lists the kept token indices in order. Arguments are those of the verify call.
    """
    _C.commit(_dl(k), _dl(v), _dl(state), _dl(state_indices), _dl(accepted), layout=layout, source=source,
              q=_dl(q), **_gates(g, beta, a, b, A_log, dt_bias), scale=scale, use_qk_l2norm=use_qk_l2norm,
              cu_seqlens=_dl(cu_seqlens), parent=_dl(parent), intermediate=_dl(intermediate),
              intermediate_indices=_dl(intermediate_indices), accepted_path=_dl(accepted_path),
              num_draft_tokens=int(num_draft_tokens or 0), error_flag=_dl(error_flag),
              stream=_stream(stream, v))


def prefill(q, k, v, cu_seqlens=None, *, state=None, initial_indices=None, final_indices=None,
            layout: str = "k_last", g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
            scale: Optional[float] = None, use_qk_l2norm: bool = True, checkpoints=None,
            checkpoint_interval: int = 0, checkpoint_indices=None, cu_seqlens_cpu=None,
            cpu_algorithm: str = "auto", workspace=None, o=None, error_flag=None,
            stream: Optional[int] = None):
    """Chunked prefill of N sequences packed by ``cu_seqlens`` ``[N+1]`` (int32 or int64).

    Without cu_seqlens, a ``[B, T, ...]`` q is B sequences of T tokens and a ``[T, ...]`` q one sequence
    (a small index array is then allocated: pass cu_seqlens inside CUDA-graph capture).
    ``initial_indices`` / ``final_indices`` ``[N]`` int32: pool slots to start from (negative: S = 0)
    and to store the final state in (negative: not stored). ``checkpoints`` ``[Q, S, HV, <layout>]``:
    the state after every ``checkpoint_interval``-th token (a multiple of 64) at ``checkpoint_indices``.
    ``cu_seqlens_cpu``: an optional host copy, validated before launch. Returns o.
    """
    if cu_seqlens is None:
        shape = tuple(q.shape)
        n, t = (shape[0], shape[1]) if len(shape) == 4 else (1, shape[0])
        # [0, t, 2t, ..., n*t]; with t == 0 the n sequences are empty.
        cu_seqlens = _arange(q, n * t + 1, t) if t > 0 else _arange(q, n + 1) * 0
    if o is None:
        o = _empty(v, v.shape)
    _C.prefill(_dl(q), _dl(k), _dl(v), _dl(o), _dl(cu_seqlens), layout=layout, state=_dl(state),
               initial_indices=_dl(initial_indices), final_indices=_dl(final_indices),
               **_gates(g, beta, a, b, A_log, dt_bias), scale=scale, use_qk_l2norm=use_qk_l2norm,
               checkpoints=_dl(checkpoints), checkpoint_interval=int(checkpoint_interval),
               checkpoint_indices=_dl(checkpoint_indices), cu_seqlens_cpu=_dl(cu_seqlens_cpu),
               cpu_algorithm=cpu_algorithm, workspace=_dl(workspace), error_flag=_dl(error_flag),
               stream=_stream(stream, v))
    return o


def convert_layout(src, *, src_layout: str, dst=None, stream: Optional[int] = None):
    """Convert a pool between K-last ``[P, HV, V, K]`` and V-last ``[P, HV, K, V]``; returns dst.

    ``dst`` may be ``src`` itself when K == V (in place).
    """
    if dst is None:
        shape = tuple(src.shape)
        if len(shape) != 4:
            raise _C.GdnkitError(f"src: expected 4 dims [P, HV, ..], got shape {list(shape)}")
        dst = _empty(src, (shape[0], shape[1], shape[3], shape[2]), name="dst")
    _C.convert_layout(_dl(src), _dl(dst), src_layout=src_layout, stream=_stream(stream, src))
    return dst
