"""SGLang's fused GDN decode / target-verify entry point (SGLang 0.5.23), computed by gdnkit.

    # from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
    #     fused_sigmoid_gating_delta_rule_update)  # older: sglang.srt.layers.attention.fla.fused_sigmoid_...
    from gdnkit.adapters.sglang import fused_sigmoid_gating_delta_rule_update

Signature: every argument of SGLang 0.5.23's function, with its defaults; an unknown keyword raises
TypeError naming it. q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (B = 1 with ``cu_seqlens``), a, b
``[B*T, HV]`` or ``[B, T, HV]`` raw projections, A_log, dt_bias ``[HV]``; the state pool
``initial_state_source`` is ``[P, HV, V, K]`` (gdnkit's K-last, any slot stride), read at
``initial_state_indices`` and updated there unless ``disable_state_update``. Target verify:
``intermediate_states_buffer`` ``[Q, S, HV, V, K]`` receives the state after every token at
``intermediate_state_indices``; ``retrieve_parent_token`` ``[N, T]`` makes the drafts a tree. Returns o
(v's shape and dtype, a new contiguous tensor), as SGLang does.

Strides: SGLang reads q, k, v with any token stride (heads packed) and a, b with any token stride; here
q, k, v, a, b are passed as they are whenever the kernels read them (any token and head stride, last dim
contiguous, ``[B, T]`` with ``stride(0) == T * stride(1)``, 16-byte aligned rows on CUDA). Anything else is
copied, that tensor only. A pool that is updated is never copied: one the kernels cannot write in place
(float16, packed dims not contiguous) is an error; with ``disable_state_update`` such a pool is read from a
float32 copy.

Mapping: one token per sequence with the state updated is gdnkit's decode (with ``cu_seqlens``, a batch
of N sequences holding N tokens is taken to be N sequences of one token, as engines pass for decode; the
values of cu_seqlens are not read then); drafts with an intermediate buffer, or fixed-length batches of up
to 64 tokens, are gdnkit's verify; other varlen batches and longer sequences its prefill (which starts a
negative slot from S = 0 and stores nothing for it, as SGLang does). Softplus parameters other than beta 1
/ threshold 20, and ``lower_bound`` (``g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``), compute
the gates with torch before the call. ``cache_ring`` (ReplaySSM) writes the raw v, the raw k, the gate and
beta of every step into the rings with torch (index writes on the device, no host synchronization).

Differences: on decode and verify a negative slot is a padding row in gdnkit: its output is 0 where SGLang
computes it from a zero state (no state is read or written in both). A tree whose sequence has a negative
intermediate slot is still a tree in gdnkit (SGLang falls back to a chain there); without an intermediate
buffer ``retrieve_parent_token`` is ignored, as in SGLang. Not supported (NotImplementedError): ``is_kda``,
a tree with the state update enabled, autograd; ``match_cutedsl_decode`` is a ValueError as in SGLang (it is
defined for KDA only).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor

from .._gdnkit import GdnkitError
from . import _common as C

__all__ = ["fused_sigmoid_gating_delta_rule_update"]

PEER = "SGLang 0.5.23"

_RECURRENT_MAX_T = 64


def _gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, softplus_beta: float, softplus_threshold: float,
           lower_bound: Optional[float], T_total: int, HV: int) -> Dict[str, Tensor]:
    a = C.token_gates(a, T_total, HV)
    b = C.token_gates(b, T_total, HV)
    if lower_bound is None and float(softplus_beta) == 1.0 and float(softplus_threshold) == 20.0:
        return dict(a=a, b=b, A_log=C.head_param(A_log), dt_bias=C.head_param(dt_bias))
    return dict(g=_gate_values(a, A_log, dt_bias, softplus_beta, softplus_threshold, lower_bound),
                beta=C.sigmoid_gate(b))


def _gate_values(a: Tensor, A_log: Tensor, dt_bias: Tensor, softplus_beta: float, softplus_threshold: float,
                 lower_bound: Optional[float]) -> Tensor:
    """The log-space decay per token and head, float32."""
    if lower_bound is not None:
        return float(lower_bound) * torch.sigmoid(torch.exp(C.head_param(A_log)) * (a.float() + C.head_param(dt_bias)))
    return C.softplus_gate(a, C.head_param(A_log), C.head_param(dt_bias), softplus_beta, softplus_threshold)


def _cache_view(fn: str, buf: Tensor, HV: int, K: int, V: int) -> Tensor:
    """The intermediate buffer as gdnkit's cache ``[Q, S, HV, V, K]``: SGLang places slot n's step t at
    ``n * stride(0) + t * HV*K*V`` elements, so a buffer of another rank is viewed with that pitch."""
    if buf.dim() == 5:
        return buf
    hvkv = HV * K * V
    pitch = buf.stride(0)
    if pitch % hvkv or pitch < hvkv:
        raise GdnkitError(f"{fn}: intermediate_states_buffer: stride(0)={pitch} is not a multiple of HV*K*V={hvkv}")
    return buf.as_strided((buf.shape[0], pitch // hvkv, HV, V, K), (pitch, hvkv, V * K, K, 1))


def _ring_writes(fn: str, k: Tensor, v: Tensor, gate: Tensor, beta: Tensor, slots: Tensor, N: int, T: int,
                 cu_seqlens: Optional[Tensor], rawv: Tensor, rawk: Tensor, ring_g: Tensor, ring_beta: Tensor) -> None:
    """SGLang's ReplaySSM ring writes: for step t < L of sequence n with slot s = slots[n] >= 0,
    rawv[s, :, t] = v, rawk[s, :, t] = k (before the L2 norm), g[s, :, t] = gate, beta[s, :, t] = beta."""
    if rawv.dim() != 4 or rawk.dim() != 4 or ring_g.dim() != 3 or ring_beta.dim() != 3:
        raise GdnkitError(f"{fn}: cache_ring expects per-layer ring views: replayssm_rawv [slots, HV, L, V], "
                          "replayssm_rawk [slots, H, L, K], replayssm_g and replayssm_beta [slots, HV, L]")
    L = rawv.shape[-2]
    T_total = k.shape[0] * k.shape[1]
    steps = min(L, T) if cu_seqlens is None else min(L, T_total)
    if N == 0 or steps == 0 or T_total == 0:
        return
    dev = k.device
    t = torch.arange(steps, dtype=torch.int64, device=dev).expand(N, steps)
    starts = C.seq_starts(cu_seqlens, N, T, dev)[:, None]
    lens = C.seq_lengths(cu_seqlens, N, T, dev)[:, None]
    s = slots[:N].to(torch.int64)[:, None].expand(N, steps)
    valid = (t < lens) & (s >= 0) & (s < rawv.shape[0])
    tok = torch.where(valid, starts + t, torch.zeros((), dtype=torch.int64, device=dev)).reshape(-1)
    s, t, valid = s.reshape(-1), t.reshape(-1), valid.reshape(-1)
    kf = k.reshape(T_total, k.shape[2], k.shape[3])
    vf = v.reshape(T_total, v.shape[2], v.shape[3])
    gf = gate.reshape(T_total, -1)
    bf = beta.reshape(T_total, -1)
    C.scatter_rows(rawv.transpose(1, 2), (s, t), valid, vf[tok])
    C.scatter_rows(rawk.transpose(1, 2), (s, t), valid, kf[tok])
    C.scatter_rows(ring_g.transpose(1, 2), (s, t), valid, gf[tok].float())
    C.scatter_rows(ring_beta.transpose(1, 2), (s, t), valid, bf[tok].float())


def fused_sigmoid_gating_delta_rule_update(A_log: Tensor, a: Tensor, dt_bias: Tensor, softplus_beta: float,
                                           softplus_threshold: float, q: Tensor, k: Tensor, v: Tensor, b: Tensor,
                                           initial_state_source: Optional[Tensor],
                                           initial_state_indices: Optional[Tensor], scale: Optional[float] = None,
                                           use_qk_l2norm_in_kernel: bool = False,
                                           cu_seqlens: Optional[Tensor] = None, is_kda: bool = False,
                                           lower_bound: Optional[float] = None,
                                           disable_state_update: bool = False,
                                           intermediate_states_buffer: Optional[Tensor] = None,
                                           intermediate_state_indices: Optional[Tensor] = None,
                                           cache_steps: Optional[int] = None,
                                           retrieve_parent_token: Optional[Tensor] = None,
                                           cache_ring: bool = False, replayssm_rawv: Optional[Tensor] = None,
                                           replayssm_rawk: Optional[Tensor] = None,
                                           replayssm_g: Optional[Tensor] = None,
                                           replayssm_beta: Optional[Tensor] = None,
                                           match_cutedsl_decode: bool = False) -> Tensor:
    """SGLang 0.5.23's ``fused_sigmoid_gating_delta_rule_update`` (decode and target verify), by gdnkit.

    Args:
        A_log, dt_bias: ``[HV]`` gating parameters: ``g = -exp(A_log) * softplus(a + dt_bias)``.
        a: ``[B*T, HV]`` or ``[B, T, HV]`` raw decay projection (any strides).
        softplus_beta, softplus_threshold: the softplus (1 and 20: gdnkit's fused gating; others: torch).
        q, k: ``[B, T, H, K]`` (B = 1 with ``cu_seqlens``), float32, bfloat16 or float16.
        v: ``[B, T, HV, V]``, q's dtype.
        b: ``[B*T, HV]`` or ``[B, T, HV]`` raw beta projection: ``beta = sigmoid(b)``.
        initial_state_source: the pool ``[P, HV, V, K]`` (K-last, any slot stride), updated in place at
            ``initial_state_indices`` unless ``disable_state_update``; None: start from zeros, store nothing.
        initial_state_indices: ``[N]`` (or longer: the first N are used) pool slots; negative: see the
            module docstring.
        scale: query scale; None: ``1 / sqrt(K)``.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head.
        cu_seqlens: ``[N+1]`` sequence offsets (int32 or int64), or None (B sequences of T tokens).
        is_kda: not supported (must be False).
        lower_bound: KDA's safe gate ``g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``, or None.
        disable_state_update: leave the pool unchanged.
        intermediate_states_buffer: ``[Q, S, HV, V, K]`` (slot pitch from stride(0)), receives the state
            after every token at ``intermediate_state_indices``; or None.
        intermediate_state_indices: ``[N]`` slots in the intermediate buffer (required with it).
        cache_steps: accepted; SGLang uses it to pick a launch configuration only.
        retrieve_parent_token: ``[N, T]`` tree parents (entry 0 of every row is not read), or None.
        cache_ring: write the ReplaySSM rings below for every step (at the pool slot of the sequence).
        replayssm_rawv, replayssm_rawk, replayssm_g, replayssm_beta: ``[slots, HV, L, V]``,
            ``[slots, H, L, K]``, ``[slots, HV, L]``, ``[slots, HV, L]`` rings (with ``cache_ring``).
        match_cutedsl_decode: KDA only (must be False).

    Returns:
        o: ``[B, T, HV, V]`` (v's shape and dtype).

    Raises:
        TypeError: a keyword argument SGLang 0.5.23's function does not have.
        NotImplementedError: ``is_kda``, a tree with the state update, autograd (an input requires grad).
        gdnkit.GdnkitError: invalid arguments (a ValueError).
    """
    fn = "fused_sigmoid_gating_delta_rule_update"
    if match_cutedsl_decode and (not is_kda or lower_bound is not None):
        raise GdnkitError(f"{fn}: match_cutedsl_decode is defined for the KDA softplus gate only "
                          "(is_kda=True, lower_bound=None).")
    if is_kda:
        raise C.not_supported(fn, "is_kda", "per-channel (KDA) gating")
    C.require_no_grad(fn, q, k, v, a, b, A_log, dt_bias)
    C.check_heads(fn, q, k, v)
    if scale is not None and not scale > 0:
        raise GdnkitError(f"{fn}: scale must be positive, got {scale}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    T_total = B * T
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    device = q.device
    gates = _gates(a, b, A_log, dt_bias, softplus_beta, softplus_threshold, lower_bound, T_total, HV)
    common: Dict[str, Any] = dict(layout="k_last", scale=scale, use_qk_l2norm=bool(use_qk_l2norm_in_kernel), **gates)

    if cache_ring:
        if (initial_state_indices is None or replayssm_rawv is None or replayssm_rawk is None or replayssm_g is None
                or replayssm_beta is None):
            raise GdnkitError(f"{fn}: cache_ring needs initial_state_indices and the four replayssm_* rings")
        gate = gates["g"] if "g" in gates else _gate_values(gates["a"], A_log, dt_bias, 1.0, 20.0, None)
        beta = gates["beta"] if "beta" in gates else C.sigmoid_gate(gates["b"])
        _ring_writes(fn, k, v, gate, beta, initial_state_indices, N, T, cu_seqlens, replayssm_rawv, replayssm_rawk,
                     replayssm_g, replayssm_beta)

    q, k, v = C.tokens(q), C.tokens(k), C.tokens(v)
    if initial_state_source is None:
        # SGLang starts from S = 0 and stores nothing: every sequence reads one zero slot
        pool = torch.zeros((1, HV, V, K), dtype=torch.float32, device=device)
        idx = torch.zeros(N, dtype=torch.int32, device=device)
        update = False
    else:
        if initial_state_indices is None:
            raise GdnkitError(f"{fn}: initial_state_indices is required with initial_state_source")
        update = not disable_state_update
        pool = (C.pool_in_place(fn, "initial_state_source", initial_state_source) if update
                else C.pool_read_only(initial_state_source))
        idx = C.int32(initial_state_indices.reshape(-1)[:N])  # engines pass the padded buffer: the first N

    inter, iidx, parent = None, None, None
    if intermediate_states_buffer is not None:
        if intermediate_state_indices is None:
            raise GdnkitError(f"{fn}: intermediate_state_indices is required with intermediate_states_buffer")
        inter = _cache_view(fn, intermediate_states_buffer, HV, K, V)
        iidx = C.int32(intermediate_state_indices.reshape(-1)[:N])
        if retrieve_parent_token is not None:  # SGLang loads tree parents from the buffer: none without it
            if update:
                raise C.not_supported(fn, "retrieve_parent_token with disable_state_update=False",
                                      "gdnkit stores the state of chains only")
            # gdnkit's parent: -1 = the pool state; token 0 always starts from it (SGLang does not read entry 0)
            parent = C.int32(retrieve_parent_token).clone()
            parent[:, 0] = -1

    one_token_each = (cu_seqlens is None and T == 1) or (cu_seqlens is not None and T_total == N)
    if inter is None and one_token_each and update:
        return C.decode(q, k, v, pool, idx, **common)

    if inter is not None or one_token_each or (cu_seqlens is None and 0 < T <= _RECURRENT_MAX_T):
        if cu_seqlens is not None:
            if parent is not None:
                t_max = parent.shape[1]
            elif inter is not None:
                t_max = inter.shape[1]
            else:
                t_max = 1
            cu = C.int32(cu_seqlens)
        else:
            t_max, cu = T, None
            if parent is not None and parent.shape[1] != T:
                parent = parent[:, :T].contiguous()
        return C.verify(q, k, v, pool, idx, inter, cu_seqlens=cu, parent=parent, intermediate_indices=iidx,
                        update_state=update, num_draft_tokens=t_max, **common)

    # longer or varlen sequences: the chunked prefill, reading and writing the same slots
    if cu_seqlens is not None:
        cu = cu_seqlens if cu_seqlens.dtype in (torch.int32, torch.int64) else cu_seqlens.long()
        cu = cu.contiguous()
    else:
        cu = C.fixed_cu_seqlens(B, T, device)
    if initial_state_source is None:
        return C.prefill(q, k, v, cu, None, **common)
    return C.prefill(q, k, v, cu, pool, initial_indices=idx, final_indices=idx if update else None, **common)
