"""FLA's gated delta rule entry points, flash-linear-attention 0.6.0 (fla-core 0.6.0), computed by gdnkit.

    # from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from gdnkit.adapters.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

Signatures: every argument of FLA 0.6.0's two functions, positional and keyword, with FLA's defaults. The
options FLA reads from ``**kwargs`` (``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``chunk_size``,
``transpose_state_layout``, ``head_first``) are keyword-only here; any other keyword raises TypeError
naming it (FLA ignores unknown keywords silently).

Results: those of FLA within the tolerances of docs/semantics.md: ``(o, final_state)`` with o
``[B, T, HV, V]`` in q's dtype (a new contiguous tensor) and final_state a new float32 tensor
``[N, HV, K, V]`` (``state_v_first``: ``[N, HV, V, K]``), or None without ``output_final_state``.
``initial_state`` is read, never modified.

Strides: FLA makes every input contiguous (a copy of each strided one). Here q, k, v and the gates are
passed to the kernels as they are when the kernels read them (any token and head stride, last dim
contiguous, ``[B, T]`` with ``stride(0) == T * stride(1)``, 16-byte aligned rows on CUDA), so views of a
fused projection cost nothing; a tensor outside that (a last dim that is not contiguous, e.g. q/k/v split
from a transposed conv output as transformers' Qwen3-Next does for T > 1; a time slice ``x[:, :T]`` of
a longer buffer with B > 1; rows that overlap) is copied, that tensor only (see gdnkit.adapters._common).

State copies: with ``output_final_state``, the final-state tensor is created from ``initial_state``
(float32 copy) and updated in place, except for one token per sequence (decode), where the kernel reads
``initial_state`` and writes the final states straight into the new tensor. An ``initial_state`` of
another dtype than float32 / bfloat16 or with packed dims that are not contiguous is read from a float32
copy.

Mapping: ``chunk_gated_delta_rule`` is gdnkit's chunked prefill. ``fused_recurrent_gated_delta_rule``
runs gdnkit's exact recurrence (verify, a chain) for fixed-length batches of up to 64 tokens per
sequence and the prefill otherwise (``cu_seqlens``, longer sequences). ``use_gate_in_kernel`` with
``use_beta_sigmoid_in_kernel`` is gdnkit's fused gating; the other combinations, and
``allow_neg_eigval`` (``beta = 2 * sigmoid(beta)``), compute the gates with torch before the call.

Not supported (NotImplementedError): autograd, ``gk`` / ``gv`` (per-channel decay), per-channel beta
``[B, T, HV, V]``, ``cp_context`` (context parallel).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .._gdnkit import GdnkitError
from . import _common as C

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gdn", "fused_recurrent_gdn"]

PEER = "flash-linear-attention 0.6.0"

# fixed-length batches up to this many tokens per sequence take the exact recurrence (verify)
_RECURRENT_MAX_T = 64


def _state_v_first(fn: str, state_v_first: bool, transpose_state_layout: Any) -> bool:
    """FLA's deprecated ``transpose_state_layout`` (read when passed at all)."""
    if transpose_state_layout is C.UNSET:
        return bool(state_v_first)
    if state_v_first:
        raise GdnkitError(f"{fn}: Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return bool(transpose_state_layout)


def _gates(fn: str, g: Optional[Tensor], beta: Optional[Tensor], v: Tensor, use_gate_in_kernel: bool,
           A_log: Optional[Tensor], dt_bias: Optional[Tensor], use_beta_sigmoid_in_kernel: bool,
           allow_neg_eigval: bool) -> Dict[str, Tensor]:
    """gdnkit gate arguments for FLA's gate options (views of the caller's tensors where possible)."""
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    if beta is None:
        beta = v.new_ones((B, T, HV), dtype=torch.float32)
    if beta.dim() == v.dim():
        raise C.not_supported(fn, "per-channel beta [B, T, HV, V]", "gdnkit's beta is one scalar per head")
    if use_gate_in_kernel:
        if A_log is None:
            raise GdnkitError(f"{fn}: `A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise GdnkitError(f"{fn}: `g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
        if use_beta_sigmoid_in_kernel and not allow_neg_eigval:
            # g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b): gdnkit's fused gating
            dt = dt_bias if dt_bias is not None else torch.zeros(HV, dtype=torch.float32, device=v.device)
            return dict(a=C.gates(g), b=C.gates(beta), A_log=C.head_param(A_log), dt_bias=C.head_param(dt))
        g = C.softplus_gate(g, C.head_param(A_log), None if dt_bias is None else C.head_param(dt_bias))
    elif g is None:
        g = v.new_zeros((B, T, HV), dtype=torch.float32)
    if use_beta_sigmoid_in_kernel:
        beta = C.sigmoid_gate(beta, 2.0 if allow_neg_eigval else 1.0)
    return dict(g=C.gates(C.fp32(g)), beta=C.gates(beta))


def _check_common(fn: str, q: Tensor, k: Tensor, v: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], allow_neg_eigval: bool, use_beta_sigmoid_in_kernel: bool) -> int:
    """FLA's argument checks (its messages); returns N."""
    C.check_heads(fn, q, k, v)
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise GdnkitError(f"{fn}: The batch size is expected to be 1 rather than {q.shape[0]} when using "
                              "`cu_seqlens`. Please flatten variable-length inputs before processing.")
        N = cu_seqlens.shape[0] - 1
    else:
        N = q.shape[0]
    if initial_state is not None and initial_state.shape[0] != N:
        raise GdnkitError(f"{fn}: The number of initial states is expected to be equal to the number of input "
                          f"sequences, i.e., {N} rather than {initial_state.shape[0]}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise GdnkitError(f"{fn}: `allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    return N


def _final_from(initial_state: Optional[Tensor], shape: Tuple[int, ...], device: C.Device, zero: bool) -> Tensor:
    """The new float32 final-state tensor: a copy of initial_state, or zeros / uninitialized without one."""
    if initial_state is not None:
        return initial_state.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    return (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=device)


def _prefill(q: Tensor, k: Tensor, v: Tensor, gates: Dict[str, Tensor], N: int, scale: Optional[float],
             initial_state: Optional[Tensor], output_final_state: bool, l2norm: bool, state_v_first: bool,
             cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Both FLA functions on gdnkit's prefill: (o, final state or None)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is not None:
        cu = cu_seqlens if cu_seqlens.dtype in (torch.int32, torch.int64) else cu_seqlens.long()
        cu = cu.contiguous()
    else:
        cu = C.fixed_cu_seqlens(B, T, q.device)
    layout = "k_last" if state_v_first else "v_last"
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    idx = C.arange32(N, q.device)
    if output_final_state:
        pool: Optional[Tensor] = _final_from(initial_state, shape, q.device, zero=False)
        init_idx, final_idx = (idx if initial_state is not None else None), idx
    elif initial_state is not None:
        pool, init_idx, final_idx = C.pool_read_only(initial_state), idx, None
    else:
        pool, init_idx, final_idx = None, None, None
    o = C.prefill(C.tokens(q), C.tokens(k), C.tokens(v), cu, pool, initial_indices=init_idx,
                  final_indices=final_idx, layout=layout, scale=scale, use_qk_l2norm=bool(l2norm),
                  cu_seqlens_cpu=cu_seqlens_cpu, **gates)
    return o, (pool if output_final_state else None)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
                           initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None,
                           chunk_indices: Optional[Tensor] = None, cp_context: Optional[Any] = None, *,
                           use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, chunk_size: int = 64,
                           transpose_state_layout: Any = C.UNSET,
                           head_first: Any = C.UNSET) -> Tuple[Tensor, Optional[Tensor]]:
    """FLA 0.6.0's ``chunk_gated_delta_rule`` (forward only), computed by gdnkit's chunked prefill.

    Args:
        q, k: ``[B, T, H, K]``, float32, bfloat16 or float16; any strides (see the module docstring).
        v: ``[B, T, HV, V]``, q's dtype (HV a multiple of H).
        g: ``[B, T, HV]`` log-space decay (with ``use_gate_in_kernel``: the raw projection ``a``).
        beta: ``[B, T, HV]`` (with ``use_beta_sigmoid_in_kernel``: the raw projection ``b``).
        scale: query scale; None: ``1 / sqrt(K)``.
        initial_state: ``[N, HV, K, V]`` (``state_v_first``: ``[N, HV, V, K]``) or None (zeros); read,
            never modified.
        output_final_state: also return the final states.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``: ``beta = 2 * sigmoid(beta)``.
        state_v_first: states are ``[.., HV, V, K]`` (gdnkit's K-last) instead of ``[.., HV, K, V]``.
        cu_seqlens: ``[N+1]`` sequence offsets (int32 or int64) for varlen input with B = 1, or None.
        cu_seqlens_cpu: a host copy of ``cu_seqlens``, or None (validated before launch when given).
        chunk_indices: accepted and not read (gdnkit chunks internally).
        cp_context: not supported (must be None).
        use_gate_in_kernel: ``g = -exp(A_log) * softplus(g + dt_bias)`` (FLA's keyword argument).
        A_log, dt_bias: ``[HV]`` gating parameters for ``use_gate_in_kernel`` (dt_bias None: zeros).
        chunk_size: 16, 32 or 64, checked as FLA does; gdnkit always uses 64 (same results).
        transpose_state_layout: FLA's deprecated name of ``state_v_first`` (warns).
        head_first: removed in FLA; passing it raises DeprecationWarning as FLA does.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state float32 ``[N, HV, K, V]``
        (``state_v_first``: ``[N, HV, V, K]``), or None without ``output_final_state``.

    Raises:
        TypeError: a keyword argument FLA 0.6.0's function does not have.
        NotImplementedError: autograd (an input requires grad), per-channel beta, ``cp_context``.
        gdnkit.GdnkitError: invalid arguments (a ValueError), with FLA's messages where FLA checks them.
    """
    fn = "chunk_gated_delta_rule"
    state_v_first = _state_v_first(fn, state_v_first, transpose_state_layout)
    N = _check_common(fn, q, k, v, initial_state, cu_seqlens, allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if head_first is not C.UNSET:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    if chunk_size not in (16, 32, 64):
        raise GdnkitError(f"{fn}: `chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    if cp_context is not None:
        raise C.not_supported(fn, "cp_context", "context parallel")
    C.require_no_grad(fn, q, k, v, g, beta, initial_state, A_log, dt_bias)
    gates = _gates(fn, g, beta, v, bool(use_gate_in_kernel), A_log, dt_bias, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval)
    return _prefill(q, k, v, gates, N, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    state_v_first, cu_seqlens, cu_seqlens_cpu)


def fused_recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                                     gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                                     beta: Optional[Tensor] = None, scale: Optional[float] = None,
                                     initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                     A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     state_v_first: bool = False, cu_seqlens: Optional[Tensor] = None, *,
                                     transpose_state_layout: Any = C.UNSET) -> Tuple[Tensor, Optional[Tensor]]:
    """FLA 0.6.0's ``fused_recurrent_gated_delta_rule`` (forward only), computed by gdnkit.

    Fixed-length batches of up to 64 tokens per sequence run gdnkit's exact recurrence (verify, a chain);
    ``cu_seqlens`` and longer sequences run its prefill.

    Args:
        q, k: ``[B, T, H, K]``, float32, bfloat16 or float16; any strides (see the module docstring).
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
        A_log, dt_bias: ``[HV]`` gating parameters for ``use_gate_in_kernel`` (dt_bias None: zeros);
            ignored without it, as in FLA.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``: ``beta = 2 * sigmoid(beta)``.
        state_v_first: states are ``[.., HV, V, K]`` (gdnkit's K-last) instead of ``[.., HV, K, V]``.
        cu_seqlens: ``[N+1]`` sequence offsets (int32 or int64) for varlen input with B = 1, or None.
        transpose_state_layout: FLA's deprecated name of ``state_v_first`` (warns).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state float32 in the layout of
        ``initial_state``, or None without ``output_final_state``.

    Raises:
        TypeError: a keyword argument FLA 0.6.0's function does not have.
        NotImplementedError: autograd (an input requires grad), ``gk`` / ``gv``, per-channel beta.
        gdnkit.GdnkitError: invalid arguments (a ValueError), with FLA's messages where FLA checks them.
    """
    fn = "fused_recurrent_gated_delta_rule"
    state_v_first = _state_v_first(fn, state_v_first, transpose_state_layout)
    N = _check_common(fn, q, k, v, initial_state, cu_seqlens, allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if gk is not None or gv is not None:
        raise C.not_supported(fn, "gk / gv", "per-channel decay; gdnkit has one scalar decay per head")
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None
    C.require_no_grad(fn, q, k, v, g, beta, initial_state, A_log, dt_bias)
    gates = _gates(fn, g, beta, v, bool(use_gate_in_kernel), A_log, dt_bias, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is not None or T > _RECURRENT_MAX_T or T == 0:
        return _prefill(q, k, v, gates, N, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        state_v_first, cu_seqlens, None)

    layout = "k_last" if state_v_first else "v_last"
    shape = (B, HV, V, K) if state_v_first else (B, HV, K, V)
    common: Dict[str, Any] = dict(layout=layout, scale=scale, use_qk_l2norm=bool(use_qk_l2norm_in_kernel), **gates)
    q, k, v = C.tokens(q), C.tokens(k), C.tokens(v)
    idx = C.arange32(B, q.device)
    if initial_state is None:
        # S = 0: the final states start as zeros and are updated in place (a scratch pool without them)
        pool = torch.zeros(shape if output_final_state else (1,) + shape[1:], dtype=torch.float32,
                           device=q.device)
        sidx = idx if output_final_state else torch.zeros(B, dtype=torch.int32, device=q.device)
        o = C.verify(q, k, v, pool, sidx, None, update_state=bool(output_final_state), num_draft_tokens=T,
                     **common)
        return o, (pool if output_final_state else None)
    if not output_final_state:
        # the caller's states are only read
        o = C.verify(q, k, v, C.pool_read_only(initial_state), idx, None, update_state=False, num_draft_tokens=T,
                     **common)
        return o, None
    if T == 1:
        # decode: read initial_state, write the final states straight into the new tensor (a 1-step cache)
        final = torch.empty(shape, dtype=torch.float32, device=q.device)
        o = C.verify(q, k, v, C.pool_read_only(initial_state), idx, final.unsqueeze(1), intermediate_indices=idx,
                     update_state=False, num_draft_tokens=1, **common)
        return o, final
    final = _final_from(initial_state, shape, q.device, zero=True)
    o = C.verify(q, k, v, final, idx, None, update_state=True, num_draft_tokens=T, **common)
    return o, final


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
