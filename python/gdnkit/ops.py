"""The gdnkit ops over DLPack arrays: allocate outputs, pick the caller's stream, call the extension.

Shapes use the names of docs/semantics.md: ``H`` q/k heads, ``HV`` value heads (a multiple of ``H``;
value head ``h`` reads q/k head ``h // (HV // H)``), ``K``, ``V`` head dims (64, 128 or 256), ``B``
sequences, ``T`` tokens per sequence, ``T_total`` packed tokens, ``N`` prefill sequences, ``P`` pool
slots, ``Q`` cache slots.

Arrays: any object that exports DLPack (``torch.Tensor``, ``cupy.ndarray``, ``numpy.ndarray``, JAX
arrays as read-only inputs). CPU arrays run the CPU reference backend, CUDA arrays the CUDA backend;
all arrays of one call must be on one device.

- Token arrays are ``[T_total, heads, dim]`` or ``[B, T, heads, dim]`` with the last dim contiguous;
  the token and head strides are read from the arrays, so views of one fused projection work without
  copies. q, k and v share one dtype: float32, bfloat16 or float16.
- Per-head gates are ``[T_total, HV]`` (or ``[B, T, HV]``), any strides.
- State pools are ``[P, HV, V, K]`` (``layout="k_last"``) or ``[P, HV, K, V]`` (``layout="v_last"``),
  float32, bfloat16, float16 or float8_e4m3fn (with its block scales), updated in place. The last three dims are contiguous; the slot stride may be
  larger than ``HV*K*V`` (strided views).
- Index arrays are int32 (prefill's ``cu_seqlens`` may be int64) on the device of the data.

Gates: either ``g`` (log-space decay, float32) and ``beta``, or the fused path ``a``, ``b`` (raw
projections) with ``A_log`` and ``dt_bias`` (``[HV]`` float32):
``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.

CUDA arrays run on ``stream`` (an integer ``cudaStream_t``); by default on the current stream of the
arrays' framework (torch / CuPy), else the legacy default stream. No call synchronizes the host, so the
ops can be captured in CUDA graphs.

Errors: every op validates its arguments before it writes anything and raises ``TypeError`` for an
argument of the wrong Python type (a list where an array goes, a string where a float goes),
:class:`gdnkit.GdnkitError` (a ``ValueError``) for invalid arguments (shapes, dtypes, devices: a torch
tensor on the ``meta`` device too),
:class:`gdnkit.GdnkitNotImplementedError` (a ``NotImplementedError``) for a valid request the backend
does not implement, :class:`gdnkit.GdnkitRuntimeError` (a ``RuntimeError``) when no usable CUDA device
is present or a CUDA runtime call fails. The messages name the offending argument.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple, TypeVar, cast

from . import _gdnkit as _C

__all__ = ["decode", "verify", "commit", "prefill", "convert_layout", "DLPackArray"]


class DLPackArray(Protocol):
    """What the ops read from an array: DLPack export, a shape and a dtype.

    ``torch.Tensor``, ``cupy.ndarray``, ``numpy.ndarray`` and JAX arrays all qualify.
    """

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> Tuple[int, int]: ...

    @property
    def shape(self) -> Tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...


# The array type of v (src for convert_layout): an output the op allocates is of that type.
ArrayT = TypeVar("ArrayT", bound=DLPackArray)


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


def _empty(like: Any, shape: Sequence[int], dtype: Any = None, name: str = "o") -> Any:
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
    """``[0, step, 2*step, ...)`` below ``stop`` in like's framework and device."""
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


def _gates(g: Any, beta: Any, a: Any, b: Any, A_log: Any, dt_bias: Any) -> Dict[str, Any]:
    return dict(g=_dl(g), beta=_dl(beta), a=_dl(a), b=_dl(b), A_log=_dl(A_log), dt_bias=_dl(dt_bias))


