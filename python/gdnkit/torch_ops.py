"""torch.library custom ops over gdnkit: ``torch.ops.gdnkit.{decode,verify,commit,prefill,convert_layout}``, and their
``*_fp8`` twins for float8_e4m3fn pools (each fp8 buffer's block scales right after it).

Importing this module registers them. Each op declares what it mutates (the state pool, the verify
cache, prefill checkpoints, the error flag) and has a fake (meta) implementation, so torch.compile
traces them without running them and CUDA graphs capture them (CUDA ops run on the current stream and
never synchronize). Outputs are new contiguous tensors of v's shape and dtype. Shapes, dtypes and the
meaning of every argument are those of the functions of :mod:`gdnkit.ops`.

The mutated optional arguments (``error_flag``, verify's ``intermediate``, prefill's ``state`` and
``checkpoints``) are positional without defaults (pass None when unused): torch before 2.15 drops
trailing arguments equal to their defaults before its in-place bookkeeping, which then fails on a
mutated argument that was dropped.

    o = torch.ops.gdnkit.decode(q, k, v, state, state_indices, None, a=a, b=b, A_log=A_log, dt_bias=dt_bias)

The CUDA prefill uses a workspace the library owns per device, allocated on its first call: make one
eager call before capturing a CUDA graph that contains a prefill.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ops

__all__ = ["decode", "verify", "commit", "prefill", "convert_layout", "decode_fp8", "verify_fp8", "commit_fp8",
           "prefill_fp8", "convert_layout_fp8"]


def _stream(t: Tensor) -> int:
    return int(torch.cuda.current_stream(t.device).cuda_stream) if t.is_cuda else 0


@torch.library.custom_op("gdnkit::decode", mutates_args=("state", "error_flag"))
def decode(q: Tensor, k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, error_flag: Optional[Tensor],
           g: Optional[Tensor] = None, beta: Optional[Tensor] = None, a: Optional[Tensor] = None,
           b: Optional[Tensor] = None, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
           layout: str = "k_last", scale: Optional[float] = None, use_qk_l2norm: bool = True) -> Tensor:
    """:func:`gdnkit.ops.decode` as a custom op: one token per sequence, the pool updated in place.

    Args:
        q, k: ``[B, H, K]`` (or ``[B, 1, H, K]``), float32, bfloat16 or float16.
        v: ``[B, HV, V]`` (or ``[B, 1, HV, V]``), q's dtype.
        state: ``[P, HV, V, K]`` (k_last) or ``[P, HV, K, V]`` (v_last), float32, bfloat16 or float16; mutated.
        state_indices: ``[B]`` int32 pool slots (negative: padding row).
        error_flag: ``[1]`` int32 or None; mutated (+1 per slot >= P).
        g, beta: given gates ``[B, HV]`` (g float32), or
        a, b, A_log, dt_bias: fused gating (``[B, HV]``; ``[HV]`` float32).
        layout: ``"k_last"`` or ``"v_last"``.
        scale: query scale; None: ``1 / sqrt(K)``.
        use_qk_l2norm: L2-normalize q and k per head.

    Returns:
        o, a new tensor of v's shape and dtype.
    """
    return ops.decode(q, k, v, state, state_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                      dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, error_flag=error_flag,
                      stream=_stream(v))


@decode.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, error_flag: Optional[Tensor],
      g: Optional[Tensor] = None, beta: Optional[Tensor] = None, a: Optional[Tensor] = None,
      b: Optional[Tensor] = None, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
      layout: str = "k_last", scale: Optional[float] = None, use_qk_l2norm: bool = True) -> Tensor:
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::verify", mutates_args=("state", "intermediate", "error_flag"))
def verify(q: Tensor, k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, intermediate: Optional[Tensor],
           error_flag: Optional[Tensor], g: Optional[Tensor] = None, beta: Optional[Tensor] = None,
           a: Optional[Tensor] = None, b: Optional[Tensor] = None, A_log: Optional[Tensor] = None,
           dt_bias: Optional[Tensor] = None, layout: str = "k_last", scale: Optional[float] = None,
           use_qk_l2norm: bool = True, cu_seqlens: Optional[Tensor] = None, parent: Optional[Tensor] = None,
           intermediate_indices: Optional[Tensor] = None, update_state: bool = False,
           num_draft_tokens: int = 0) -> Tensor:
    """:func:`gdnkit.ops.verify` as a custom op: score T draft tokens per sequence.

    Args:
        q, k: ``[B*T, H, K]`` or ``[B, T, H, K]`` (``[T_total, H, K]`` with cu_seqlens).
        v: ``[B*T, HV, V]`` or ``[B, T, HV, V]`` (``[T_total, HV, V]`` with cu_seqlens), q's dtype.
        state: the pool, ``[P, HV, V, K]`` (k_last) or ``[P, HV, K, V]`` (v_last); mutated (written only
            with update_state).
        state_indices: ``[B]`` int32 pool slots.
        intermediate: ``[Q, S, HV, <layout>]`` cache of the state after every token, or None; mutated.
        error_flag: ``[1]`` int32 or None; mutated.
        g, beta, a, b, A_log, dt_bias: gates per token, as in decode.
        layout, scale, use_qk_l2norm: as in decode.
        cu_seqlens: ``[B+1]`` int32 for varlen drafts, or None.
        parent: ``[B, T]`` int32 tree parents (-1: the pool state), or None for chains.
        intermediate_indices: ``[B]`` int32 cache slots (required with intermediate).
        update_state: chains only: store the state after the last token in the pool.
        num_draft_tokens: T (the longest draft with cu_seqlens); 0: from the shapes or parent.

    Returns:
        o, a new tensor of v's shape and dtype.
    """
    return ops.verify(q, k, v, state, state_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                      dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                      parent=parent, intermediate=intermediate, intermediate_indices=intermediate_indices,
                      update_state=update_state, num_draft_tokens=num_draft_tokens, error_flag=error_flag,
                      stream=_stream(v))


@verify.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, intermediate: Optional[Tensor],
      error_flag: Optional[Tensor], g: Optional[Tensor] = None, beta: Optional[Tensor] = None,
      a: Optional[Tensor] = None, b: Optional[Tensor] = None, A_log: Optional[Tensor] = None,
      dt_bias: Optional[Tensor] = None, layout: str = "k_last", scale: Optional[float] = None,
      use_qk_l2norm: bool = True, cu_seqlens: Optional[Tensor] = None, parent: Optional[Tensor] = None,
      intermediate_indices: Optional[Tensor] = None, update_state: bool = False,
      num_draft_tokens: int = 0) -> Tensor:
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::commit", mutates_args=("state", "error_flag"))
def commit(k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, accepted: Tensor,
           error_flag: Optional[Tensor], source: str = "cache", q: Optional[Tensor] = None,
           g: Optional[Tensor] = None, beta: Optional[Tensor] = None, a: Optional[Tensor] = None,
           b: Optional[Tensor] = None, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
           layout: str = "k_last", scale: Optional[float] = None, use_qk_l2norm: bool = True,
           cu_seqlens: Optional[Tensor] = None, parent: Optional[Tensor] = None,
           intermediate: Optional[Tensor] = None, intermediate_indices: Optional[Tensor] = None,
           accepted_path: Optional[Tensor] = None, num_draft_tokens: int = 0) -> None:
    """:func:`gdnkit.ops.commit` as a custom op: keep ``accepted[b]`` draft tokens in the pool.

    Args:
        k, v, state, state_indices: those of the verify call; state is mutated.
        accepted: ``[B]`` int32, the number of kept tokens of each sequence (0..T).
        error_flag: ``[1]`` int32 or None; mutated.
        source: ``"cache"`` (copy from intermediate) or ``"recompute"`` (replay the kept tokens).
        q, g, beta, a, b, A_log, dt_bias, layout, scale, use_qk_l2norm, cu_seqlens, parent, intermediate,
            intermediate_indices, num_draft_tokens: those of the verify call.
        accepted_path: ``[B, T]`` int32 kept token indices in order (required for trees), or None.
    """
    ops.commit(k, v, state, state_indices, accepted, source=source, layout=layout, q=q, g=g, beta=beta, a=a, b=b,
               A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
               parent=parent, intermediate=intermediate, intermediate_indices=intermediate_indices,
               accepted_path=accepted_path, num_draft_tokens=num_draft_tokens, error_flag=error_flag,
               stream=_stream(v))


@commit.register_fake
def _(k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, accepted: Tensor, error_flag: Optional[Tensor],
      source: str = "cache", q: Optional[Tensor] = None, g: Optional[Tensor] = None,
      beta: Optional[Tensor] = None, a: Optional[Tensor] = None, b: Optional[Tensor] = None,
      A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None, layout: str = "k_last",
      scale: Optional[float] = None, use_qk_l2norm: bool = True, cu_seqlens: Optional[Tensor] = None,
      parent: Optional[Tensor] = None, intermediate: Optional[Tensor] = None,
      intermediate_indices: Optional[Tensor] = None, accepted_path: Optional[Tensor] = None,
      num_draft_tokens: int = 0) -> None:
    return None


@torch.library.custom_op("gdnkit::prefill", mutates_args=("state", "checkpoints", "error_flag"))
def prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, state: Optional[Tensor],
            checkpoints: Optional[Tensor], error_flag: Optional[Tensor], initial_indices: Optional[Tensor] = None,
            final_indices: Optional[Tensor] = None, g: Optional[Tensor] = None, beta: Optional[Tensor] = None,
            a: Optional[Tensor] = None, b: Optional[Tensor] = None, A_log: Optional[Tensor] = None,
            dt_bias: Optional[Tensor] = None, layout: str = "k_last", scale: Optional[float] = None,
            use_qk_l2norm: bool = True, checkpoint_interval: int = 0, checkpoint_indices: Optional[Tensor] = None,
            cu_seqlens_cpu: Optional[Tensor] = None) -> Tensor:
    """:func:`gdnkit.ops.prefill` as a custom op: chunked prefill of N packed sequences.

    Args:
        q, k: ``[T_total, H, K]`` (or ``[B, T, H, K]``), float32, bfloat16 or float16.
        v: ``[T_total, HV, V]`` (or ``[B, T, HV, V]``), q's dtype.
        cu_seqlens: ``[N+1]`` int32 or int64 sequence offsets (required here).
        state: the pool, ``[P, HV, V, K]`` (k_last) or ``[P, HV, K, V]`` (v_last), or None; mutated.
        checkpoints: ``[Q, S, HV, <layout>]`` states every checkpoint_interval tokens, or None; mutated.
        error_flag: ``[1]`` int32 or None; mutated.
        initial_indices: ``[N]`` int32 start slots (negative: S = 0), or None.
        final_indices: ``[N]`` int32 slots for the final states (negative: not stored), or None.
        g, beta, a, b, A_log, dt_bias: gates per token, as in decode.
        layout, scale, use_qk_l2norm: as in decode.
        checkpoint_interval: tokens between checkpoints, a multiple of 64 (0: none).
        checkpoint_indices: ``[N]`` int32 checkpoint slots, or None.
        cu_seqlens_cpu: a host copy of cu_seqlens, validated before launch, or None.

    Returns:
        o, a new tensor of v's shape and dtype.
    """
    return ops.prefill(q, k, v, cu_seqlens, state=state, initial_indices=initial_indices,
                       final_indices=final_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                       dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, checkpoints=checkpoints,
                       checkpoint_interval=checkpoint_interval, checkpoint_indices=checkpoint_indices,
                       cu_seqlens_cpu=cu_seqlens_cpu, error_flag=error_flag, stream=_stream(v))


@prefill.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, state: Optional[Tensor], checkpoints: Optional[Tensor],
      error_flag: Optional[Tensor], initial_indices: Optional[Tensor] = None,
      final_indices: Optional[Tensor] = None, g: Optional[Tensor] = None, beta: Optional[Tensor] = None,
      a: Optional[Tensor] = None, b: Optional[Tensor] = None, A_log: Optional[Tensor] = None,
      dt_bias: Optional[Tensor] = None, layout: str = "k_last", scale: Optional[float] = None,
      use_qk_l2norm: bool = True, checkpoint_interval: int = 0, checkpoint_indices: Optional[Tensor] = None,
      cu_seqlens_cpu: Optional[Tensor] = None) -> Tensor:
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::convert_layout", mutates_args=())
def convert_layout(src: Tensor, src_layout: str) -> Tensor:
    """:func:`gdnkit.ops.convert_layout` out of place.

    Args:
        src: ``[P, HV, V, K]`` (k_last) or ``[P, HV, K, V]`` (v_last), float32, bfloat16 or float16.
        src_layout: ``"k_last"`` or ``"v_last"``, the layout of src.

    Returns:
        The pool in the other layout: a new tensor of src's dtype with the last two dims swapped.
    """
    return ops.convert_layout(src, src_layout=src_layout, stream=_stream(src))


@convert_layout.register_fake
def _(src: Tensor, src_layout: str) -> Tensor:
    return src.new_empty((src.shape[0], src.shape[1], src.shape[3], src.shape[2]))


# ---- float8_e4m3fn pools: the same ops with the block scales beside each fp8 state (mutated with it) ---------------
# Separate ops, so that the signatures above stay as they are: each takes the scales right after the state they
# belong to, positional like every mutated argument (uint8 or float8_e8m0fnu, [entries, HV*K*V/32]).

@torch.library.custom_op("gdnkit::decode_fp8", mutates_args=("state", "state_scales", "error_flag"))
def decode_fp8(q: Tensor, k: Tensor, v: Tensor, state: Tensor, state_scales: Tensor, state_indices: Tensor,
               error_flag: Optional[Tensor], g: Optional[Tensor] = None, beta: Optional[Tensor] = None,
               a: Optional[Tensor] = None, b: Optional[Tensor] = None, A_log: Optional[Tensor] = None,
               dt_bias: Optional[Tensor] = None, layout: str = "k_last", scale: Optional[float] = None,
               use_qk_l2norm: bool = True) -> Tensor:
    """:func:`decode` on a float8_e4m3fn pool and its block scales (both mutated)."""
    return ops.decode(q, k, v, state, state_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                      dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, error_flag=error_flag,
                      stream=_stream(v), state_scales=state_scales)


@decode_fp8.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: object, **kwargs: object) -> Tensor:  # (the op's arguments)
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::verify_fp8",
                         mutates_args=("state", "state_scales", "intermediate", "intermediate_scales", "error_flag"))
def verify_fp8(q: Tensor, k: Tensor, v: Tensor, state: Tensor, state_scales: Tensor, state_indices: Tensor,
               intermediate: Optional[Tensor], intermediate_scales: Optional[Tensor], error_flag: Optional[Tensor],
               g: Optional[Tensor] = None, beta: Optional[Tensor] = None, a: Optional[Tensor] = None,
               b: Optional[Tensor] = None, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
               layout: str = "k_last", scale: Optional[float] = None, use_qk_l2norm: bool = True,
               cu_seqlens: Optional[Tensor] = None, parent: Optional[Tensor] = None,
               intermediate_indices: Optional[Tensor] = None, update_state: bool = False,
               num_draft_tokens: int = 0) -> Tensor:
    """:func:`verify` on a float8_e4m3fn pool (and cache, with its scales: a cache of another dtype takes None)."""
    return ops.verify(q, k, v, state, state_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                      dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                      parent=parent, intermediate=intermediate, intermediate_indices=intermediate_indices,
                      update_state=update_state, num_draft_tokens=num_draft_tokens, error_flag=error_flag,
                      stream=_stream(v), state_scales=state_scales, intermediate_scales=intermediate_scales)


@verify_fp8.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: object, **kwargs: object) -> Tensor:  # (the op's arguments)
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::commit_fp8", mutates_args=("state", "state_scales", "error_flag"))
def commit_fp8(k: Tensor, v: Tensor, state: Tensor, state_scales: Tensor, state_indices: Tensor, accepted: Tensor,
               error_flag: Optional[Tensor], source: str = "cache", q: Optional[Tensor] = None,
               g: Optional[Tensor] = None, beta: Optional[Tensor] = None, a: Optional[Tensor] = None,
               b: Optional[Tensor] = None, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
               layout: str = "k_last", scale: Optional[float] = None, use_qk_l2norm: bool = True,
               cu_seqlens: Optional[Tensor] = None, parent: Optional[Tensor] = None,
               intermediate: Optional[Tensor] = None, intermediate_scales: Optional[Tensor] = None,
               intermediate_indices: Optional[Tensor] = None, accepted_path: Optional[Tensor] = None,
               num_draft_tokens: int = 0) -> None:
    """:func:`commit` into a float8_e4m3fn pool (the cache, read only here, with its scales where it is fp8)."""
    ops.commit(k, v, state, state_indices, accepted, source=source, layout=layout, q=q, g=g, beta=beta, a=a, b=b,
               A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
               parent=parent, intermediate=intermediate, intermediate_indices=intermediate_indices,
               accepted_path=accepted_path, num_draft_tokens=num_draft_tokens, error_flag=error_flag,
               stream=_stream(v), state_scales=state_scales, intermediate_scales=intermediate_scales)


@commit_fp8.register_fake
def _(*args: object, **kwargs: object) -> None:  # (the op's arguments: it returns nothing)
    return None


@torch.library.custom_op("gdnkit::prefill_fp8",
                         mutates_args=("state", "state_scales", "checkpoints", "checkpoint_scales", "error_flag"))
def prefill_fp8(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, state: Tensor, state_scales: Tensor,
                checkpoints: Optional[Tensor], checkpoint_scales: Optional[Tensor], error_flag: Optional[Tensor],
                initial_indices: Optional[Tensor] = None, final_indices: Optional[Tensor] = None,
                g: Optional[Tensor] = None, beta: Optional[Tensor] = None, a: Optional[Tensor] = None,
                b: Optional[Tensor] = None, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                layout: str = "k_last", scale: Optional[float] = None, use_qk_l2norm: bool = True,
                checkpoint_interval: int = 0, checkpoint_indices: Optional[Tensor] = None,
                cu_seqlens_cpu: Optional[Tensor] = None) -> Tensor:
    """:func:`prefill` on a float8_e4m3fn pool (and checkpoints, with their scales where they are fp8)."""
    return ops.prefill(q, k, v, cu_seqlens, state=state, initial_indices=initial_indices,
                       final_indices=final_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                       dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, checkpoints=checkpoints,
                       checkpoint_interval=checkpoint_interval, checkpoint_indices=checkpoint_indices,
                       cu_seqlens_cpu=cu_seqlens_cpu, error_flag=error_flag, stream=_stream(v),
                       state_scales=state_scales, checkpoint_scales=checkpoint_scales)


@prefill_fp8.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: object, **kwargs: object) -> Tensor:  # (the op's arguments)
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::convert_layout_fp8", mutates_args=())
def convert_layout_fp8(src: Tensor, src_scales: Tensor, src_layout: str) -> tuple[Tensor, Tensor]:
    """:func:`convert_layout` of a float8_e4m3fn pool out of place: the converted pool and its new block scales."""
    dst = src.new_empty((src.shape[0], src.shape[1], src.shape[3], src.shape[2]))
    dst_scales = torch.empty_like(src_scales)
    ops.convert_layout(src, src_layout=src_layout, dst=dst, src_scales=src_scales, dst_scales=dst_scales,
                       stream=_stream(src))
    return dst, dst_scales


@convert_layout_fp8.register_fake
def _(src: Tensor, src_scales: Tensor, src_layout: str) -> tuple[Tensor, Tensor]:
    return src.new_empty((src.shape[0], src.shape[1], src.shape[3], src.shape[2])), torch.empty_like(src_scales)
