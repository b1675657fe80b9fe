"""What the adapters share: argument checks, how tensors reach the kernels, op calls into a caller's
buffer, gates computed with torch, and index arithmetic done on the device.

Tensors reach the kernels as they are whenever the kernels can read them: token rows (q, k, v) with any
token and head stride and a contiguous last dim, per-head scalars (gates) with any strides, state pools
with any slot stride. A ``[B, T, ...]`` tensor is read as ``B*T`` token rows, which needs
``stride(0) == T * stride(1)``. Only a tensor the kernels cannot read is copied (:func:`tokens`,
:func:`gates`): a last dim that is not contiguous, a batch axis that does not continue the token axis
(a time slice ``x[:, :T]`` of a longer buffer), rows that overlap (``expand``), or, on CUDA, rows that are
not 16-byte aligned. A batch gap cannot be expressed as a view: ``cu_seqlens`` must tile the token axis
without gaps (docs/semantics.md), so a view would need filler sequences computed over rows that are not
the caller's, and every tensor of the call would need the same gap; copying the one tensor is cheaper.

Nothing here synchronizes with the host unless its docstring says so.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops as _ops
from .. import torch_ops  # noqa: F401  (registers torch.ops.gdnkit.*)
from .._gdnkit import GdnkitError

Device = Union[torch.device, str, int]

_VECTOR_BYTES = 16  # the CUDA kernels load token rows and state slots in 16-byte vectors


class _Unset:
    """The default of a keyword the peer reads only when it is passed (``'name' in kwargs``)."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


# ---- errors ---------------------------------------------------------------------------------------

def not_supported(function: str, option: str, why: str = "") -> NotImplementedError:
    """The error for an option gdnkit does not implement, naming the adapter function and the option."""
    return NotImplementedError(f"gdnkit.adapters {function}: {option} is not supported by gdnkit"
                               + (f" ({why})" if why else ""))


def require_no_grad(function: str, *tensors: Optional[Tensor]) -> None:
    """The adapters are forward-only: refuse inputs that would need a backward pass."""
    if not torch.is_grad_enabled():
        return
    for t in tensors:
        if t is not None and t.requires_grad:
            raise not_supported(function, "autograd (an input requires grad)",
                                "inference only: call under torch.no_grad() or torch.inference_mode()")


def check_heads(function: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]`` with the same H for q and k and H dividing HV."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise GdnkitError(f"{function}: expected q, k [B, T, H, K] and v [B, T, HV, V], got q {list(q.shape)}, "
                          f"k {list(k.shape)}, v {list(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise GdnkitError(f"{function}: q and k must have the same number of heads, but got "
                          f"q.shape[2]={q.shape[2]} and k.shape[2]={k.shape[2]}")
    if q.shape[2] == 0 or v.shape[2] % q.shape[2] != 0:
        raise GdnkitError(f"{function}: num_v_heads (HV={v.shape[2]}) must be evenly divisible by num_heads "
                          f"(H={q.shape[2]})")


# ---- dtypes ---------------------------------------------------------------------------------------

@overload
def fp32(t: Tensor) -> Tensor: ...


@overload
def fp32(t: None) -> None: ...


def fp32(t: Optional[Tensor]) -> Optional[Tensor]:
    """t as float32 (None stays None)."""
    return None if t is None else (t if t.dtype == torch.float32 else t.float())


def gate_dtype(t: Tensor) -> Tensor:
    """Per-head gate inputs: fp32, bf16 and fp16 are read as they are; anything else becomes fp32."""
    return t if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else t.float()


def state_dtype(t: Tensor) -> Tensor:
    """State pools: fp32 and bf16 are read as they are; anything else becomes fp32."""
    return t if t.dtype in (torch.float32, torch.bfloat16) else t.float()


def head_param(t: Tensor) -> Tensor:
    """A per-head parameter (A_log, dt_bias) as the kernels read it: ``[HV]`` float32, contiguous."""
    return fp32(t).reshape(-1).contiguous()


