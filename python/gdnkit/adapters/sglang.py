"""SGLang's fused GDN decode / target-verify entry point, computed by gdnkit.

    # from sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent import (
    #     fused_sigmoid_gating_delta_rule_update)
    from gdnkit.adapters.sglang import fused_sigmoid_gating_delta_rule_update

Same arguments and results: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (B = 1 with ``cu_seqlens``),
a, b ``[B*T, HV]`` or ``[B, T, HV]`` raw projections, A_log, dt_bias ``[HV]``; the state pool
``initial_state_source`` is ``[P, HV, V, K]`` (gdnkit's K-last), updated in place at
``initial_state_indices`` unless ``disable_state_update``. Target verify: ``intermediate_states_buffer``
``[Q, cache_steps, HV, V, K]`` receives the state after every token at ``intermediate_state_indices``;
``retrieve_parent_token`` ``[B, T]`` makes the drafts a tree. Returns o (v's shape).

Mapping: one token per sequence is gdnkit's decode (with ``cu_seqlens``, a batch of N sequences
holding N tokens is taken to be N sequences of one token, as engines pass for decode); drafts with a
cache, a tree, or up to 64 tokens are gdnkit's verify; longer sequences its prefill.

Differences: a negative slot is a padding row in gdnkit: its output is 0 (SGLang computes it from a zero
state); no state is read or written in both. Not supported (NotImplementedError): ``is_kda``,
``softplus_beta != 1``, ``softplus_threshold != 20`` (the spec's softplus), autograd.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._gdnkit import GdnkitError
from ._common import arange32, check_heads, fp32, gate_dtype, int32, not_supported, require_no_grad

__all__ = ["fused_sigmoid_gating_delta_rule_update"]

_RECURRENT_MAX_T = 64


def fused_sigmoid_gating_delta_rule_update(A_log: Tensor, a: Tensor, dt_bias: Tensor, softplus_beta: float,
                                           softplus_threshold: float, q: Tensor, k: Tensor, v: Tensor, b: Tensor,
                                           initial_state_source: Optional[Tensor],
                                           initial_state_indices: Optional[Tensor], scale: Optional[float] = None,
                                           use_qk_l2norm_in_kernel: bool = False,
                                           cu_seqlens: Optional[Tensor] = None, is_kda: bool = False,
                                           disable_state_update: bool = False,
                                           intermediate_states_buffer: Optional[Tensor] = None,
                                           intermediate_state_indices: Optional[Tensor] = None,
                                           cache_steps: Optional[int] = None,
                                           retrieve_parent_token: Optional[Tensor] = None) -> Tensor:
    """SGLang's ``fused_sigmoid_gating_delta_rule_update`` (decode and target verify), computed by gdnkit.

    Args:
        A_log, dt_bias: ``[HV]`` gating parameters: ``g = -exp(A_log) * softplus(a + dt_bias)``.
        a: ``[B*T, HV]`` or ``[B, T, HV]`` raw decay projection.
        softplus_beta, softplus_threshold: must be 1 and 20 (gdnkit's softplus).
        q, k: ``[B, T, H, K]`` (B = 1 with ``cu_seqlens``), float32, bfloat16 or float16.
        v: ``[B, T, HV, V]``, q's dtype.
        b: ``[B*T, HV]`` or ``[B, T, HV]`` raw beta projection: ``beta = sigmoid(b)``.
        initial_state_source: the pool ``[P, HV, V, K]`` (K-last), updated in place at
            ``initial_state_indices`` unless ``disable_state_update``; None: start from zeros, store nothing.
        initial_state_indices: ``[N]`` (or longer: the first N are used) pool slots; negative: padding
            (output 0, no state I/O).
        scale: query scale; None: ``1 / sqrt(K)``.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head.
        cu_seqlens: ``[N+1]`` sequence offsets (int32 or int64), or None (B sequences of T tokens).
        is_kda: not supported (must be False).
        disable_state_update: leave the pool unchanged.
        intermediate_states_buffer: ``[Q, cache_steps, HV, V, K]`` (or a view of it), receives the state
            after every token at ``intermediate_state_indices``; or None.
        intermediate_state_indices: ``[N]`` slots in the intermediate buffer (required with it).
        cache_steps: steps per slot of the intermediate buffer (required with it and ``cu_seqlens``).
        retrieve_parent_token: ``[N, T]`` tree parents (entry 0 of every row is ignored), or None for chains.

    Returns:
        o: ``[B, T, HV, V]`` (v's shape and dtype).

    Raises:
        NotImplementedError: ``is_kda``, other softplus parameters, autograd (an input requires grad).
        gdnkit.GdnkitError: invalid arguments (a ValueError).
    """
    fn = "fused_sigmoid_gating_delta_rule_update"
    if is_kda:
        raise not_supported(fn, "is_kda", "per-channel (KDA) gating")
    if float(softplus_beta) != 1.0 or float(softplus_threshold) != 20.0:
        raise not_supported(fn, f"softplus_beta={softplus_beta}, softplus_threshold={softplus_threshold}",
                            "gdnkit's softplus has beta 1 and threshold 20")
    require_no_grad(fn, q, k, v, a, b, A_log, dt_bias)
    check_heads(fn, q, k, v)
    if scale is not None and not scale > 0:
        raise GdnkitError(f"{fn}: scale must be positive, got {scale}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    T_total = B * T
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    device = q.device
    gates = dict(a=gate_dtype(a), b=gate_dtype(b), A_log=fp32(A_log).contiguous(), dt_bias=fp32(dt_bias).contiguous())
    common = dict(layout="k_last", scale=scale, use_qk_l2norm=bool(use_qk_l2norm_in_kernel), **gates)

    if initial_state_source is None:
        # SGLang starts from S = 0 and stores nothing: a scratch pool of zeros plays that part.
        pool = torch.zeros((max(N, 1), HV, V, K), dtype=torch.float32, device=device)
        idx = arange32(N, device)
        disable_state_update = True
    else:
        pool = initial_state_source
        if initial_state_indices is None:
            raise GdnkitError(f"{fn}: initial_state_indices is required with initial_state_source")
        idx = int32(initial_state_indices)
        if idx.numel() != N:
            idx = idx[:N]  # engines pass the padded index buffer; the first N entries belong to the batch

    if intermediate_states_buffer is not None:
        if intermediate_state_indices is None:
            raise GdnkitError(f"{fn}: intermediate_state_indices is required with intermediate_states_buffer")
        steps = int(cache_steps) if cache_steps is not None else (T if cu_seqlens is None else 0)
        if steps <= 0:
            raise GdnkitError(f"{fn}: cache_steps is required with intermediate_states_buffer and cu_seqlens")
        inter = intermediate_states_buffer
        if inter.dim() != 5 or inter.shape[1] != steps:
            inter = inter.view(-1, steps, HV, V, K)
        iidx = int32(intermediate_state_indices)[:N]
    else:
        inter, iidx, steps = None, None, 0

    parent = None
    if retrieve_parent_token is not None:
        # gdnkit's parent: -1 = the pool state; token 0 always starts from it (SGLang ignores its entry)
        parent = int32(retrieve_parent_token).clone()
        parent[:, 0] = -1

    one_token_each = (cu_seqlens is None and T == 1) or (cu_seqlens is not None and T_total == N)
    if inter is None and parent is None and one_token_each and not disable_state_update:
        return torch.ops.gdnkit.decode(q, k, v, pool, idx, None, **common)

    if inter is not None or parent is not None or (cu_seqlens is None and T <= _RECURRENT_MAX_T) or one_token_each:
        if cu_seqlens is not None:
            t_max = steps if steps > 0 else (1 if one_token_each else T_total)
            cu = int32(cu_seqlens)
        else:
            t_max, cu = T, None
        return torch.ops.gdnkit.verify(q, k, v, pool, idx, inter, None, cu_seqlens=cu, parent=parent,
                                       intermediate_indices=iidx, update_state=not disable_state_update,
                                       num_draft_tokens=t_max, **common)

    # long sequences: the chunked prefill, reading and writing the same slots
    cu = cu_seqlens if cu_seqlens is not None else torch.arange(0, T_total + 1, T, dtype=torch.int32, device=device)
    return torch.ops.gdnkit.prefill(q, k, v, cu, pool, None, None, initial_indices=idx,
                                    final_indices=None if disable_state_update else idx, **common)