# ---- arguments of the wrong Python type: named after the call failed ------------------------------
#
# A list where an array goes reaches nanobind, whose TypeError names neither the argument nor what it
# takes; a torch tensor on the meta device fails in torch's DLPack export. Checking every argument up front
# would cost every call (decode runs in microseconds), so the ops check them only once a call has failed
# with such an error, and then name the argument.

_SCALARS = {
    "layout": ("str", "'k_last' or 'v_last'"),
    "src_layout": ("str", "'k_last' or 'v_last'"),
    "source": ("str", "'cache' or 'recompute'"),
    "cpu_algorithm": ("str", "'auto', 'recurrent' or 'chunked'"),
    "scale": ("float", "a float > 0 or None (1/sqrt(K))"),
    "use_qk_l2norm": ("bool", "a bool"),
    "update_state": ("bool", "a bool"),
    "num_draft_tokens": ("int", "an int T or None"),
    "checkpoint_interval": ("int", "an int (a multiple of 64)"),
    "rank": ("int", "an int"),
    "num_ranks": ("int", "an int >= 1"),
    "stream": ("int", "an int cudaStream_t, or None for the current stream of the arrays' framework"),
}
_ARRAY_KINDS = "an array: torch.Tensor, numpy.ndarray, cupy.ndarray or another object with __dlpack__"


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_int(x: Any) -> bool:
    try:
        int(x)
        return not isinstance(x, (str, bytes, float))
    except (TypeError, ValueError):
        return False


def _check_scalar(name: str, x: Any, kind: str, what: str) -> None:
    if x is None and name in ("scale", "num_draft_tokens", "stream"):
        return
    ok = {
        "str": lambda: isinstance(x, str),
        "bool": lambda: isinstance(x, bool),  # what nanobind takes: not 0 / 1, nor NumPy's bool
        "int": lambda: _is_int(x),
        "float": lambda: not isinstance(x, (str, bytes)) and hasattr(x, "__float__"),
    }[kind]()
    if not ok:
        raise TypeError(f"{name}: expected {'a string, ' if kind == 'str' else ''}{what}, got {_type_name(x)}")


def _check_array(name: str, x: Any, required: bool = False) -> None:
    if x is None:
        if required:
            raise TypeError(f"{name}: expected {_ARRAY_KINDS}, got None")
        return
    if _framework(x) == "torch" and hasattr(x, "device"):
        if x.device.type == "meta":
            raise _C.GdnkitError(
                f"{name}: a tensor on the meta device has no data (expected a cpu or cuda tensor; "
                f"torch.compile traces the custom ops of gdnkit.torch_ops without running them)")
        if x.device.type not in ("cpu", "cuda"):
            raise _C.GdnkitError(f"{name}: tensors on {x.device} are not supported (expected cpu or cuda)")
        return
    if hasattr(x, "__dlpack__"):
        return
    try:
        memoryview(x)  # the buffer protocol: nanobind imports that too
        return
    except TypeError:
        pass
    hint = " (convert it first, e.g. with numpy.asarray or torch.tensor)" if isinstance(x, (list, tuple)) else ""
    raise TypeError(f"{name}: expected {_ARRAY_KINDS}, got {_type_name(x)}{hint}")


def _int_arg(name: str, x: Any) -> int:
    """An integer option as the extension takes it (None: 0); a float is not truncated, a negative count is
    an error (the extension would read a non-positive T as "not given")."""
    if x is None:
        return 0
    try:
        n = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected {_SCALARS[name][1]}, got {_type_name(x)}") from None
    if n < 0 and name == "num_draft_tokens":
        raise _C.GdnkitError(f"num_draft_tokens: expected an int T >= 1 or None, got {n}")
    return n


F = TypeVar("F", bound=Callable[..., Any])