def int32(t: Tensor) -> Tensor:
    """An index tensor as the kernels read it: int32, contiguous (copied only when it is not)."""
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()


def arange32(n: int, device: Device) -> Tensor:
    """[0, 1, ..., n-1] as int32."""
    return torch.arange(n, dtype=torch.int32, device=device)


def fixed_cu_seqlens(B: int, T: int, device: Device) -> Tensor:
    """[0, T, 2T, ..., B*T] as int32."""
    if T == 0:
        return torch.zeros(B + 1, dtype=torch.int32, device=device)
    return torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device)


# ---- what the kernels read as it is -------------------------------------------------------------

def _aligned(t: Tensor, nbytes: int) -> bool:
    if torch.compiler.is_compiling():
        # A traced tensor has no address, and not every torch version traces storage_offset(): the CPU
        # backend needs no alignment, a CUDA tensor is taken as unaligned (a fresh, aligned copy).
        return t.device.type == "cpu"
    return t.data_ptr() % nbytes == 0


def readable(t: Tensor, per_token_dims: int) -> bool:
    """Whether the kernels read ``t`` without a copy. per_token_dims: 2 for token data
    (``[T, heads, dim]`` or ``[B, T, heads, dim]``), 1 for per-head scalars (``[T, heads]`` or
    ``[B, T, heads]``). Mirrors the binding's merge of [B, T] and the library's view validation
    (docs/api.md, "What validation checks"); a tensor of another rank is left to the op's error."""
    nd = t.dim()
    if nd == per_token_dims + 1:
        count, ts = t.shape[0], t.stride(0)
    elif nd == per_token_dims + 2:
        B, T = t.shape[0], t.shape[1]
        if B > 1 and T > 1 and t.stride(0) != T * t.stride(1):
            return False
        count, ts = B * T, (t.stride(0) if T == 1 else t.stride(1))
    else:
        return True
    if count == 0:
        return True
    if per_token_dims == 2:
        heads, dim, hs = t.shape[-2], t.shape[-1], t.stride(-2)
        if dim > 1 and t.stride(-1) != 1:
            return False
    else:
        heads, dim, hs = t.shape[-1], 1, t.stride(-1)
    if heads > 1 and hs < dim:
        return False
    if count > 1 and ts < (heads - 1) * (hs if heads > 1 else 0) + dim:
        return False
    vector = t.is_cuda and dim > 1
    if not _aligned(t, _VECTOR_BYTES if vector else t.element_size()):
        return False
    if vector:
        step = _VECTOR_BYTES // t.element_size()
        if (heads > 1 and hs % step) or (count > 1 and ts % step):
            return False
    return True


def _copy(t: Tensor) -> Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def tokens(t: Tensor) -> Tensor:
    """q, k or v for the kernels: ``t`` itself when they read it (any token and head stride, last dim
    contiguous, batch axis continuing the token axis, 16-byte aligned rows on CUDA), else a contiguous copy."""
    return t if readable(t, 2) else _copy(t)


def gates(t: Tensor) -> Tensor:
    """A per-head scalar tensor (g, beta, a, b) for the kernels: ``t`` itself when they read it (any strides
    whose rows do not overlap, batch axis continuing the token axis), else a contiguous copy."""
    return t if readable(t, 1) else _copy(t)


def token_gates(t: Tensor, T_total: int, HV: int) -> Tensor:
    """A gate given as any shape holding ``T_total * HV`` values in token-major order (``[B*T, HV]``,
    ``[B, T, HV]``, ...) as ``[T_total, HV]`` or ``[B, T, HV]`` the kernels read (a view where possible)."""
    if t.dim() in (2, 3) and t.shape[-1] == HV:
        return gates(t)
    return gates(t.reshape(T_total, HV))


