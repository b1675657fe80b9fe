"""FlashInfer's GDN entry points (FlashInfer 0.7.2 signatures), computed by gdnkit.

    # from flashinfer.gdn_prefill import chunk_gated_delta_rule
    # from flashinfer.gdn_decode import (gated_delta_rule_decode_pretranspose, gated_delta_rule_mtp,
    #                                    gated_delta_rule_decode)
    from gdnkit.adapters.flashinfer import (chunk_gated_delta_rule, gated_delta_rule_decode_pretranspose,
                                            gated_delta_rule_mtp, gated_delta_rule_decode)

Pinned peer: FlashInfer 0.7.2 (``flashinfer-python``; 0.7.2.post1's GDN modules). Same arguments, defaults
and return values as FlashInfer's functions, results within the tolerances of docs/semantics.md. An argument
FlashInfer does not have is a ``TypeError`` naming it (the signatures take no ``**kwargs``); an option gdnkit
does not implement is a ``NotImplementedError`` naming it; FlashInfer's argument errors are
``gdnkit.GdnkitError`` (a ValueError) with FlashInfer's wording where FlashInfer raises ValueError.

What FlashInfer's arguments mean, and how they map onto gdnkit:

- **Prefill gates.** ``chunk_gated_delta_rule``'s ``g`` is the decay *factor* ``alpha = exp(log-decay)``
  in (0, 1], not FLA's log-space g, and ``beta`` is the update strength itself; both are computed by the
  caller (``[T, max(HQ, HV)]``, None: ones). gdnkit runs them as its given gates with
  ``g = log(max(alpha, 1e-10))`` (a zero alpha is a very strong decay, not ``-inf``).
- **Prefill L2 norm.** ``use_qk_l2norm_in_kernel`` normalizes q and k per head (``x / sqrt(sum(x^2) +
  1e-6)``); FlashInfer runs a separate kernel for it, gdnkit fuses it.
- **Decode / MTP gates.** ``A_log``, ``a``, ``dt_bias``, ``b`` are the raw projections:
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (gdnkit's fused gating).
- **State layout.** ``[.., HV, V, K]`` (K-last; "pretranspose", v-major) everywhere except
  ``gated_delta_rule_decode``, whose state is ``[B, HV, K, V]`` (gdnkit's V-last).
- **Heads.** GVA (``HV = r * HQ``, ``HK = HQ``: value head h reads q/k head ``h // r``) as gdnkit; prefill
  also takes GQA (``HQ = r * HV``, ``HK = HV``: one state per q head, reading k/v head ``h // r``) by
  repeating k and v per q head before the call.
- **Pools.** ``initial_state`` with ``initial_state_indices`` (decode / MTP) or ``state_indices``
  (prefill) is a pool read and written in place at those slots, as gdnkit's pools. A negative decode slot
  is a padding row: its output is 0 (an MTP call with ``output`` given leaves those rows as they were) and
  no state is read or written. FlashInfer's bf16 kernels instead read and write slot 0 for index -1 and
  leave the output undefined: gdnkit never touches slot 0 for padding.
- **Separate write slots.** ``output_state_indices`` (and MTP's per-token ``ssm_state_indices``) run
  gdnkit's verify with an intermediate cache (``intermediate_states_buffer`` when given, else a scratch
  ``[B, T, HV, V, K]`` of the pool's dtype), then gdnkit's commit from that cache into the write slots
  (one commit per write slot column): one extra write and read of those states compared with FlashInfer.
- **Routing options.** ``backend``, ``use_cp`` and ``_cp_chunk_len`` choose among FlashInfer's kernels;
  their values are checked as FlashInfer checks them and otherwise have no effect (gdnkit chooses its own
  kernels for the same function).
- **Strides.** q, k, v and the gates reach the kernels as they are whenever the kernels read them (views
  of a fused projection cost nothing; see gdnkit.adapters._common), where FlashInfer's prefill requires
  contiguous tensors. GQA prefill copies k and v (repeated per q head).
- **States.** Decode / MTP pools and ``state`` are updated in place, never copied: a pool gdnkit cannot
  write (float16, inner dims not packed) is an error. Prefill: an ``output_state`` other than
  ``initial_state`` first receives the initial states of the call's sequences, then is updated in place;
  an ``initial_state`` / ``output_state`` of another dtype than float32 / bfloat16 (float16, float8) or
  with inner dims not packed goes through a float32 copy of the call's N states.
- **Dtypes.** q/k/v may also be float32 (a superset of FlashInfer's float16 / bfloat16).
- **Outputs.** A new tensor of q's dtype, or the ``output`` tensor passed: written by the kernel when it
  has v's dtype and a layout the kernels write, else computed and copied into it (cast to its dtype).

Host synchronization: only checkpointed prefill (``state_checkpoints``) reads ``cu_seqlens`` back to the
host, to size a temporary ``[N, S, HV, V, K]`` cache whose entries are then copied to FlashInfer's flat
checkpoint list. Everything else is capturable in CUDA graphs (after one eager call). The functions are
``torch.compiler.disable``-d (a graph break under torch.compile), as the kernels write caller buffers.

Not supported (NotImplementedError): autograd, a uGPU pool (``initial_state`` of 5 dims, Rubin),
``cache_replayssm`` and the ``replayssm_*`` buffers (FlashInfer's SM100 ReplaySSM window cache).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import torch
from torch import Tensor

from .._gdnkit import GdnkitError
from . import _common as C

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_decode_pretranspose", "gated_delta_rule_mtp",
           "gated_delta_rule_decode"]

PEER = "FlashInfer 0.7.2"

# What FlashInfer 0.7.2 accepts for its routing and state-dtype arguments.
_PREFILL_BACKENDS = ("auto", "flashinfer", "cake_gdn", "cudnn")
_DECODE_BACKENDS = ("auto", "flashinfer", "cake_gdn", "rubin")
_STATE_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, torch.float16,
                                  getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
                      if d is not None)
_ALPHA_FLOOR = 1e-10  # alpha below this is taken as this (log(0) would be -inf)

_mtp_default_warned = False


# ---- small helpers ------------------------------------------------------------------------------

def _err(fn: str, msg: str) -> GdnkitError:
    return GdnkitError(f"{fn}: {msg}")


def _is_int(t: Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def _same_tensor(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    """a and b view the same elements (the same tensor, or an identical view of it)."""
    if a is None or b is None:
        return False
    if a is b:
        return True
    return (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def _cache_ok(t: Tensor) -> bool:
    """An intermediate cache gdnkit writes in place: [Q, S, HV, D1, D2], float32 or bfloat16, contiguous."""
    return (t.dim() == 5 and t.dtype in (torch.float32, torch.bfloat16) and t.is_contiguous()
            and C._aligned(t, 16))


def _direct_out(output: Optional[Tensor], like: Tensor) -> Optional[Tensor]:
    """The caller's ``output`` when the kernels write it as it is (like's shape and dtype, a layout they
    read), else None (the result is computed into a new tensor and copied)."""
    if output is None or output.dtype != like.dtype or tuple(output.shape) != tuple(like.shape):
        return None
    return output if C.readable(output, 2) else None


def _byte_view(t: Tensor) -> Tensor:
    """One-byte float types (float8) through uint8, for the indexing kernels that do not take them."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype.is_floating_point else t


