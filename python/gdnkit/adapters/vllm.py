"""vLLM's FLA-derived GDN ops (vLLM 0.33.0), computed by gdnkit.

    # from vllm.third_party.flash_linear_attention.ops import (  # older releases: vllm.model_executor.layers.fla.ops
    #     chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
    #     fused_recurrent_gated_delta_rule_packed_decode, fused_sigmoid_gating_delta_rule_update)
    from gdnkit.adapters.vllm import (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                                      fused_recurrent_gated_delta_rule_packed_decode,
                                      fused_sigmoid_gating_delta_rule_update)

Signatures: every argument of vLLM 0.33.0's functions, with its defaults; an unknown keyword raises
TypeError naming it. States are K-last ``[.., HV, V, K]`` as in vLLM (gdnkit's ``k_last``).

The recurrent functions (``fused_recurrent_gated_delta_rule``, ``fused_sigmoid_gating_delta_rule_update``)
follow vLLM's kernel:

- With ``ssm_state_indices`` (continuous batching), sequence n starts from the pool slot
  ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (spec decode; without ``num_accepted_tokens``:
  ``[n, 0]``); a slot <= 0 (vLLM's null block) skips the sequence: no state is read or written, and its
  outputs are 0 (vLLM leaves them unwritten). With ``inplace_final_state`` the state after token t of
  sequence n is stored in the pool at ``ssm_state_indices[n, t]`` when that slot is > 0. 1-D indices serve
  one token per sequence and are read as vLLM reads them (start slot: entry ``n + num_accepted_tokens[n] - 1``);
  1-D indices with several tokens in a sequence are an error (vLLM's kernel would read and write the
  entries of the next sequences).
- Without ``ssm_state_indices``, sequence n starts from ``initial_state[bos_n]`` (bos_n its first token,
  vLLM's indexing), and ``inplace_final_state`` needs the indices (vLLM's kernel reads them).
- ``inplace_final_state=False``: the state after every token is returned in a new ``[T, HV, V, K]`` tensor
  of the pool's dtype, row ``bos_n + t`` (B must be 1: vLLM's buffer has T rows).
- Returns ``(o, final_state)``: o a new ``[B, T, HV, V]`` tensor of q's dtype; final_state the
  ``initial_state`` object itself (in place) or the new per-token tensor.

Mapping: one token per sequence read and written at the same slot (decode without spec) is gdnkit's decode,
updating the pool in place with no copy (with ``cu_seqlens``, a batch of N sequences holding N tokens is
taken to be N sequences of one token, as vLLM passes for decode; the values of cu_seqlens are not read
then). Spec decode (``num_accepted_tokens``, 2-D indices with several
tokens) is gdnkit's verify from the read slot, keeping the state after every token in a scratch cache
``[N, T, HV, V, K]`` (the pool's dtype), then copied to the pool slots ``ssm_state_indices[n, t]``: one
extra write and read of those states, and the scratch memory, compared with vLLM's kernel, because the
slots of one sequence's tokens are arbitrary pool rows. ``chunk_gated_delta_rule`` is gdnkit's prefill
(``core_attn_out``: written in place by the kernel; with ``output_final_state`` the new final-state tensor
starts as a float32 copy of ``initial_state`` and is updated in place, ``initial_state`` is not modified).

Strides: vLLM makes q, k, v, g, beta contiguous (a copy of each strided one); here they are passed as they
are whenever the kernels read them (any token and head stride, last dim contiguous, ``[B, T]`` with
``stride(0) == T * stride(1)``, 16-byte aligned rows on CUDA), else that tensor is copied. The packed
decode reads q, k, v as views of ``mixed_qkv`` with no copy. Pools are never copied when they are written
(a float16 pool is NotImplementedError).

Host synchronization: only ``inplace_final_state=False`` with ``cu_seqlens`` and without 2-D indices
reads the longest sequence length on the host (vLLM's models do not use that mode).

Not supported (NotImplementedError): ``is_kda``, per-channel beta ``[B, T, HV, V]``, autograd.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .._gdnkit import GdnkitError
from . import _common as C

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_gated_delta_rule_packed_decode", "fused_sigmoid_gating_delta_rule_update"]

PEER = "vLLM 0.33.0"


# ---- chunk ----------------------------------------------------------------------------------------

@torch.compiler.disable
def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
                           initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                           cu_seqlens: Optional[Tensor] = None, chunk_indices: Optional[Tensor] = None,
                           chunk_offsets: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                           core_attn_out: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """vLLM 0.33.0's ``chunk_gated_delta_rule`` (forward only), computed by gdnkit's chunked prefill.

    Args:
        q, k: ``[B, T, H, K]`` float32, bfloat16 or float16 (vLLM refuses float32; gdnkit computes it).
        v: ``[B, T, HV, V]``, q's dtype.
        g: ``[B, T, HV]`` log-space decay; beta: ``[B, T, HV]``.
        scale: query scale; None: ``1 / sqrt(K)``.
        initial_state: ``[N, HV, V, K]`` or None (zeros); read, never modified.
        output_final_state: also return the final states (a new float32 ``[N, HV, V, K]``).
        cu_seqlens: ``[N+1]`` offsets (int32 or int64) with B = 1, or None.
        chunk_indices, chunk_offsets: accepted and not read (gdnkit chunks internally).
        use_qk_l2norm_in_kernel: L2-normalize q and k per head.
        core_attn_out: a buffer whose first ``v.numel()`` elements receive o (q's dtype), or None.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` (a view of ``core_attn_out`` when given);
        final_state float32 ``[N, HV, V, K]`` or None.
    """
    fn = "chunk_gated_delta_rule"
    C.check_heads(fn, q, k, v)
    if not (q.dtype == k.dtype == v.dtype):
        raise GdnkitError(f"{fn}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if beta.dim() != 3:
        raise GdnkitError(f"{fn}: beta must be of shape [B, T, H].")
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is not None:
        if B != 1:
            raise GdnkitError(f"{fn}: The batch size is expected to be 1 rather than {B} when using `cu_seqlens`."
                              "Please flatten variable-length inputs before processing.")
        N = cu_seqlens.shape[0] - 1
        if initial_state is not None and initial_state.shape[0] != N:
            raise GdnkitError(f"{fn}: The number of initial states is expected to be equal to the number of input "
                              f"sequences, i.e., {N} rather than {initial_state.shape[0]}.")
        cu = (cu_seqlens if cu_seqlens.dtype in (torch.int32, torch.int64) else cu_seqlens.long()).contiguous()
    else:
        N = B
        if initial_state is not None and initial_state.shape[0] != N:
            raise GdnkitError(f"{fn}: expected {N} initial states, got {initial_state.shape[0]}")
        cu = C.fixed_cu_seqlens(B, T, q.device)
    C.require_no_grad(fn, q, k, v, g, beta, initial_state)
    out = None
    if core_attn_out is not None:
        if core_attn_out.numel() < v.numel():
            raise GdnkitError(f"{fn}: core_attn_out too small: {core_attn_out.numel()} < {v.numel()}")
        if core_attn_out.dtype != q.dtype:
            raise GdnkitError(f"{fn}: Incompatible dtype for inplace computation: core_attn_out is "
                              f"{core_attn_out.dtype}, q is {q.dtype}")
        out = core_attn_out[: v.numel()].view(*v.shape)
    idx = C.arange32(N, q.device)
    if output_final_state:
        if initial_state is not None:
            pool: Optional[Tensor] = initial_state.to(dtype=torch.float32, memory_format=torch.contiguous_format,
                                                      copy=True)
            init_idx: Optional[Tensor] = idx
        else:
            pool, init_idx = torch.empty((N, HV, V, K), dtype=torch.float32, device=q.device), None
        final_idx: Optional[Tensor] = idx
    elif initial_state is not None:
        pool, init_idx, final_idx = C.pool_read_only(initial_state), idx, None
    else:
        pool, init_idx, final_idx = None, None, None
    o = C.prefill(C.tokens(q), C.tokens(k), C.tokens(v), cu, pool, out=out, initial_indices=init_idx,
                  final_indices=final_idx, layout="k_last", scale=scale, use_qk_l2norm=bool(use_qk_l2norm_in_kernel),
                  g=C.gates(C.fp32(g)), beta=C.gates(beta))
    return o, (pool if output_final_state else None)


# ---- recurrent ------------------------------------------------------------------------------------

def _slot_table(idx: Tensor, N: int, width: int) -> Tensor:
    """``R[n, j]`` for ``j < width`` (int64 ``[N, width]``) as vLLM's kernel reads ``ssm_state_indices``:
    ``idx[n, j]`` of 2-D indices, entry ``n + j`` of 1-D ones; -1 where that is outside the tensor."""
    dev = idx.device
    if idx.dim() == 2:
        table = torch.full((N, width), -1, dtype=torch.int64, device=dev)
        w = min(width, idx.shape[1])
        if w > 0:
            table[:, :w] = idx[:N, :w].to(torch.int64)
        return table
    flat = idx.reshape(-1).to(torch.int64)
    if flat.shape[0] == 0:
        return torch.full((N, width), -1, dtype=torch.int64, device=dev)
    pos = torch.arange(N, dtype=torch.int64, device=dev)[:, None] + torch.arange(width, device=dev)[None, :]
    return torch.where(pos < flat.shape[0], flat[pos.clamp(max=flat.shape[0] - 1)], -1)


def _recurrent(fn: str, q: Tensor, k: Tensor, v: Tensor, gates: Dict[str, Tensor], scale: Optional[float],
               initial_state: Optional[Tensor], inplace_final_state: bool, cu_seqlens: Optional[Tensor],
               ssm_state_indices: Optional[Tensor], num_accepted_tokens: Optional[Tensor],
               use_qk_l2norm_in_kernel: bool) -> Tuple[Tensor, Tensor]:
    """vLLM's recurrent kernel semantics (see the module docstring) on gdnkit's decode / verify."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if initial_state is None:
        raise GdnkitError(f"{fn}: initial_state is required (vLLM's kernel reads it and the pool's strides)")
    if cu_seqlens is not None and B != 1:
        raise GdnkitError(f"{fn}: The batch size is expected to be 1 rather than {B} when using `cu_seqlens`."
                          "Please flatten variable-length inputs before processing.")
    if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (HV, V, K):
        raise GdnkitError(f"{fn}: initial_state: expected [P, HV, V, K] = [P, {HV}, {V}, {K}], "
                          f"got {list(initial_state.shape)}")
    if inplace_final_state and ssm_state_indices is None:
        raise GdnkitError(f"{fn}: inplace_final_state=True needs ssm_state_indices (vLLM's kernel stores the "
                          "states at the slots they name)")
    if not inplace_final_state and cu_seqlens is None and B != 1:
        raise GdnkitError(f"{fn}: inplace_final_state=False with B={B}: vLLM's kernel writes B*T states into a "
                          "[T, HV, V, K] buffer; flatten to B = 1 with cu_seqlens")
    dev = q.device
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    T_total = B * T
    P = initial_state.shape[0]
    common: Dict[str, Any] = dict(layout="k_last", scale=scale, use_qk_l2norm=bool(use_qk_l2norm_in_kernel), **gates)
    if T_total == 0:
        o = v.new_empty(v.shape, dtype=q.dtype)
        return o, (initial_state if inplace_final_state else initial_state.new_empty((T, HV, V, K)))
    q, k, v = C.tokens(q), C.tokens(k), C.tokens(v)
    one_token_each = (cu_seqlens is None and T == 1) or (cu_seqlens is not None and T_total == N)
    idx = ssm_state_indices

    # decode: one token per sequence, read and written at the same slot
    if inplace_final_state and num_accepted_tokens is None and one_token_each and idx is not None:
        pool = C.pool_in_place(fn, "initial_state", initial_state)
        first = idx[:N, 0] if idx.dim() == 2 else idx.reshape(-1)[:N]
        slots = C.int32(torch.where(first > 0, first, -1))
        return C.decode(q, k, v, pool, slots, **common), initial_state

    if idx is not None and idx.dim() != 2 and not one_token_each:
        raise GdnkitError(f"{fn}: 1-D ssm_state_indices serve one token per sequence (vLLM's kernel would read "
                          "token t of sequence n at entry n + t, another sequence's slot); pass [N, T] indices "
                          "for several tokens per sequence")

    # how many tokens a sequence may hold (the scratch cache's steps)
    if cu_seqlens is None:
        steps = T
    elif idx is not None and idx.dim() == 2:
        steps = idx.shape[1]
    elif one_token_each:
        steps = 1
    else:  # inplace_final_state=False, varlen, no 2-D indices
        lens = C.seq_lengths(cu_seqlens, N, T, dev)
        steps = int(lens.max()) if N > 0 else 1  # host synchronization (documented)
    steps = max(steps, 1)

    # the slot each sequence starts from
    if idx is not None:
        table: Optional[Tensor] = _slot_table(idx, N, steps)
        col = (num_accepted_tokens[:N].to(torch.int64) - 1 if num_accepted_tokens is not None
               else torch.zeros(N, dtype=torch.int64, device=dev))
        read = _entry(idx, N, col)
        read = torch.where(read > 0, read, -1)
    else:
        table = None
        read = C.seq_starts(cu_seqlens, N, T, dev)
    read32 = C.int32(read)
    cu = C.int32(cu_seqlens) if cu_seqlens is not None else None

    if not inplace_final_state:
        pool = C.pool_read_only(initial_state)
        rows = q.shape[1]
        final = torch.empty((rows, HV, V, K), dtype=pool.dtype, device=dev)
        if cu_seqlens is None:  # B == 1: the scratch cache is the result
            o = C.verify(q, k, v, pool, read32, final.unsqueeze(0), intermediate_indices=C.arange32(1, dev),
                         num_draft_tokens=T, **common)
            return o, final
        scratch = torch.empty((N, steps, HV, V, K), dtype=pool.dtype, device=dev)
        o = C.verify(q, k, v, pool, read32, scratch, cu_seqlens=cu, intermediate_indices=C.arange32(N, dev),
                     num_draft_tokens=steps, **common)
        seq, pos = C.token_positions(cu_seqlens, T_total)
        final[:T_total] = scratch.reshape(N * steps, HV, V, K).index_select(0, seq * steps + pos.clamp(max=steps - 1))
        return o, final

    pool = C.pool_in_place(fn, "initial_state", initial_state)
    scratch = torch.empty((N, steps, HV, V, K), dtype=pool.dtype, device=dev)
    o = C.verify(q, k, v, pool, read32, scratch, cu_seqlens=cu, intermediate_indices=C.arange32(N, dev),
                 num_draft_tokens=steps, **common)
    assert table is not None
    lens = C.seq_lengths(cu_seqlens, N, T, dev)
    t = torch.arange(steps, device=dev)[None, :]
    valid = (t < lens[:, None]) & (table > 0) & (table < P) & (read[:, None] >= 0) & (read[:, None] < P)
    C.scatter_states(pool, table.reshape(-1), valid.reshape(-1), scratch.reshape(N * steps, HV, V, K))
    return o, initial_state


def _entry(idx: Tensor, N: int, col: Tensor) -> Tensor:
    """``R[n, col[n]]`` (int64 ``[N]``) as vLLM's kernel reads it: ``idx[n, col]`` of 2-D indices, entry
    ``n + col`` of 1-D ones; -1 where that is outside the tensor (vLLM would read past it)."""
    dev = idx.device
    if idx.dim() == 2:
        S = idx.shape[1]
        inside = (col >= 0) & (col < S)
        if S == 0:
            return torch.full((N,), -1, dtype=torch.int64, device=dev)
        got = idx[:N].to(torch.int64).gather(1, col.clamp(0, S - 1)[:, None])[:, 0]
        return torch.where(inside, got, -1)
    flat = idx.reshape(-1).to(torch.int64)
    pos = torch.arange(N, device=dev) + col
    if flat.shape[0] == 0:
        return torch.full((N,), -1, dtype=torch.int64, device=dev)
    inside = (pos >= 0) & (pos < flat.shape[0])
    return torch.where(inside, flat[pos.clamp(0, flat.shape[0] - 1)], -1)


def fused_recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Optional[Tensor] = None,
                                     scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                                     inplace_final_state: bool = True, cu_seqlens: Optional[Tensor] = None,
                                     ssm_state_indices: Optional[Tensor] = None,
                                     num_accepted_tokens: Optional[Tensor] = None,
                                     use_qk_l2norm_in_kernel: bool = False) -> Tuple[Tensor, Tensor]:
    """vLLM 0.33.0's ``fused_recurrent_gated_delta_rule``, computed by gdnkit's decode / verify.

    Args:
        q, k: ``[B, T, H, K]`` (B = 1 with ``cu_seqlens``); v: ``[B, T, HV, V]``; one dtype of float32,
            bfloat16, float16.
        g: ``[B, T, HV]`` log-space decay; beta: ``[B, T, HV]`` or None (ones).
        scale: query scale (> 0); None: ``1 / sqrt(K)``.
        initial_state: the pool ``[P, HV, V, K]`` (float32 or bfloat16, any slot stride); required.
        inplace_final_state: store the state after every token in the pool (see the module docstring).
        cu_seqlens: ``[N+1]`` offsets (int32 or int64) or None (B sequences of T tokens).
        ssm_state_indices: ``[N]`` or ``[N, T]`` pool slots (<= 0: null block), or None.
        num_accepted_tokens: ``[N]`` accepted draft tokens of the previous step (spec decode), or None.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state ``initial_state`` itself
        (``inplace_final_state``) or a new ``[T, HV, V, K]`` tensor of the state after every token.
    """
    fn = "fused_recurrent_gated_delta_rule"
    C.check_heads(fn, q, k, v)
    if scale is not None and not scale > 0:
        raise GdnkitError(f"{fn}: scale must be positive")
    C.require_no_grad(fn, q, k, v, g, beta)
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    if beta is None:
        beta = v.new_ones((B, T, HV), dtype=torch.float32)
    if beta.dim() == v.dim():
        raise C.not_supported(fn, "per-channel beta [B, T, HV, V]", "gdnkit's beta is one scalar per head")
    gates = dict(g=C.gates(C.fp32(g)), beta=C.gates(beta))
    return _recurrent(fn, q, k, v, gates, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                      num_accepted_tokens, use_qk_l2norm_in_kernel)