def pool_readable(t: Tensor) -> bool:
    """Whether a state pool ``[P, HV, d1, d2]`` is read and written in place: float32 or bfloat16, the last
    three dims packed, any slot stride (16-byte aligned on CUDA)."""
    if t.dim() != 4 or t.dtype not in (torch.float32, torch.bfloat16):
        return False
    HV, d1, d2 = t.shape[1], t.shape[2], t.shape[3]
    if (d2 > 1 and t.stride(3) != 1) or (d1 > 1 and t.stride(2) != d2) or (HV > 1 and t.stride(1) != d1 * d2):
        return False
    align = _VECTOR_BYTES if t.is_cuda else t.element_size()
    if not _aligned(t, align):
        return False
    if t.is_cuda and t.shape[0] > 1 and t.stride(0) % (_VECTOR_BYTES // t.element_size()):
        return False
    return True


def pool_read_only(t: Tensor) -> Tensor:
    """A pool the call only reads: itself when the kernels read it, else a float32 contiguous copy."""
    if pool_readable(t):
        return t
    return t.to(dtype=torch.float32 if t.dtype != torch.bfloat16 else t.dtype,
                memory_format=torch.contiguous_format, copy=True)


def pool_in_place(function: str, name: str, t: Tensor) -> Tensor:
    """A pool the call updates in place: itself, or an error when the kernels cannot write it (a copy
    would lose the update)."""
    if pool_readable(t):
        return t
    if t.dim() == 4 and t.dtype not in (torch.float32, torch.bfloat16):
        raise not_supported(function, f"a {str(t.dtype).replace('torch.', '')} {name}",
                            "gdnkit's state pools are float32 or bfloat16")
    raise GdnkitError(f"{function}: {name} must be [P, HV, V, K] with the last three dims contiguous (any slot "
                      f"stride; 16-byte aligned on CUDA), got shape {list(t.shape)}, strides {list(t.stride())}")


# ---- op calls -------------------------------------------------------------------------------------
# out=None: the torch custom ops (torch.compile / CUDA graphs) allocate o. out given: the kernel writes the
# caller's buffer (gdnkit.ops with o=); while torch.compile traces, the custom op's o is copied into it.

def _into(out: Optional[Tensor], custom: Any, direct: Any, args: Tuple[Any, ...], kwargs: dict) -> Tensor:
    if out is None:
        return custom(*args, **kwargs)
    if torch.compiler.is_compiling():
        out.copy_(custom(*args, **kwargs))
        return out
    return direct(out, args, kwargs)


def decode(q: Tensor, k: Tensor, v: Tensor, state: Tensor, idx: Tensor, out: Optional[Tensor] = None,
           **kw: Any) -> Tensor:
    """gdnkit's decode (pool updated in place at idx)."""
    def direct(o: Tensor, a: Tuple[Any, ...], k_: dict) -> Tensor:
        return _ops.decode(a[0], a[1], a[2], a[3], a[4], o=o, error_flag=a[5], **k_)
    return _into(out, torch.ops.gdnkit.decode, direct, (q, k, v, state, idx, None), kw)


def verify(q: Tensor, k: Tensor, v: Tensor, state: Tensor, idx: Tensor, intermediate: Optional[Tensor] = None,
           out: Optional[Tensor] = None, **kw: Any) -> Tensor:
    """gdnkit's verify."""
    def direct(o: Tensor, a: Tuple[Any, ...], k_: dict) -> Tensor:
        return _ops.verify(a[0], a[1], a[2], a[3], a[4], intermediate=a[5], error_flag=a[6], o=o, **k_)
    return _into(out, torch.ops.gdnkit.verify, direct, (q, k, v, state, idx, intermediate, None), kw)


def prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, state: Optional[Tensor],
            out: Optional[Tensor] = None, **kw: Any) -> Tensor:
    """gdnkit's prefill."""
    def direct(o: Tensor, a: Tuple[Any, ...], k_: dict) -> Tensor:
        return _ops.prefill(a[0], a[1], a[2], a[3], state=a[4], checkpoints=a[5], error_flag=a[6], o=o, **k_)
    return _into(out, torch.ops.gdnkit.prefill, direct, (q, k, v, cu_seqlens, state, None, None), kw)