def _rows_get(t: Tensor, idx: Tensor) -> Tensor:
    """t[idx] along dim 0 (a copy), any dtype."""
    return _byte_view(t).index_select(0, idx.long()).view(t.dtype)


def _rows_put(t: Tensor, idx: Tensor, rows: Tensor) -> None:
    """t[idx] = rows along dim 0, cast to t's dtype, in place, any dtype and strides."""
    _byte_view(t).index_copy_(0, idx.long(), _byte_view(rows.to(t.dtype).contiguous()))


def _check_output(fn: str, output: Optional[Tensor], shape: Tuple[int, ...]) -> None:
    if output is not None and tuple(output.shape) != tuple(shape):
        raise _err(fn, f"output must have shape {list(shape)}, got {list(output.shape)}")


def _to_output(o: Tensor, output: Optional[Tensor], keep: Optional[Tensor] = None) -> Tensor:
    """Write o into the caller's ``output`` (cast) unless the kernel wrote it already, leaving the rows where
    ``keep`` is true as they were."""
    if output is None or o is output:
        return o
    if keep is not None:
        o = torch.where(keep.view((-1,) + (1,) * (o.dim() - 1)), output, o.to(output.dtype))
    output.copy_(o)
    return output


# ---- prefill ------------------------------------------------------------------------------------