def fused_sigmoid_gating_delta_rule_update(A_log: Tensor, a: Tensor, b: Tensor, dt_bias: Tensor, q: Tensor, k: Tensor,
                                           v: Tensor, beta: float = 1.0, threshold: float = 20.0,
                                           scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                                           inplace_final_state: bool = True, cu_seqlens: Optional[Tensor] = None,
                                           ssm_state_indices: Optional[Tensor] = None,
                                           num_accepted_tokens: Optional[Tensor] = None,
                                           use_qk_l2norm_in_kernel: bool = False,
                                           is_kda: bool = False) -> Tuple[Tensor, Tensor]:
    """vLLM 0.33.0's ``fused_sigmoid_gating_delta_rule_update``: the recurrent function with the gates
    ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus with ``beta`` and ``threshold``) and
    ``beta = sigmoid(b)`` computed from the raw projections (gdnkit's fused gating for beta 1 and threshold
    20, torch before the call otherwise).

    Args:
        A_log, dt_bias: ``[HV]``; a, b: ``[B*T, HV]`` or ``[B, T, HV]`` (any strides).
        q, k, v, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
            num_accepted_tokens, use_qk_l2norm_in_kernel: as in :func:`fused_recurrent_gated_delta_rule`.
        beta, threshold: the softplus parameters.
        is_kda: not supported (must be False).

    Returns:
        ``(o, final_state)`` as :func:`fused_recurrent_gated_delta_rule`.
    """
    fn = "fused_sigmoid_gating_delta_rule_update"
    if is_kda:
        raise C.not_supported(fn, "is_kda", "per-channel (KDA) gating")
    C.check_heads(fn, q, k, v)
    if scale is not None and not scale > 0:
        raise GdnkitError(f"{fn}: scale must be positive")
    C.require_no_grad(fn, q, k, v, a, b, A_log, dt_bias)
    T_total, HV = q.shape[0] * q.shape[1], v.shape[2]
    a, b = C.token_gates(a, T_total, HV), C.token_gates(b, T_total, HV)
    if float(beta) == 1.0 and float(threshold) == 20.0:
        gates = dict(a=a, b=b, A_log=C.head_param(A_log), dt_bias=C.head_param(dt_bias))
    else:
        gates = dict(g=C.softplus_gate(a, C.head_param(A_log), C.head_param(dt_bias), beta, threshold),
                     beta=C.sigmoid_gate(b))
    return _recurrent(fn, q, k, v, gates, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                      num_accepted_tokens, use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                                                   dt_bias: Tensor, scale: float, initial_state: Tensor, out: Tensor,
                                                   ssm_state_indices: Tensor,
                                                   use_qk_l2norm_in_kernel: bool = False) -> Tuple[Tensor, Tensor]:
    """vLLM 0.33.0's packed decode: q, k, v read as views of ``mixed_qkv`` ``[B, 2*H*K + HV*V]`` (no copy),
    fused gating, one token per sequence at ``ssm_state_indices[b]`` (<= 0: output 0, no state I/O), o
    written into ``out`` ``[B, 1, HV, V]`` by the kernel. Returns ``(out, initial_state)``.
    """
    fn = "fused_recurrent_gated_delta_rule_packed_decode"
    if mixed_qkv.dim() != 2:
        raise GdnkitError(f"{fn}: `mixed_qkv` must be a 2D tensor (got ndim={mixed_qkv.dim()}).")
    if mixed_qkv.stride(-1) != 1:
        raise GdnkitError(f"{fn}: `mixed_qkv` must be contiguous in the last dim.")
    if a.dim() != 2 or b.dim() != 2:
        raise GdnkitError(f"{fn}: `a` and `b` must be 2D tensors (got a.ndim={a.dim()}, b.ndim={b.dim()}).")
    if A_log.dim() != 1 or dt_bias.dim() != 1:
        raise GdnkitError(f"{fn}: `A_log`/`dt_bias` must be 1D tensors.")
    if ssm_state_indices.dim() != 1:
        raise GdnkitError(f"{fn}: `ssm_state_indices` must be 1D for packed decode "
                          f"(got ndim={ssm_state_indices.dim()}).")
    if not out.is_contiguous():
        raise GdnkitError(f"{fn}: `out` must be contiguous.")
    if initial_state.dim() != 4:
        raise GdnkitError(f"{fn}: `initial_state` must be a 4D tensor (got ndim={initial_state.dim()}).")
    B = mixed_qkv.shape[0]
    if a.shape[0] != B or b.shape[0] != B or ssm_state_indices.shape[0] != B:
        raise GdnkitError(f"{fn}: mismatched batch sizes: mixed_qkv {B}, a {a.shape[0]}, b {b.shape[0]}, "
                          f"ssm_state_indices {ssm_state_indices.shape[0]}")
    HV, V, K = initial_state.shape[-3:]
    if a.shape[1] != HV or b.shape[1] != HV or A_log.numel() != HV or dt_bias.numel() != HV:
        raise GdnkitError(f"{fn}: `a`/`b` must be [B, HV] and `A_log`/`dt_bias` [HV] with HV={HV}")
    if tuple(out.shape) != (B, 1, HV, V):
        raise GdnkitError(f"{fn}: `out` must have shape {(B, 1, HV, V)} (got out.shape={tuple(out.shape)}).")
    qk_dim = mixed_qkv.shape[1] - HV * V
    if qk_dim <= 0 or qk_dim % 2 != 0 or (qk_dim // 2) % K != 0:
        raise GdnkitError(f"{fn}: Invalid packed `mixed_qkv` last dim={mixed_qkv.shape[1]} for HV={HV}, V={V}, "
                          f"K={K}.")
    H = qk_dim // 2 // K
    if HV % H != 0:
        raise GdnkitError(f"{fn}: Invalid head config inferred from mixed_qkv: H={H}, HV={HV}.")
    C.require_no_grad(fn, mixed_qkv, a, b, A_log, dt_bias)
    q = mixed_qkv[:, : H * K].view(B, H, K)
    k = mixed_qkv[:, H * K: 2 * H * K].view(B, H, K)
    v = mixed_qkv[:, 2 * H * K:].view(B, HV, V)
    pool = C.pool_in_place(fn, "initial_state", initial_state)
    slots = C.int32(torch.where(ssm_state_indices > 0, ssm_state_indices, -1))
    C.decode(C.tokens(q), C.tokens(k), C.tokens(v), pool, slots, out=out.view(B, HV, V), layout="k_last", scale=scale,
             use_qk_l2norm=bool(use_qk_l2norm_in_kernel), a=C.gates(a), b=C.gates(b), A_log=C.head_param(A_log),
             dt_bias=C.head_param(dt_bias))
    return out, initial_state