# ---- gates computed with torch --------------------------------------------------------------------

def softplus_gate(a: Tensor, A_log: Tensor, dt_bias: Optional[Tensor], softplus_beta: float = 1.0,
                  softplus_threshold: float = 20.0) -> Tensor:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` in float32, softplus with the given beta and threshold
    (``x`` where ``beta * x > threshold``, else ``log(1 + exp(beta * x)) / beta``)."""
    x = a.float() + (fp32(dt_bias) if dt_bias is not None else 0.0)
    return -torch.exp(fp32(A_log)) * F.softplus(x, beta=float(softplus_beta), threshold=float(softplus_threshold))


def sigmoid_gate(b: Tensor, scale: float = 1.0) -> Tensor:
    """``beta = scale * sigmoid(b)`` in float32."""
    s = torch.sigmoid(b.float())
    return s if scale == 1.0 else s * scale


# ---- index arithmetic on the device --------------------------------------------------------------

def seq_lengths(cu_seqlens: Optional[Tensor], N: int, T: int, device: Device) -> Tensor:
    """``[N]`` int64 sequence lengths (fixed length T without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.full((N,), T, dtype=torch.int64, device=device)
    cu = cu_seqlens.to(torch.int64)
    return cu[1:] - cu[:-1]


def seq_starts(cu_seqlens: Optional[Tensor], N: int, T: int, device: Device) -> Tensor:
    """``[N]`` int64 first token of each sequence."""
    if cu_seqlens is None:
        return torch.arange(N, dtype=torch.int64, device=device) * T
    return cu_seqlens[:-1].to(torch.int64)


def token_positions(cu_seqlens: Tensor, T_total: int) -> Tuple[Tensor, Tensor]:
    """(sequence, position in it) of every token ``[T_total]`` (int64) of a varlen batch."""
    cu = cu_seqlens.to(torch.int64)
    tok = torch.arange(T_total, dtype=torch.int64, device=cu.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    return seq, tok - cu[seq]


def scatter_states(pool: Tensor, slots: Tensor, valid: Tensor, states: Tensor) -> None:
    """``pool[slots[i]] = states[i]`` where ``valid[i]``, without a host synchronization.

    The entries that are not valid are written to slot 0, whose content is saved before and restored
    after, so slot 0 must not be the target of a valid entry (vLLM's null block). ``states``: ``[E, ...]``
    in the pool's dtype and layout, ``slots``/``valid``: ``[E]``."""
    if slots.numel() == 0:
        return
    keep = pool[0].clone()
    target = torch.where(valid, slots.to(torch.int64), torch.zeros((), dtype=torch.int64, device=slots.device))
    pool.index_copy_(0, target, states)
    pool[0].copy_(keep)


def scatter_rows(dst: Tensor, index: Tuple[Tensor, ...], valid: Tensor, values: Tensor) -> None:
    """``dst[index[0][i], index[1][i], ...] = values[i]`` where ``valid[i]``, without a host
    synchronization. Entries that are not valid repeat the first valid entry (same target, same value);
    when none is valid they rewrite ``dst[0, 0, ...]`` with its own value. Any target may be valid."""
    if valid.numel() == 0:
        return
    first = torch.argmax(valid.to(torch.int8))
    any_valid = valid.any()
    zero = torch.zeros((), dtype=torch.int64, device=valid.device)
    idx = []
    for ix in index:
        ix = ix.to(torch.int64)
        ix = torch.where(valid, ix, ix[first])
        idx.append(torch.where(any_valid, ix, zero))
    shape = (-1,) + (1,) * (values.dim() - 1)
    vals = torch.where(valid.view(shape), values, values[first].unsqueeze(0))
    here = dst[tuple(zero for _ in index)].to(values.dtype)
    vals = torch.where(any_valid, vals, here.unsqueeze(0))
    dst.index_put_(tuple(idx), vals.to(dst.dtype))