@torch.compiler.disable
def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                           beta: Optional[Tensor] = None, scale: Optional[float] = None,
                           initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                           cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                           output: Optional[Tensor] = None, output_state: Optional[Tensor] = None,
                           state_checkpoints: Optional[Tensor] = None, checkpoint_cu_starts: Optional[Tensor] = None,
                           checkpoint_every_n_tokens: int = 0, use_cp: Union[Literal["auto"], bool] = "auto",
                           state_indices: Optional[Tensor] = None, _cp_chunk_len: Optional[int] = None,
                           backend: Literal["auto", "flashinfer", "cake_gdn", "cudnn"] = "auto",
                           max_seqlen: Optional[int] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """FlashInfer's ``flashinfer.gdn_prefill.chunk_gated_delta_rule``, computed by gdnkit's chunked prefill.

    Args:
        q: ``[T, HQ, K]``, bfloat16, float16 or float32.
        k: ``[T, HK, K]``, q's dtype.
        v: ``[T, HV, V]``, q's dtype. GVA: ``HK = HQ``, ``HV = r * HQ``; GQA: ``HK = HV``, ``HQ = r * HV``.
        g: ``[T, HS]`` (``HS = max(HQ, HV)``) decay factor alpha in (0, 1] (not log-space), or None (ones).
        beta: ``[T, HS]`` update strength, or None (ones).
        scale: query scale; None or 0: ``1 / sqrt(K)``.
        initial_state: ``[N, HS, V, K]`` (K-last), or with ``state_indices`` the pool ``[P, HS, V, K]``;
            float32, bfloat16, float16 or float8; None: zeros. Read, never modified (unless it is
            ``output_state``).
        output_final_state: return ``(output, final_state)`` instead of ``output``.
        cu_seqlens: ``[N+1]`` integer sequence offsets on q's device (required).
        use_qk_l2norm_in_kernel: L2-normalize q and k per head.
        output: ``[T, HS, V]`` written in place, or None (a new tensor of q's dtype).
        output_state: ``[N, HS, V, K]`` (with ``state_indices``: a pool) receiving the final states (they
            are written whenever it is given), or None (a new float32 tensor when ``output_final_state``).
            May be ``initial_state`` itself (in place).
        state_checkpoints: ``[total_checkpoints, HS, V, K]``: entry ``checkpoint_cu_starts[i] + j`` receives
            sequence i's state after ``(j+1) * checkpoint_every_n_tokens`` tokens.
        checkpoint_cu_starts: ``[N+1]`` integer offsets into ``state_checkpoints``.
        checkpoint_every_n_tokens: 0 or a multiple of 64.
        use_cp, _cp_chunk_len, backend: FlashInfer's kernel routing; checked, no effect.
        state_indices: ``[N]`` pool slots of the sequences (initial and final states), or None.
        max_seqlen: a bound on the longest sequence (checked as FlashInfer checks it), or None.

    Returns:
        ``output`` ``[T, HS, V]``, or ``(output, final_state)`` with ``output_final_state``: final_state is
        ``output_state`` (the pool itself with ``state_indices``).

    Raises:
        NotImplementedError: autograd (an input requires grad).
        gdnkit.GdnkitError: invalid arguments (a ValueError), where FlashInfer raises too.
    """
    fn = "chunk_gated_delta_rule"
    # FlashInfer's own checks, in its order.
    if backend not in _PREFILL_BACKENDS:
        raise _err(fn, f"unsupported GDN backend: {backend!r}")
    if use_cp not in ("auto", True, False):
        raise _err(fn, f'use_cp must be "auto", True, or False, got {use_cp!r}')
    if checkpoint_every_n_tokens < 0:
        raise _err(fn, f"checkpoint_every_n_tokens must be non-negative, got {checkpoint_every_n_tokens}")
    if checkpoint_every_n_tokens > 0:
        if checkpoint_every_n_tokens % 64 != 0:
            raise _err(fn, "checkpoint_every_n_tokens must be a multiple of the chunk size (64), "
                           f"got {checkpoint_every_n_tokens}")
        if state_checkpoints is None or checkpoint_cu_starts is None:
            raise _err(fn, "state_checkpoints and checkpoint_cu_starts must both be provided when "
                           "checkpoint_every_n_tokens > 0")
    elif state_checkpoints is not None or checkpoint_cu_starts is not None:
        raise _err(fn, "state_checkpoints and checkpoint_cu_starts must be None when checkpoint_every_n_tokens == 0")
    if cu_seqlens is None:
        raise _err(fn, "cu_seqlens is required for varlen mode")
    if not _is_int(cu_seqlens):
        raise _err(fn, f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise _err(fn, f"expected q [T, HQ, K], k [T, HK, K], v [T, HV, V], got q {list(q.shape)}, "
                       f"k {list(k.shape)}, v {list(v.shape)}")
    N = cu_seqlens.shape[0] - 1
    T = q.shape[0]
    if N <= 0:
        raise _err(fn, "cu_seqlens must contain at least two entries")
    if max_seqlen is not None:
        if type(max_seqlen) is not int or max_seqlen < 0:
            raise _err(fn, "max_seqlen must be a nonnegative integer")
        if T and max_seqlen == 0:
            raise _err(fn, "max_seqlen must be positive when q is nonempty")
        if max_seqlen < (T + N - 1) // N:
            raise _err(fn, "max_seqlen cannot be smaller than ceil(total_seq_len / num_seqs)")
        if max_seqlen > T:
            raise _err(fn, "max_seqlen cannot exceed total_seq_len")
    if _cp_chunk_len is not None and (type(_cp_chunk_len) is not int or _cp_chunk_len <= 0
                                      or _cp_chunk_len % 64 != 0):
        raise _err(fn, f"_cp_chunk_len must be a positive multiple of 64, got {_cp_chunk_len!r}")
    if backend == "cudnn":
        unsupported = [name for name, on in (("use_cp", use_cp is True or _cp_chunk_len is not None),
                                             ("checkpoint_every_n_tokens", checkpoint_every_n_tokens > 0),
                                             ("state_indices", state_indices is not None)) if on]
        if unsupported:
            raise NotImplementedError(f'chunk_gated_delta_rule(backend="cudnn") does not support '
                                      + ", ".join(unsupported))
    C.require_no_grad(fn, q, k, v, g, beta, initial_state)

    HQ, HK, HV = q.shape[1], k.shape[1], v.shape[1]
    Kd, Vd = q.shape[2], v.shape[2]
    if k.shape[0] != T or v.shape[0] != T or k.shape[2] != Kd:
        raise _err(fn, f"q, k, v must have the same number of tokens and q, k the same head size, got "
                       f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    gva = HQ == HK and HV >= HQ and HV % HQ == 0
    gqa = HK == HV and HQ > HV and HQ % HV == 0
    if not (gva or gqa):
        raise _err(fn, f"heads HQ={HQ}, HK={HK}, HV={HV} are neither GVA (HK = HQ, HV a multiple of HQ) nor GQA "
                       "(HK = HV, HQ a multiple of HV)")
    HS = max(HQ, HV)
    _check_output(fn, output, (T, HS, Vd))
    if gqa:  # one state per q head, reading k/v head h // r: gdnkit's GVA with HV = HQ
        r = HQ // HV
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat_interleave(r, dim=1)
    q, k, v = C.tokens(q), C.tokens(k), C.tokens(v)

    # gates: alpha -> log-space decay; None -> ones
    for name, t in (("g", g), ("beta", beta)):
        if t is not None and tuple(t.shape) != (T, HS):
            raise _err(fn, f"{name} must have shape [{T}, {HS}] ([total_seq_len, max(num_q_heads, num_v_heads)]), "
                           f"got {list(t.shape)}")
    if g is None:
        g_log = torch.zeros((T, HS), dtype=torch.float32, device=q.device)
    else:
        g_log = torch.log(g.float().clamp_min(_ALPHA_FLOOR))
    beta_in = torch.ones((T, HS), dtype=torch.float32, device=q.device) if beta is None else C.gates(beta)
    op_scale = float(scale) if scale is not None and scale != 0.0 else None

    # states
    tail = (HS, Vd, Kd)
    if state_indices is not None:
        if not _is_int(state_indices):
            raise _err(fn, f"state_indices must have an integer dtype, got {state_indices.dtype}")
        if tuple(state_indices.shape) != (N,):
            raise _err(fn, f"state_indices must have shape {(N,)}, got {tuple(state_indices.shape)}")
        if output_final_state and output_state is None:
            raise _err(fn, "state_indices requires an explicit output_state pool sized like the state pool "
                           "([N_pool, H, V, K]); refusing to auto-allocate a compact [num_seqs, ...] tensor that "
                           "would be indexed out of bounds.")
        # gathers below must not see a negative slot (FlashInfer's pools have none)
        sidx = C.int32(state_indices).clamp_min(0)
    else:
        sidx = C.arange32(N, q.device)
    for name, t in (("initial_state", initial_state), ("output_state", output_state)):
        if t is None:
            continue
        if t.dtype not in _STATE_DTYPES:
            raise _err(fn, f"{name} must have dtype float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, "
                           f"got {t.dtype}")
        if t.dim() != 4 or tuple(t.shape[1:]) != tail or (state_indices is None and t.shape[0] != N):
            want = ("[N_pool, " if state_indices is not None else f"[{N}, ") + ", ".join(map(str, tail)) + "]"
            raise _err(fn, f"{name} must have shape {want}, got {list(t.shape)}")

    store = output_final_state or output_state is not None
    if store and output_state is None:
        output_state = torch.empty((N,) + tail, dtype=torch.float32, device=q.device)
    writeback: Optional[Tuple[Tensor, Tensor]] = None  # (compact work pool, slots) copied to output_state after
    work: Optional[Tensor] = None
    init_idx = final_idx = None
    if store:
        assert output_state is not None
        if C.pool_readable(output_state):
            work = output_state
            if initial_state is not None and not _same_tensor(initial_state, output_state):
                _rows_put(work, sidx, _rows_get(initial_state, sidx))
            init_idx = sidx if initial_state is not None else None
            final_idx = sidx
        else:  # float16 / float8 / odd strides: a compact float32 pool of the N sequences' states
            work = (_rows_get(initial_state, sidx).float() if initial_state is not None
                    else torch.zeros((N,) + tail, dtype=torch.float32, device=q.device))
            final_idx = C.arange32(N, q.device)
            init_idx = final_idx if initial_state is not None else None
            writeback = (work, sidx)
    elif initial_state is not None:
        if C.pool_readable(initial_state):
            work, init_idx = initial_state, sidx
        else:
            work, init_idx = _rows_get(initial_state, sidx).float(), C.arange32(N, q.device)

    # checkpoints: gdnkit writes [N, S] per-sequence slots; FlashInfer's layout is one flat list
    ck = ck_idx = None
    ck_copy = None
    if checkpoint_every_n_tokens > 0:
        assert state_checkpoints is not None and checkpoint_cu_starts is not None
        if state_checkpoints.dtype not in _STATE_DTYPES:
            raise _err(fn, f"state_checkpoints must have dtype float32, bfloat16, float16, float8_e4m3fn or "
                           f"float8_e5m2, got {state_checkpoints.dtype}")
        if state_checkpoints.dim() != 4 or tuple(state_checkpoints.shape[1:]) != tail:
            raise _err(fn, f"state_checkpoints must have shape [*, {HS}, {Vd}, {Kd}], "
                           f"got {list(state_checkpoints.shape)}")
        if not _is_int(checkpoint_cu_starts) or checkpoint_cu_starts.dim() != 1 \
                or checkpoint_cu_starts.shape[0] != N + 1:
            raise _err(fn, f"checkpoint_cu_starts must be a 1-D integer tensor of {N + 1} elements, got "
                           f"{checkpoint_cu_starts.dtype} {list(checkpoint_cu_starts.shape)}")
        offs = [int(x) for x in cu_seqlens.tolist()]  # host synchronization (both reads)
        starts = [int(x) for x in checkpoint_cu_starts.tolist()]
        counts = [max(0, offs[n + 1] - offs[n]) // checkpoint_every_n_tokens for n in range(N)]
        if starts[0] != 0 or any(starts[n + 1] - starts[n] != counts[n] for n in range(N)):
            raise _err(fn, f"checkpoint_cu_starts {starts} does not match cu_seqlens {offs}: sequence n has "
                           f"len_n // {checkpoint_every_n_tokens} checkpoints, from checkpoint_cu_starts[n]")
        if starts[N] > state_checkpoints.shape[0]:
            raise _err(fn, f"state_checkpoints holds {state_checkpoints.shape[0]} checkpoints, the sequences "
                           f"have {starts[N]}")
        S = max(counts)
        if S > 0:
            ck_dtype = state_checkpoints.dtype if state_checkpoints.dtype in (torch.float32, torch.bfloat16) \
                else torch.float32
            ck = torch.empty((N, S) + tail, dtype=ck_dtype, device=q.device)
            ck_idx = C.arange32(N, q.device)
            src = [n * S + j for n in range(N) for j in range(counts[n])]
            dst = [starts[n] + j for n in range(N) for j in range(counts[n])]
            ck_copy = (torch.tensor(src, dtype=torch.long, device=q.device),
                       torch.tensor(dst, dtype=torch.long, device=q.device))

    cu = (cu_seqlens if cu_seqlens.dtype in (torch.int32, torch.int64) else cu_seqlens.to(torch.int32)).contiguous()
    kw = dict(initial_indices=init_idx, final_indices=final_idx, g=g_log, beta=beta_in, layout="k_last",
              scale=op_scale, use_qk_l2norm=bool(use_qk_l2norm_in_kernel))
    if ck is None:
        o = C.prefill(q, k, v, cu, work, out=_direct_out(output, v), **kw)
    else:
        o = torch.ops.gdnkit.prefill(q, k, v, cu, work, ck, None, checkpoint_interval=checkpoint_every_n_tokens,
                                     checkpoint_indices=ck_idx, **kw)
    if writeback is not None:
        assert output_state is not None
        _rows_put(output_state, writeback[1], writeback[0])
    if ck is not None and ck_copy is not None:
        assert state_checkpoints is not None
        _rows_put(state_checkpoints, ck_copy[1], _rows_get(ck.view((-1,) + tail), ck_copy[0]))
    o = _to_output(o, output)
    if output_final_state:
        assert output_state is not None
        return o, output_state
    return o


# ---- decode and MTP -------------------------------------------------------------------------------

def _recurrent(fn: str, q: Tensor, k: Tensor, v: Tensor, pool: Tensor, in_idx: Tensor, out_idx: Optional[Tensor],
               A_log: Tensor, a: Tensor, dt_bias: Tensor, b: Tensor, scale: Optional[float], use_qk_l2norm: bool,
               output: Optional[Tensor], inter: Optional[Tensor], update: bool, ssm_idx: Optional[Tensor],
               pool_name: str, layout: str = "k_last") -> Tensor:
    """T tokens per sequence from ``pool[in_idx]`` (negative: padding): gdnkit's decode (T = 1, in place),
    or its verify (a chain; the state after every token in ``inter`` when given), with the final state stored
    in place, at ``out_idx`` (via a cache and gdnkit's commit), at ``ssm_idx[:, t]`` after every token t, or
    nowhere (``update`` False)."""
    B, T = q.shape[0], q.shape[1]
    HV = v.shape[2]
    if scale is not None and not scale > 0:
        raise _err(fn, f"scale must be positive, got {scale}")
    _check_output(fn, output, tuple(v.shape))
    q, k, v = C.tokens(q), C.tokens(k), C.tokens(v)
    gates = dict(a=C.token_gates(a, B * T, HV), b=C.token_gates(b, B * T, HV), A_log=C.head_param(A_log),
                 dt_bias=C.head_param(dt_bias))
    common: Dict[str, Any] = dict(layout=layout, scale=None if scale is None else float(scale),
                                  use_qk_l2norm=bool(use_qk_l2norm), **gates)
    idx = C.int32(in_idx)
    separate = out_idx is not None and not _same_tensor(out_idx, in_idx)
    commit_to: List[Tuple[Tensor, int]] = []  # (slots, kept tokens): gdnkit's commit from the cache
    if update and separate:
        assert out_idx is not None
        commit_to.append((C.int32(out_idx), T))
    if ssm_idx is not None:
        commit_to += [(C.int32(ssm_idx[:, t]), t + 1) for t in range(T)]
    writes = update  # the pool is written (in place, or by the commits)
    work = C.pool_in_place(fn, pool_name, pool) if writes else C.pool_read_only(pool)
    # an MTP call leaves the output rows of padding sequences as the caller had them
    keep = (idx < 0) if (output is not None and T > 1) else None
    out = _direct_out(output, v) if keep is None else None
    if T == 1 and inter is None and update and not commit_to:
        o = C.decode(q, k, v, work, idx, out=out, **common)
    else:
        cache = iidx = None
        if inter is not None or commit_to:
            if inter is not None and _cache_ok(inter) and inter.dtype == work.dtype:
                cache = inter
            else:
                cache = torch.empty((B, T, HV) + tuple(work.shape[2:]), dtype=work.dtype, device=q.device)
            iidx = C.arange32(B, q.device)
        o = C.verify(q, k, v, work, idx, cache, out=out, intermediate_indices=iidx,
                     update_state=update and not commit_to, num_draft_tokens=T, **common)
        for slots, kept in commit_to:
            # padding rows (negative read slot) store nothing, whatever their write slot
            dst = torch.where(idx >= 0, slots, torch.full_like(slots, -1)).contiguous()
            accepted = torch.full((B,), kept, dtype=torch.int32, device=q.device)
            torch.ops.gdnkit.commit(k, v, work, dst, accepted, None, source="cache", intermediate=cache,
                                    intermediate_indices=iidx, num_draft_tokens=T, **common)
        if inter is not None and cache is not inter:
            assert cache is not None
            inter[:B, :T].copy_(cache)
    return _to_output(o, output, keep)


def _check_decode_args(fn: str, q: Tensor, k: Tensor, v: Tensor, A_log: Tensor, a: Tensor, dt_bias: Tensor,
                       b: Tensor) -> None:
    C.check_heads(fn, q, k, v)
    B, T = q.shape[0], q.shape[1]
    HV = v.shape[2]
    for name, t in (("a", a), ("b", b)):
        if t.numel() != B * T * HV:
            raise _err(fn, f"{name} must have shape [{B}, {T}, {HV}], got {list(t.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.numel() != HV:
            raise _err(fn, f"{name} must have shape [{HV}], got {list(t.shape)}")


def _check_indices(fn: str, name: str, t: Tensor, B: int) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise _err(fn, f"{name} must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != (B,):
        raise _err(fn, f"Expected {name} shape [{B}], got {list(t.shape)}")


def _check_pool(fn: str, name: str, t: Tensor, HV: int, V: int, K: int) -> None:
    if t.dim() == 5:
        raise C.not_supported(fn, f"a uGPU state pool {name} [pool_size, HV, 2, V // 2, K]",
                            "Rubin per-die pools; pass a [pool_size, HV, V, K] pool")
    if t.dim() != 4 or tuple(t.shape[1:]) != (HV, V, K):
        raise _err(fn, f"Expected {name} shape [pool_size, HV={HV}, V={V}, K={K}], got {list(t.shape)}")
    if t.stride(-1) != 1:
        raise _err(fn, f"{name} must be K-contiguous (stride[-1] == 1), got stride={tuple(t.stride())}")
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise _err(fn, f"{name} must be float32 or bfloat16, got {t.dtype}")


def _check_inter(fn: str, t: Tensor, B: int, T: int, HV: int, V: int, K: int, state_dtype: torch.dtype) -> None:
    if t.dim() != 5 or t.shape[0] < B or t.shape[1] < T or tuple(t.shape[2:]) != (HV, V, K):
        raise _err(fn, f"intermediate_states_buffer must have shape [>={B}, >={T}, {HV}, {V}, {K}], "
                       f"got {list(t.shape)}")
    if t.dtype != state_dtype:
        raise _err(fn, f"intermediate_states_buffer must have the state's dtype {state_dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise _err(fn, "intermediate_states_buffer must be contiguous")


@torch.compiler.disable
def gated_delta_rule_decode_pretranspose(q: Tensor, k: Tensor, v: Tensor, state: Optional[Tensor], A_log: Tensor,
                                         a: Tensor, dt_bias: Tensor, b: Tensor, scale: Optional[float] = None,
                                         output: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                                         initial_state: Optional[Tensor] = None,
                                         initial_state_indices: Optional[Tensor] = None,
                                         output_state_indices: Optional[Tensor] = None,
                                         intermediate_states_buffer: Optional[Tensor] = None,
                                         disable_state_update: bool = False,
                                         backend: Literal["auto", "flashinfer", "cake_gdn", "rubin"] = "auto",
                                         ) -> Tuple[Tensor, Tensor]:
    """FlashInfer's ``flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose`` (K-last state), by gdnkit.

    T = 1 is gdnkit's decode (in place); T > 1 its verify recurrence (a chain).

    Args:
        q, k: ``[B, T, H, K]``, bfloat16, float16 or float32.
        v: ``[B, T, HV, V]``, q's dtype.
        state: ``[B, HV, V, K]`` float32 or bfloat16, updated in place; or None with ``initial_state``.
        A_log: ``[HV]`` float32. dt_bias: ``[HV]`` float32 or bfloat16.
        a, b: ``[B, T, HV]`` raw gate projections (``g = -exp(A_log) * softplus(a + dt_bias)``,
            ``beta = sigmoid(b)``).
        scale: query scale; None: ``1 / sqrt(K)``.
        output: ``[B, T, HV, V]`` written in place (cast to its dtype), or None.
        use_qk_l2norm: L2-normalize q and k per head.
        initial_state: the pool ``[P, HV, V, K]`` float32 or bfloat16, read and written in place at
            ``initial_state_indices``; or None.
        initial_state_indices: ``[B]`` int32/int64 slots (negative: padding, no state I/O, output 0).
        output_state_indices: ``[B]`` slots the updated states go to instead (negative: not stored).
        intermediate_states_buffer: ``[>=B, >=T, HV, V, K]`` in the state's dtype: the state after every token
            of sequence b at ``[b, t]`` (T > 1 only).
        disable_state_update: do not store the final state (T > 1 only).
        backend: FlashInfer's kernel choice; checked, no effect. A 5-dim (uGPU) pool is not supported.

    Returns:
        ``(output, state)``: output ``[B, T, HV, V]``; ``initial_state`` in pool mode, else ``state``.
    """
    fn = "gated_delta_rule_decode_pretranspose"
    if backend not in _DECODE_BACKENDS:
        raise _err(fn, f"unsupported GDN backend: {backend!r}")
    _check_decode_args(fn, q, k, v, A_log, a, dt_bias, b)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if T == 1 and intermediate_states_buffer is not None:
        raise _err(fn, "intermediate_states_buffer is supported only for T > 1")
    if T == 1 and disable_state_update:
        raise _err(fn, "disable_state_update is supported only for T > 1")
    use_pool = initial_state is not None
    if use_pool != (initial_state_indices is not None):
        raise _err(fn, "initial_state and initial_state_indices must be provided together")
    if output_state_indices is not None:
        if not use_pool:
            raise _err(fn, "output_state_indices can only be used with initial_state (pool mode)")
        _check_indices(fn, "output_state_indices", output_state_indices, B)
    if use_pool:
        assert initial_state is not None and initial_state_indices is not None
        _check_pool(fn, "initial_state", initial_state, HV, V, K)
        _check_indices(fn, "initial_state_indices", initial_state_indices, B)
        pool, in_idx = initial_state, initial_state_indices
    else:
        if state is None:
            raise _err(fn, "Either state or initial_state must be provided")
        if tuple(state.shape) != (B, HV, V, K):
            raise _err(fn, f"Expected state shape [B={B}, HV={HV}, V={V}, K={K}], got {list(state.shape)}")
        if state.dtype not in (torch.float32, torch.bfloat16):
            raise _err(fn, f"state must be float32 or bfloat16, got {state.dtype}")
        pool, in_idx = state, C.arange32(B, q.device)
    if intermediate_states_buffer is not None:
        _check_inter(fn, intermediate_states_buffer, B, T, HV, V, K, pool.dtype)
    C.require_no_grad(fn, q, k, v, a, b, A_log, dt_bias, pool)
    o = _recurrent(fn, q, k, v, pool, in_idx, output_state_indices, A_log, a, dt_bias, b, scale, use_qk_l2norm,
                   output, intermediate_states_buffer, not disable_state_update, None,
                   "initial_state" if use_pool else "state")
    return o, pool


@torch.compiler.disable
def gated_delta_rule_mtp(q: Tensor, k: Tensor, v: Tensor, initial_state: Tensor, initial_state_indices: Tensor,
                         A_log: Tensor, a: Tensor, dt_bias: Tensor, b: Tensor, scale: Optional[float] = None,
                         output: Optional[Tensor] = None, intermediate_states_buffer: Optional[Tensor] = None,
                         ssm_state_indices: Optional[Tensor] = None, disable_state_update: Optional[bool] = None,
                         use_qk_l2norm: bool = True, output_state_indices: Optional[Tensor] = None,
                         cache_replayssm: bool = False, replayssm_rawv: Optional[Tensor] = None,
                         replayssm_rawk: Optional[Tensor] = None, replayssm_g: Optional[Tensor] = None,
                         replayssm_beta: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """FlashInfer's ``flashinfer.gdn_decode.gated_delta_rule_mtp`` (multi-token verify), by gdnkit's verify.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (bfloat16, float16 or float32).
        initial_state: the pool ``[P, HV, V, K]`` (K-last), float32 (or bfloat16).
        initial_state_indices: ``[B]`` read slots; negative: padding (no state I/O; the output row is 0, or
            left as it was in ``output``).
        A_log, a, dt_bias, b: gates as in :func:`gated_delta_rule_decode_pretranspose`.
        scale: query scale; None: ``1 / sqrt(K)``.
        output: ``[B, T, HV, V]`` written in place, or None.
        intermediate_states_buffer: ``[>=B, >=T, HV, V, K]`` in the pool's dtype, contiguous: the state after
            token t of sequence b at ``[b, t]``; or None.
        ssm_state_indices: ``[B, T]`` int32: the state after token t of sequence b goes to pool slot
            ``ssm_state_indices[b, t]`` (and not to the read slot); needs ``disable_state_update=False``.
        disable_state_update: do not store the final state. None: True, with FlashInfer's deprecation warning.
        use_qk_l2norm: L2-normalize q and k per head.
        output_state_indices: ``[B]`` write slots (default: the read slots; negative: not stored).
        cache_replayssm, replayssm_*: not supported (FlashInfer's SM100 ReplaySSM cache).

    Returns:
        ``(output, initial_state)``.
    """
    fn = "gated_delta_rule_mtp"
    if cache_replayssm or any(t is not None for t in (replayssm_rawv, replayssm_rawk, replayssm_g, replayssm_beta)):
        raise C.not_supported(fn, "cache_replayssm / replayssm_* buffers", "FlashInfer's SM100 ReplaySSM window cache")
    if disable_state_update is None:
        global _mtp_default_warned
        if not _mtp_default_warned:
            _mtp_default_warned = True
            warnings.warn("gated_delta_rule_mtp(): the 'disable_state_update' parameter currently defaults to True, "
                          "as in FlashInfer 0.7.2, whose default becomes False in 0.8.0; pass it explicitly.",
                          FutureWarning, stacklevel=2)
        disable_state_update = True
    _check_decode_args(fn, q, k, v, A_log, a, dt_bias, b)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_pool(fn, "initial_state", initial_state, HV, V, K)
    _check_indices(fn, "initial_state_indices", initial_state_indices, B)
    if output_state_indices is not None:
        _check_indices(fn, "output_state_indices", output_state_indices, B)
    if intermediate_states_buffer is not None:
        _check_inter(fn, intermediate_states_buffer, B, T, HV, V, K, initial_state.dtype)
    if ssm_state_indices is not None:
        if intermediate_states_buffer is not None:
            raise _err(fn, "ssm_state_indices and intermediate_states_buffer are mutually exclusive")
        if disable_state_update:
            raise _err(fn, "ssm_state_indices requires state writes; disable_state_update must be False")
        if T < 2:
            raise _err(fn, f"ssm_state_indices requires T >= 2 (got T={T})")
        if tuple(ssm_state_indices.shape) != (B, T) or ssm_state_indices.dtype != torch.int32:
            raise _err(fn, f"ssm_state_indices must be int32 of shape [B={B}, T={T}], got "
                           f"{ssm_state_indices.dtype} {list(ssm_state_indices.shape)}")
    C.require_no_grad(fn, q, k, v, a, b, A_log, dt_bias, initial_state)
    o = _recurrent(fn, q, k, v, initial_state, initial_state_indices, output_state_indices, A_log, a, dt_bias, b,
                   scale, use_qk_l2norm, output, intermediate_states_buffer, not disable_state_update,
                   ssm_state_indices, "initial_state")
    return o, initial_state


@torch.compiler.disable
def gated_delta_rule_decode(q: Tensor, k: Tensor, v: Tensor, state: Tensor, A_log: Tensor, a: Tensor,
                            dt_bias: Tensor, b: Tensor, scale: Optional[float] = None,
                            output: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                            backend: Literal["auto", "flashinfer", "cake_gdn"] = "auto") -> Tuple[Tensor, Tensor]:
    """FlashInfer's ``flashinfer.gdn_decode.gated_delta_rule_decode`` (K-major state ``[B, HV, K, V]``), by
    gdnkit's decode with the V-last layout.

    Args:
        q, k: ``[B, 1, H, K]``; v: ``[B, 1, HV, V]``.
        state: ``[B, HV, K, V]`` float32 (or bfloat16), updated in place.
        A_log, a, dt_bias, b, scale, output, use_qk_l2norm: as in :func:`gated_delta_rule_decode_pretranspose`.
        backend: FlashInfer's kernel choice; checked, no effect.

    Returns:
        ``(output, state)``.
    """
    fn = "gated_delta_rule_decode"
    if backend not in _DECODE_BACKENDS[:3]:
        raise _err(fn, f"unsupported GDN backend: {backend!r}")
    _check_decode_args(fn, q, k, v, A_log, a, dt_bias, b)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if T != 1:
        raise _err(fn, f"Decode only supports T=1, got T={T}")
    if tuple(state.shape) != (B, HV, K, V):
        raise _err(fn, f"Expected state shape [B={B}, HV={HV}, K={K}, V={V}], got {list(state.shape)}")
    if state.dtype not in (torch.float32, torch.bfloat16):
        raise _err(fn, f"state must be float32 (or bfloat16), got {state.dtype}")
    C.require_no_grad(fn, q, k, v, a, b, A_log, dt_bias, state)
    o = _recurrent(fn, q, k, v, state, C.arange32(B, q.device), None, A_log, a, dt_bias, b, scale, use_qk_l2norm,
                   output, None, True, None, "state", layout="v_last")
    return o, state
