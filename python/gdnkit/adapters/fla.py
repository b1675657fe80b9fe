"""FLA's gated delta rule entry points (flash-linear-attention 0.6 signatures), computed by gdnkit.

    # from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from gdnkit.adapters.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

Same arguments, same results within the tolerances of docs/semantics.md: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``,
g, beta ``[B, T, HV]``; with ``cu_seqlens`` (int32 or int64) B must be 1. ``initial_state`` and the
returned final state are ``[N, HV, K, V]`` (``state_v_first=True``: ``[N, HV, V, K]``); the final state
is float32 as in FLA, and ``initial_state`` is never modified.

Mapping: ``chunk_gated_delta_rule`` is gdnkit's chunked prefill. ``fused_recurrent_gated_delta_rule``
runs gdnkit's decode for one token per sequence, the verify recurrence (chain, state updated) for
fixed-length batches of up to 64 tokens, and the prefill otherwise. ``use_gate_in_kernel`` with
``use_beta_sigmoid_in_kernel`` is gdnkit's fused gating (``g`` is then the raw ``a`` projection and
``beta`` the raw ``b``); the other combinations compute the gates with torch before the call.

Not supported (NotImplementedError): autograd, ``gk`` / ``gv`` (per-channel decay), ``allow_neg_eigval``
(beta outside [0, 1]), head-wise beta ``[B, T, HV, V]``, ``cp_context`` (context parallel).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._gdnkit import GdnkitError
from ._common import (Device, arange32, check_heads, fixed_cu_seqlens, fp32, gate_dtype, not_supported,
                      require_no_grad, state_dtype)

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gdn", "fused_recurrent_gdn"]

# fixed-length batches up to this many tokens per sequence take the exact recurrence (verify)
_RECURRENT_MAX_T = 64


def _gates(fn: str, g: Optional[Tensor], beta: Optional[Tensor], v: Tensor, use_gate_in_kernel: bool,
           A_log: Optional[Tensor], dt_bias: Optional[Tensor], use_beta_sigmoid_in_kernel: bool) -> Dict[str, Tensor]:
    """gdnkit gate arguments for FLA's gate options."""
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    if beta is None:
        beta = v.new_ones((B, T, HV), dtype=torch.float32)
    if beta.dim() == v.dim():
        raise not_supported(fn, "head-wise beta [B, T, HV, V]")
    if use_gate_in_kernel:
        if A_log is None:
            raise GdnkitError(f"{fn}: A_log must be provided when use_gate_in_kernel=True")
        if g is None:
            raise GdnkitError(f"{fn}: g (raw pre-activation) must be provided when use_gate_in_kernel=True")
        dt = fp32(dt_bias) if dt_bias is not None else torch.zeros(HV, dtype=torch.float32, device=v.device)
        if use_beta_sigmoid_in_kernel:
            # g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b): gdnkit's fused gating
            return dict(a=gate_dtype(g), b=gate_dtype(beta), A_log=fp32(A_log).contiguous(), dt_bias=dt.contiguous())
        g_log = -torch.exp(fp32(A_log)) * F.softplus(g.float() + dt, beta=1.0, threshold=20.0)
        return dict(g=g_log, beta=gate_dtype(beta))
    if g is None:
        g = v.new_zeros((B, T, HV), dtype=torch.float32)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float())
    return dict(g=fp32(g), beta=gate_dtype(beta))


def _state(initial_state: Optional[Tensor], output_final_state: bool, scratch: bool, N: int, HV: int, K: int,
           V: int, state_v_first: bool, device: Device) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(pool, initial_indices, final_indices). The pool is a fp32 copy when the op writes it, so the
    caller's initial_state is never modified. scratch: the op always writes its pool (decode)."""
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    idx = arange32(N, device)
    if output_final_state or scratch:
        if initial_state is None:
            pool = torch.zeros(shape, dtype=torch.float32, device=device)
        else:
            pool = initial_state.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        return pool, (idx if initial_state is not None else None), idx
    if initial_state is None:
        return None, None, None
    return state_dtype(initial_state).contiguous(), idx, None