def _names_bad_arguments(fn: F) -> F:
    """Runs the op; when it fails with an error that is not gdnkit's own, raises instead one that names the
    first argument of the wrong Python type (or a torch tensor on a device gdnkit cannot read), if any."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (_C.GdnkitError, _C.GdnkitNotImplementedError, _C.GdnkitRuntimeError):
            raise
        except (TypeError, ValueError, AttributeError, RuntimeError, BufferError):
            try:
                arguments = sig.bind(*args, **kwargs).arguments
            except TypeError:
                arguments = {}  # the call does not fit the signature: Python's message says so
            try:
                for name, x in arguments.items():
                    if name in _SCALARS:
                        _check_scalar(name, x, *_SCALARS[name])
                    else:
                        _check_array(name, x, sig.parameters[name].default is inspect.Parameter.empty)
            except (TypeError, _C.GdnkitError) as named:
                raise named from None
            raise  # no argument of a wrong type: the original error

    return cast(F, op)


# ---- ops ----------------------------------------------------------------------------------------

@_names_bad_arguments
def decode(q: DLPackArray, k: DLPackArray, v: ArrayT, state: DLPackArray, state_indices: DLPackArray, *,
           layout: str = "k_last", g: Optional[DLPackArray] = None, beta: Optional[DLPackArray] = None,
           a: Optional[DLPackArray] = None, b: Optional[DLPackArray] = None, A_log: Optional[DLPackArray] = None,
           dt_bias: Optional[DLPackArray] = None, scale: Optional[float] = None, use_qk_l2norm: bool = True,
           o: Optional[ArrayT] = None, error_flag: Optional[DLPackArray] = None,
           stream: Optional[int] = None, state_scales: Optional[DLPackArray] = None) -> ArrayT:
    """One token per sequence: one step of the recurrence from and back into the state pool.

    For each sequence ``i``: ``S = state[state_indices[i]]``, then the token's update of ``S`` and its
    output ``o[i]``, then ``S`` is stored back into the same slot.

    Parameters
    ----------
    q : array, [B, H, K] or [B, 1, H, K]
        Queries: float32, bfloat16 or float16, last dim contiguous.
    k : array, [B, H, K] or [B, 1, H, K]
        Keys, q's dtype.
    v : array, [B, HV, V] or [B, 1, HV, V]
        Values, q's dtype.
    state : array, [P, HV, V, K] (k_last) or [P, HV, K, V] (v_last)
        The state pool, float32, bfloat16, float16 or float8_e4m3fn (with ``state_scales``); the slots named in
        ``state_indices`` are updated in place.
    state_indices : array, [B], int32
        Pool slot of each sequence. Negative: a padding row (its output is 0, no state is read or
        written). Slots ``>= P`` are skipped (output 0) and counted in ``error_flag``.
    state_scales : array, [P, HV*K*V/32], uint8 or float8_e8m0fnu, optional
        With a float8_e4m3fn ``state`` (required there, refused otherwise): its block scales, one E8M0 byte
        (``2^(e-127)``) per 32 consecutive elements of a head in its layout, contiguous; updated with the slots.
    layout : {"k_last", "v_last"}, default "k_last"
        Layout of ``state``.
    g : array, [B, HV], float32, optional
        Given gates: log-space decay. Pass with ``beta``, not with the fused gating arguments.
    beta : array, [B, HV], optional
        Given gates: update strength, float32, bfloat16 or float16.
    a, b : array, [B, HV], optional
        Fused gating: the raw decay and beta projections, float32, bfloat16 or float16.
    A_log, dt_bias : array, [HV], float32, optional
        Fused gating: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.
    scale : float, optional
        Query scale, > 0; None: ``1 / sqrt(K)``.
    use_qk_l2norm : bool, default True
        L2-normalize q and k per head (``x / sqrt(sum(x^2) + 1e-6)``) before scaling q.
    o : array, [B, HV, V] or v's shape, optional
        Output in v's dtype; None: a new array like ``v`` (same framework, device, shape and dtype).
    error_flag : array, [1], int32, optional
        Incremented once per slot ``>= P``.
    stream : int, optional
        ``cudaStream_t`` for CUDA arrays; None: the current stream of the arrays' framework.

    Returns
    -------
    array
        ``o``: the outputs, ``[B, HV, V]`` (v's shape and dtype); the array passed as ``o`` if any.

    Raises
    ------
    GdnkitError
        Invalid arguments (nothing is written).
    GdnkitNotImplementedError
        A valid request the backend does not implement.
    GdnkitRuntimeError
        No usable CUDA device, or a CUDA runtime call failed.
    """
    if o is None:
        o = _empty(v, v.shape)
    _C.decode(_dl(q), _dl(k), _dl(v), _dl(o), _dl(state), _dl(state_indices), layout=layout,
              **_gates(g, beta, a, b, A_log, dt_bias), scale=scale, use_qk_l2norm=use_qk_l2norm,
              state_scales=_dl(state_scales), error_flag=_dl(error_flag), stream=_stream(stream, v))
    return o


@_names_bad_arguments
def verify(q: DLPackArray, k: DLPackArray, v: ArrayT, state: DLPackArray, state_indices: DLPackArray, *,
           layout: str = "k_last", g: Optional[DLPackArray] = None, beta: Optional[DLPackArray] = None,
           a: Optional[DLPackArray] = None, b: Optional[DLPackArray] = None, A_log: Optional[DLPackArray] = None,
           dt_bias: Optional[DLPackArray] = None, scale: Optional[float] = None, use_qk_l2norm: bool = True,
           cu_seqlens: Optional[DLPackArray] = None, parent: Optional[DLPackArray] = None,
           intermediate: Optional[DLPackArray] = None, intermediate_indices: Optional[DLPackArray] = None,
           update_state: bool = False, num_draft_tokens: Optional[int] = None, o: Optional[ArrayT] = None,
           error_flag: Optional[DLPackArray] = None, stream: Optional[int] = None,
           state_scales: Optional[DLPackArray] = None, intermediate_scales: Optional[DLPackArray] = None) -> ArrayT:
    """Speculative verify: score the draft tokens of every sequence at once.

    Sequence ``b`` starts from ``state[state_indices[b]]`` and runs its tokens in order (a chain), or
    along ``parent`` (a tree). The pool is not written unless ``update_state``; the state after every
    token can be kept in ``intermediate`` for :func:`commit`.

    Parameters
    ----------
    q : array, [B*T, H, K] or [B, T, H, K]; [T_total, H, K] with cu_seqlens
        Queries: float32, bfloat16 or float16, last dim contiguous. Without ``cu_seqlens`` every
        sequence has ``T = T_total / B`` tokens (rows ``b*T .. b*T+T-1``).
    k : array, q's shape
        Keys, q's dtype.
    v : array, [B*T, HV, V] or [B, T, HV, V]; [T_total, HV, V] with cu_seqlens
        Values, q's dtype.
    state : array, [P, HV, V, K] (k_last) or [P, HV, K, V] (v_last)
        The state pool, float32, bfloat16, float16 or float8_e4m3fn (with ``state_scales``).
    state_indices : array, [B], int32
        Pool slot of each sequence; negative: padding (outputs 0, no state I/O); ``>= P``: skipped and
        counted in ``error_flag``.
    state_scales : array, [P, HV*K*V/32], uint8 or float8_e8m0fnu, optional
        With a float8_e4m3fn ``state`` (required there, refused otherwise): its block scales, one E8M0 byte
        (``2^(e-127)``) per 32 consecutive elements of a head in its layout, contiguous; written with ``update_state``.
    layout : {"k_last", "v_last"}, default "k_last"
        Layout of ``state`` and ``intermediate``.
    g, beta, a, b, A_log, dt_bias : array, optional
        Gates as in :func:`decode`, per token: ``[T_total, HV]`` (or ``[B, T, HV]``); A_log and
        dt_bias ``[HV]`` float32.
    scale : float, optional
        Query scale, > 0; None: ``1 / sqrt(K)``.
    use_qk_l2norm : bool, default True
        L2-normalize q and k per head before scaling q.
    cu_seqlens : array, [B+1], int32, optional
        Varlen drafts: sequence ``b`` owns rows ``cu_seqlens[b] .. cu_seqlens[b+1]-1``, every length
        ``<= num_draft_tokens``.
    parent : array, [B, T], int32, optional
        Tree drafts: token ``t`` continues from the state after token ``parent[b, t]`` (``< t``; -1:
        the pool state). None: chains.
    intermediate : array, [Q, S, HV, V, K] (k_last) or [Q, S, HV, K, V] (v_last), optional
        Cache of the state after every token (``S >= T``), float32, bfloat16, float16 or float8_e4m3fn (with
        ``intermediate_scales``): the state after token ``t`` of sequence ``b`` is written to
        ``intermediate[intermediate_indices[b], t]``.
    intermediate_indices : array, [B], int32, optional
        Cache slot of each sequence, required with ``intermediate``; negative: not stored.
    intermediate_scales : array, [Q*S, HV*K*V/32], uint8 or float8_e8m0fnu, optional
        With a float8_e4m3fn ``intermediate``: its block scales, as ``state_scales`` per cache entry.
    update_state : bool, default False
        Chains only: store the state after the last token of each sequence in its pool slot.
    num_draft_tokens : int, optional
        ``T`` (the longest draft with ``cu_seqlens``, where it is required unless ``parent`` gives it).
        Without ``cu_seqlens`` it is ``T_total / B`` and, when given, must equal it.
    o : array, v's shape, optional
        Output in v's dtype; None: a new array like ``v``.
    error_flag : array, [1], int32, optional
        Incremented once per slot ``>= P``.
    stream : int, optional
        ``cudaStream_t`` for CUDA arrays; None: the current stream of the arrays' framework.

    Returns
    -------
    array
        ``o``: the output of every token (v's shape and dtype).

    Raises
    ------
    GdnkitError
        Invalid arguments (nothing is written), e.g. ``update_state`` with ``parent``.
    GdnkitNotImplementedError
        A valid request the backend does not implement.
    GdnkitRuntimeError
        No usable CUDA device, or a CUDA runtime call failed.
    """
    if o is None:
        o = _empty(v, v.shape)
    _C.verify(_dl(q), _dl(k), _dl(v), _dl(o), _dl(state), _dl(state_indices), layout=layout,
              **_gates(g, beta, a, b, A_log, dt_bias), scale=scale, use_qk_l2norm=use_qk_l2norm,
              cu_seqlens=_dl(cu_seqlens), parent=_dl(parent), intermediate=_dl(intermediate),
              intermediate_indices=_dl(intermediate_indices), update_state=update_state,
              num_draft_tokens=_int_arg("num_draft_tokens", num_draft_tokens), state_scales=_dl(state_scales),
              intermediate_scales=_dl(intermediate_scales), error_flag=_dl(error_flag), stream=_stream(stream, v))
    return o


@_names_bad_arguments
def commit(k: DLPackArray, v: DLPackArray, state: DLPackArray, state_indices: DLPackArray,
           accepted: DLPackArray, *, source: str = "cache", layout: str = "k_last", q: Optional[DLPackArray] = None,
           g: Optional[DLPackArray] = None, beta: Optional[DLPackArray] = None, a: Optional[DLPackArray] = None,
           b: Optional[DLPackArray] = None, A_log: Optional[DLPackArray] = None,
           dt_bias: Optional[DLPackArray] = None, scale: Optional[float] = None, use_qk_l2norm: bool = True,
           cu_seqlens: Optional[DLPackArray] = None, parent: Optional[DLPackArray] = None,
           intermediate: Optional[DLPackArray] = None, intermediate_indices: Optional[DLPackArray] = None,
           accepted_path: Optional[DLPackArray] = None, num_draft_tokens: Optional[int] = None,
           error_flag: Optional[DLPackArray] = None, stream: Optional[int] = None,
           state_scales: Optional[DLPackArray] = None, intermediate_scales: Optional[DLPackArray] = None) -> None:
    """After verification, keep the first ``accepted[b]`` draft tokens of each sequence in the pool.

    The arguments are those of the :func:`verify` call whose drafts were judged. Sequences with
    ``accepted[b] == 0`` keep their pool state unchanged.

    Parameters
    ----------
    k : array, [B*T, H, K] or [B, T, H, K]; [T_total, H, K] with cu_seqlens
        Keys of the verify call (read by ``source="recompute"``).
    v : array, [B*T, HV, V] or [B, T, HV, V]; [T_total, HV, V] with cu_seqlens
        Values of the verify call.
    state : array, [P, HV, V, K] (k_last) or [P, HV, K, V] (v_last)
        The state pool, float32, bfloat16, float16 or float8_e4m3fn (with ``state_scales``), updated in place.
    state_indices : array, [B], int32
        Pool slot of each sequence (negative: padding, skipped).
    accepted : array, [B], int32
        Number of kept tokens of each sequence, ``0 .. T``.
    source : {"cache", "recompute"}, default "cache"
        ``"cache"``: ``state[slot] = intermediate[islot, last kept token]`` (needs ``intermediate``).
        ``"recompute"``: replay the kept tokens (k, v and gates) from ``state[slot]``.
    layout : {"k_last", "v_last"}, default "k_last"
        Layout of ``state`` and ``intermediate``.
    q : array, optional
        Queries of the verify call; not read (commit computes no outputs).
    g, beta, a, b, A_log, dt_bias : array, optional
        Gates of the verify call, as in :func:`verify`.
    scale : float, optional
        As in the verify call.
    use_qk_l2norm : bool, default True
        As in the verify call.
    cu_seqlens : array, [B+1], int32, optional
        As in the verify call.
    parent : array, [B, T], int32, optional
        As in the verify call (trees).
    intermediate : array, [Q, S, HV, V, K] (k_last) or [Q, S, HV, K, V] (v_last), optional
        The cache the verify call wrote; required with ``source="cache"``.
    intermediate_indices : array, [B], int32, optional
        Cache slot of each sequence, as in the verify call.
    accepted_path : array, [B, T], int32, optional
        The kept token indices of each sequence in order (a root-to-node path); required for trees,
        optional for chains (where it is ``0 .. accepted[b]-1``).
    num_draft_tokens : int, optional
        As in the verify call.
    error_flag : array, [1], int32, optional
        Incremented once per slot ``>= P``.
    stream : int, optional
        ``cudaStream_t`` for CUDA arrays; None: the current stream of the arrays' framework.

    Raises
    ------
    GdnkitError
        Invalid arguments (nothing is written), e.g. ``source="cache"`` without ``intermediate``.
    GdnkitNotImplementedError
        A valid request the backend does not implement.
    GdnkitRuntimeError
        No usable CUDA device, or a CUDA runtime call failed.
    """
    _C.commit(_dl(k), _dl(v), _dl(state), _dl(state_indices), _dl(accepted), layout=layout, source=source,
              q=_dl(q), **_gates(g, beta, a, b, A_log, dt_bias), scale=scale, use_qk_l2norm=use_qk_l2norm,
              cu_seqlens=_dl(cu_seqlens), parent=_dl(parent), intermediate=_dl(intermediate),
              intermediate_indices=_dl(intermediate_indices), accepted_path=_dl(accepted_path),
              num_draft_tokens=_int_arg("num_draft_tokens", num_draft_tokens), state_scales=_dl(state_scales),
              intermediate_scales=_dl(intermediate_scales), error_flag=_dl(error_flag), stream=_stream(stream, v))


@_names_bad_arguments
def prefill(q: DLPackArray, k: DLPackArray, v: ArrayT, cu_seqlens: Optional[DLPackArray] = None, *,
            state: Optional[DLPackArray] = None, initial_indices: Optional[DLPackArray] = None,
            final_indices: Optional[DLPackArray] = None, layout: str = "k_last", g: Optional[DLPackArray] = None,
            beta: Optional[DLPackArray] = None, a: Optional[DLPackArray] = None, b: Optional[DLPackArray] = None,
            A_log: Optional[DLPackArray] = None, dt_bias: Optional[DLPackArray] = None,
            scale: Optional[float] = None, use_qk_l2norm: bool = True, checkpoints: Optional[DLPackArray] = None,
            checkpoint_interval: int = 0, checkpoint_indices: Optional[DLPackArray] = None,
            cu_seqlens_cpu: Optional[DLPackArray] = None, cpu_algorithm: str = "auto",
            workspace: Optional[DLPackArray] = None, o: Optional[ArrayT] = None,
            error_flag: Optional[DLPackArray] = None, stream: Optional[int] = None,
            state_scales: Optional[DLPackArray] = None, checkpoint_scales: Optional[DLPackArray] = None) -> ArrayT:
    """Chunked prefill of ``N`` sequences packed along the token axis.

    Sequence ``n`` owns tokens ``cu_seqlens[n] .. cu_seqlens[n+1]-1`` (any length, 0 too). It starts
    from ``state[initial_indices[n]]`` (or from ``S = 0``), and its final state is stored in
    ``state[final_indices[n]]`` when asked.

    Parameters
    ----------
    q : array, [T_total, H, K] or [B, T, H, K]
        Queries: float32, bfloat16 or float16, last dim contiguous.
    k : array, q's shape
        Keys, q's dtype.
    v : array, [T_total, HV, V] or [B, T, HV, V]
        Values, q's dtype.
    cu_seqlens : array, [N+1], int32 or int64, optional
        Sequence offsets: ``cu_seqlens[0] = 0``, non-decreasing, ``cu_seqlens[N] = T_total``. None: a
        ``[B, T, ...]`` q is B sequences of T tokens and a ``[T, ...]`` q one sequence; a small index
        array is then allocated, so pass ``cu_seqlens`` inside CUDA-graph capture.
    state : array, [P, HV, V, K] (k_last) or [P, HV, K, V] (v_last), optional
        The state pool, float32, bfloat16, float16 or float8_e4m3fn (with ``state_scales``); required with
        ``initial_indices`` or ``final_indices``.
    state_scales : array, [P, HV*K*V/32], uint8 or float8_e8m0fnu, optional
        With a float8_e4m3fn ``state`` (required there, refused otherwise): its block scales, one E8M0 byte
        (``2^(e-127)``) per 32 consecutive elements of a head in its layout, contiguous; the final slots' written with them.
    initial_indices : array, [N], int32, optional
        Slot each sequence starts from; negative (or None): ``S = 0``.
    final_indices : array, [N], int32, optional
        Slot each final state is stored in (may equal the initial slot); negative (or None): not stored.
    layout : {"k_last", "v_last"}, default "k_last"
        Layout of ``state`` and ``checkpoints``.
    g, beta, a, b, A_log, dt_bias : array, optional
        Gates as in :func:`decode`, per token: ``[T_total, HV]`` (or ``[B, T, HV]``); A_log and
        dt_bias ``[HV]`` float32.
    scale : float, optional
        Query scale, > 0; None: ``1 / sqrt(K)``.
    use_qk_l2norm : bool, default True
        L2-normalize q and k per head before scaling q.
    checkpoints : array, [Q, S, HV, V, K] (k_last) or [Q, S, HV, K, V] (v_last), optional
        States for prefix caching, float32, bfloat16, float16 or float8_e4m3fn (with ``checkpoint_scales``):
        entry ``j`` of sequence n's slot
        ``checkpoint_indices[n]`` receives the state after token ``(j+1) * checkpoint_interval``, for
        ``j < min(S, len_n // checkpoint_interval)``.
    checkpoint_interval : int, default 0
        Tokens between checkpoints, a multiple of 64; required (> 0) with ``checkpoints``.
    checkpoint_indices : array, [N], int32, optional
        Checkpoint slot of each sequence; negative: none stored.
    checkpoint_scales : array, [Q*S, HV*K*V/32], uint8 or float8_e8m0fnu, optional
        With float8_e4m3fn ``checkpoints``: their block scales, as ``state_scales`` per entry.
    cu_seqlens_cpu : array, [N+1], int32 or int64, optional
        A host copy of ``cu_seqlens``: validated before launch; on the CUDA backend it also lets the
        library launch only the kernels the batch needs.
    cpu_algorithm : {"auto", "recurrent", "chunked"}, default "auto"
        The CPU backend's prefill algorithm (ignored on CUDA).
    workspace : array, optional
        CUDA scratch memory (contiguous bytes, at least what the C++ ``gdnkit::prefill_workspace_bytes``
        reports). None: a buffer the library owns per device, allocated on its first use (make one eager
        call before capturing a CUDA graph) and shared by every call on that device, so calls on
        different streams that may overlap need their own workspace.
    o : array, v's shape, optional
        Output in v's dtype; None: a new array like ``v``.
    error_flag : array, [1], int32, optional
        Incremented once per out-of-range slot or invalid sequence found on the device.
    stream : int, optional
        ``cudaStream_t`` for CUDA arrays; None: the current stream of the arrays' framework.

    Returns
    -------
    array
        ``o``: the output of every token (v's shape and dtype).

    Raises
    ------
    GdnkitError
        Invalid arguments (nothing is written), e.g. a decreasing ``cu_seqlens``.
    GdnkitNotImplementedError
        A valid request the backend does not implement.
    GdnkitRuntimeError
        No usable CUDA device, or a CUDA runtime call failed.
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
               checkpoints=_dl(checkpoints),
               checkpoint_interval=_int_arg("checkpoint_interval", checkpoint_interval),
               checkpoint_indices=_dl(checkpoint_indices), cu_seqlens_cpu=_dl(cu_seqlens_cpu),
               cpu_algorithm=cpu_algorithm, workspace=_dl(workspace), state_scales=_dl(state_scales),
               checkpoint_scales=_dl(checkpoint_scales), error_flag=_dl(error_flag), stream=_stream(stream, v))
    return o


@_names_bad_arguments
def convert_layout(src: ArrayT, *, src_layout: str, dst: Optional[ArrayT] = None,
                   stream: Optional[int] = None, src_scales: Optional[DLPackArray] = None,
                   dst_scales: Optional[DLPackArray] = None) -> ArrayT:
    """Convert a state pool between the K-last and the V-last layout.

    Parameters
    ----------
    src : array, [P, HV, V, K] (k_last) or [P, HV, K, V] (v_last)
        The pool to convert, float32, bfloat16, float16 or float8_e4m3fn (with ``src_scales``, and ``dst`` and
        ``dst_scales`` given: the blocks of the other layout are requantized); the last three dims contiguous.
    src_layout : {"k_last", "v_last"}
        Layout of ``src``; ``dst`` has the other one.
    dst : array, src's shape with the last two dims swapped, optional
        The converted pool (src's dtype and ``P``). May be ``src`` itself when ``K == V`` (in place);
        otherwise the two must not overlap. None: a new array like ``src``.
    src_scales, dst_scales : array, [P, HV*K*V/32], uint8 or float8_e8m0fnu, optional
        With a float8_e4m3fn ``src``: the block scales of ``src`` and ``dst`` (``dst_scales`` may be
        ``src_scales`` in place).
    stream : int, optional
        ``cudaStream_t`` for CUDA arrays; None: the current stream of the arrays' framework.

    Returns
    -------
    array
        ``dst``.

    Raises
    ------
    GdnkitError
        Invalid arguments (nothing is written).
    GdnkitRuntimeError
        No usable CUDA device, or a CUDA runtime call failed.
    """
    if dst is None and src_scales is not None:
        raise _C.GdnkitError("dst: required with src_scales (a float8_e4m3fn conversion writes dst and dst_scales)")
    if dst is None:
        shape = tuple(src.shape)
        if len(shape) != 4:
            raise _C.GdnkitError(f"src: expected 4 dims [P, HV, ..], got shape {list(shape)}")
        dst = _empty(src, (shape[0], shape[1], shape[3], shape[2]), name="dst")
    _C.convert_layout(_dl(src), _dl(dst), src_layout=src_layout, src_scales=_dl(src_scales),
                      dst_scales=_dl(dst_scales), stream=_stream(stream, src))
    return dst