def _kwargs(fn: str, kwargs: Dict[str, Any], state_v_first: bool) -> bool:
    """FLA's renamed and removed keyword arguments; returns state_v_first."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise GdnkitError(f"{fn}: cannot pass both `state_v_first` and the deprecated `transpose_state_layout`")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    if "head_first" in kwargs:
        raise GdnkitError(f"{fn}: head_first has been removed; inputs must be in [B, T, H, ...] format")
    return state_v_first


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
                           initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None,
                           chunk_indices: Optional[Tensor] = None, cp_context: Optional[Any] = None,
                           **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """FLA's ``chunk_gated_delta_rule`` (forward only), computed by gdnkit's chunked prefill.

    Args:
        q, k: ``[B, T, H, K]``, float32, bfloat16 or float16.
        v: ``[B, T, HV, V]``, q's dtype (HV a multiple of H).
        g: ``[B, T, HV]`` log-space decay (with ``use_gate_in_kernel``: the raw projection ``a``).
        beta: ``[B, T, HV]`` (with ``use_beta_sigmoid_in_kernel``: the raw projection ``b``).
        scale: query scale; None: ``1 / sqrt(K)``.
        initial_state: ``[N, HV, K, V]`` (``state_v_first``: ``[N, HV, V, K]``) or None (zeros); read,
            never modified.
        output_final_state: also return the final states.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: not supported (must be False).
        state_v_first: states are ``[.., HV, V, K]`` (gdnkit's K-last) instead of ``[.., HV, K, V]``.
        cu_seqlens: ``[N+1]`` sequence offsets (int32 or int64) for varlen input with B = 1, or None.
        cu_seqlens_cpu: a host copy of ``cu_seqlens``, or None.
        chunk_indices: accepted and ignored (gdnkit chunks internally).
        cp_context: not supported (must be None).
        **kwargs: ``use_gate_in_kernel`` with ``A_log``, ``dt_bias`` ``[HV]`` (gating in the kernel:
            ``g = -exp(A_log) * softplus(g + dt_bias)``); ``chunk_size`` (16, 32 or 64; gdnkit always uses
            64); the deprecated ``transpose_state_layout``.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state float32 in the layout of
        ``initial_state`` (``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``state_v_first``), or None
        without ``output_final_state``.

    Raises:
        NotImplementedError: autograd (an input requires grad), ``allow_neg_eigval``, head-wise beta,
            ``cp_context``.
        gdnkit.GdnkitError: invalid arguments (a ValueError), with FLA's messages where FLA checks them.
    """
    fn = "chunk_gated_delta_rule"
    state_v_first = _kwargs(fn, kwargs, state_v_first)
    if cp_context is not None:
        raise not_supported(fn, "cp_context", "context parallel")
    if allow_neg_eigval:
        raise not_supported(fn, "allow_neg_eigval", "beta must stay in [0, 1]")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise GdnkitError(f"{fn}: `chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}")
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    require_no_grad(fn, q, k, v, g, beta, initial_state, A_log, dt_bias)
    check_heads(fn, q, k, v)
    return _prefill(fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    bool(kwargs.get("use_gate_in_kernel", False)), A_log, dt_bias, use_beta_sigmoid_in_kernel,
                    state_v_first, cu_seqlens, cu_seqlens_cpu)


def _prefill(fn: str, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor],
             scale: Optional[float], initial_state: Optional[Tensor], output_final_state: bool, l2norm: bool,
             use_gate_in_kernel: bool, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
             use_beta_sigmoid_in_kernel: bool, state_v_first: bool, cu_seqlens: Optional[Tensor],
             cu_seqlens_cpu: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Both FLA functions on gdnkit's prefill: (o, final state or None)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is not None:
        if B != 1:
            raise GdnkitError(f"{fn}: the batch size is expected to be 1 rather than {B} when using `cu_seqlens`; "
                              "flatten variable-length inputs first")
        N = cu_seqlens.shape[0] - 1
        cu = cu_seqlens if cu_seqlens.dtype in (torch.int32, torch.int64) else cu_seqlens.long()
    else:
        N = B
        cu = fixed_cu_seqlens(B, T, q.device)
    if initial_state is not None and initial_state.shape[0] != N:
        raise GdnkitError(f"{fn}: the number of initial states is expected to be equal to the number of input "
                          f"sequences, i.e., {N} rather than {initial_state.shape[0]}")
    gates = _gates(fn, g, beta, v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    pool, init_idx, final_idx = _state(initial_state, output_final_state, False, N, HV, K, V, state_v_first,
                                       q.device)
    o = torch.ops.gdnkit.prefill(q, k, v, cu, pool, None, None, initial_indices=init_idx, final_indices=final_idx,
                                 layout="k_last" if state_v_first else "v_last", scale=scale,
                                 use_qk_l2norm=bool(l2norm),
                                 cu_seqlens_cpu=cu_seqlens_cpu, **gates)
    return o, (pool if output_final_state else None)


def fused_recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                                     gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                                     beta: Optional[Tensor] = None, scale: Optional[float] = None,
                                     initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                     A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     state_v_first: bool = False, cu_seqlens: Optional[Tensor] = None,
                                     **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """FLA's ``fused_recurrent_gated_delta_rule`` (forward only), computed by gdnkit.

    One token per sequence runs gdnkit's decode, fixed-length batches of up to 64 tokens its verify
    recurrence (a chain, state updated), anything else (``cu_seqlens``, longer sequences) its prefill.

    Args:
        q, k: ``[B, T, H, K]``, float32, bfloat16 or float16.
        v: ``[B, T, HV, V]``, q's dtype (HV a multiple of H).
        g: ``[B, T, HV]`` log-space decay (with ``use_gate_in_kernel``: the raw projection ``a``), or
            None (no decay).
        gk, gv: not supported (must be None).
        beta: ``[B, T, HV]`` (with ``use_beta_sigmoid_in_kernel``: the raw projection ``b``), or None
            (ones).
        scale: query scale; None: ``1 / sqrt(K)``.
        initial_state: ``[N, HV, K, V]`` (``state_v_first``: ``[N, HV, V, K]``) or None (zeros); read,
            never modified.
        output_final_state: also return the final states.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head.
        use_gate_in_kernel: ``g = -exp(A_log) * softplus(g + dt_bias)`` computed in the kernel.
        A_log, dt_bias: ``[HV]`` gating parameters for ``use_gate_in_kernel`` (dt_bias None: zeros).
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: not supported (must be False).
        state_v_first: states are ``[.., HV, V, K]`` (gdnkit's K-last) instead of ``[.., HV, K, V]``.
        cu_seqlens: ``[N+1]`` sequence offsets (int32 or int64) for varlen input with B = 1, or None.
        **kwargs: the deprecated ``transpose_state_layout``.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state float32 in the layout of
        ``initial_state``, or None without ``output_final_state``.

    Raises:
        NotImplementedError: autograd (an input requires grad), ``gk`` / ``gv``, ``allow_neg_eigval``,
            head-wise beta.
        gdnkit.GdnkitError: invalid arguments (a ValueError), with FLA's messages where FLA checks them.
    """
    fn = "fused_recurrent_gated_delta_rule"
    state_v_first = _kwargs(fn, kwargs, state_v_first)
    if gk is not None or gv is not None:
        raise not_supported(fn, "gk / gv", "per-channel decay; gdnkit has one scalar decay per head")
    if allow_neg_eigval:
        raise not_supported(fn, "allow_neg_eigval", "beta must stay in [0, 1]")
    require_no_grad(fn, q, k, v, g, beta, initial_state, A_log, dt_bias)
    check_heads(fn, q, k, v)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is not None or T > _RECURRENT_MAX_T:
        return _prefill(fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, state_v_first, cu_seqlens,
                        None)
    if initial_state is not None and initial_state.shape[0] != B:
        raise GdnkitError(f"{fn}: the number of initial states is expected to be {B} rather than "
                          f"{initial_state.shape[0]}")
    gates = _gates(fn, g, beta, v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    pool, _, idx = _state(initial_state, output_final_state, True, B, HV, K, V, state_v_first, q.device)
    layout = "k_last" if state_v_first else "v_last"
    if T == 1:
        o = torch.ops.gdnkit.decode(q, k, v, pool, idx, None, layout=layout, scale=scale,
                                    use_qk_l2norm=bool(use_qk_l2norm_in_kernel), **gates)
    else:
        o = torch.ops.gdnkit.verify(q, k, v, pool, idx, None, None, layout=layout, scale=scale,
                                    use_qk_l2norm=bool(use_qk_l2norm_in_kernel), update_state=True, **gates)
    return o, (pool if output_final_state else None)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
