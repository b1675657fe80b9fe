"""Prefill of sequences split over ranks (context parallelism across GPUs).

Each rank holds one contiguous piece of every sequence (possibly empty); the pieces of sequence ``n`` on ranks
0, 1, ..., G-1, in that order, make the sequence. Each rank summarizes its pieces (the state from zero and the
transition ``P`` of each), the ranks all-gather the summaries, and each rank finishes its pieces from their true
initial states (docs/design/prefill.md "Split over ranks").

    import torch.distributed as dist, gdnkit.distributed
    o = gdnkit.distributed.prefill(q, k, v, cu_seqlens, group=dist.group.WORLD, state=pool,
                                   initial_indices=slots, final_indices=slots, a=a, b=b, A_log=A_log, dt_bias=dt_bias)

:func:`prefill` runs the exchange through ``torch.distributed`` (NCCL for CUDA tensors) on the current stream;
:func:`split_prefill_begin` and :func:`split_prefill_end` are the two halves around an exchange of the caller's.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _gdnkit as _C
from .ops import ArrayT, DLPackArray, _dl, _empty, _gates, _int_arg, _stream


def exchange_elems(num_seqs: int, num_v_heads: int, head_dim_k: int, head_dim_v: int) -> int:
    """float32 elements of one rank's block of the exchange: ``N * HV * K * (K + V)``."""
    return num_seqs * num_v_heads * head_dim_k * (head_dim_k + head_dim_v)


def _split(begin: bool, q: Any, k: Any, v: Any, o: Any, cu_seqlens: Any, *, rank: int, num_ranks: int,
           exchange: Any, layout: str, state: Any, initial_indices: Any, final_indices: Any, g: Any, beta: Any,
           a: Any, b: Any, A_log: Any, dt_bias: Any, scale: Optional[float], use_qk_l2norm: bool, checkpoints: Any,
           checkpoint_interval: Any, checkpoint_indices: Any, cu_seqlens_cpu: Any, piece_offsets: Any,
           piece_offsets_cpu: Any, final_on_every_rank: bool, workspace: Any, state_scales: Any,
           checkpoint_scales: Any, error_flag: Any, stream: Optional[int]) -> None:
    _C.split_prefill(_dl(q), _dl(k), _dl(v), _dl(o), _dl(cu_seqlens), begin=begin, rank=_int_arg("rank", rank),
                     num_ranks=_int_arg("num_ranks", num_ranks), exchange=_dl(exchange), layout=layout,
                     state=_dl(state), initial_indices=_dl(initial_indices), final_indices=_dl(final_indices),
                     **_gates(g, beta, a, b, A_log, dt_bias), scale=scale, use_qk_l2norm=use_qk_l2norm,
                     checkpoints=_dl(checkpoints),
                     checkpoint_interval=_int_arg("checkpoint_interval", checkpoint_interval),
                     checkpoint_indices=_dl(checkpoint_indices), cu_seqlens_cpu=_dl(cu_seqlens_cpu),
                     piece_offsets=_dl(piece_offsets), piece_offsets_cpu=_dl(piece_offsets_cpu),
                     final_on_every_rank=final_on_every_rank, workspace=_dl(workspace),
                     state_scales=_dl(state_scales), checkpoint_scales=_dl(checkpoint_scales),
                     error_flag=_dl(error_flag), stream=_stream(stream, v))


def split_prefill_begin(q: DLPackArray, k: DLPackArray, v: DLPackArray, o: DLPackArray, cu_seqlens: DLPackArray,
                        *, rank: int, num_ranks: int, exchange: DLPackArray, **kwargs: Any) -> None:
    """Writes this rank's block of ``exchange`` (``num_ranks * exchange_elems(...)`` float32, contiguous).

    The keyword arguments are :func:`prefill`'s (``layout``, ``state``, the slots, the gates, checkpoints,
    ``piece_offsets``...); ``split_prefill_end`` takes the same ones after the ranks all-gathered ``exchange``
    in place (rank ``r`` wrote block ``r``). Between the two no other prefill may use the same workspace.
    """
    _split(True, q, k, v, o, cu_seqlens, rank=rank, num_ranks=num_ranks, exchange=exchange, **_defaults(kwargs))


def split_prefill_end(q: DLPackArray, k: DLPackArray, v: DLPackArray, o: DLPackArray, cu_seqlens: DLPackArray,
                      *, rank: int, num_ranks: int, exchange: DLPackArray, **kwargs: Any) -> None:
    """Writes ``o``, the checkpoints and the final states of this rank's pieces (see :func:`split_prefill_begin`)."""
    _split(False, q, k, v, o, cu_seqlens, rank=rank, num_ranks=num_ranks, exchange=exchange, **_defaults(kwargs))


_KEYWORDS = dict(layout="k_last", state=None, initial_indices=None, final_indices=None, g=None, beta=None, a=None,
                 b=None, A_log=None, dt_bias=None, scale=None, use_qk_l2norm=True, checkpoints=None,
                 checkpoint_interval=0, checkpoint_indices=None, cu_seqlens_cpu=None, piece_offsets=None,
                 piece_offsets_cpu=None, final_on_every_rank=False, workspace=None, state_scales=None,
                 checkpoint_scales=None, error_flag=None, stream=None)


def _defaults(kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"split prefill: unexpected keyword argument {unknown[0]!r}")
    return {**_KEYWORDS, **kwargs}


def prefill(q: DLPackArray, k: DLPackArray, v: ArrayT, cu_seqlens: DLPackArray, *, group: Any = None,
            state: Optional[DLPackArray] = None, initial_indices: Optional[DLPackArray] = None,
            final_indices: Optional[DLPackArray] = None, layout: str = "k_last", g: Optional[DLPackArray] = None,
            beta: Optional[DLPackArray] = None, a: Optional[DLPackArray] = None, b: Optional[DLPackArray] = None,
            A_log: Optional[DLPackArray] = None, dt_bias: Optional[DLPackArray] = None,
            scale: Optional[float] = None, use_qk_l2norm: bool = True, checkpoints: Optional[DLPackArray] = None,
            checkpoint_interval: int = 0, checkpoint_indices: Optional[DLPackArray] = None,
            cu_seqlens_cpu: Optional[DLPackArray] = None, piece_offsets: Optional[DLPackArray] = None,
            piece_offsets_cpu: Optional[DLPackArray] = None, final_on_every_rank: bool = False,
            workspace: Optional[DLPackArray] = None, o: Optional[ArrayT] = None,
            error_flag: Optional[DLPackArray] = None, state_scales: Optional[DLPackArray] = None,
            checkpoint_scales: Optional[DLPackArray] = None) -> ArrayT:
    """Prefill of sequences split over the ranks of a ``torch.distributed`` process group.

    The arguments are :func:`gdnkit.prefill`'s for this rank's pieces (torch tensors; ``cu_seqlens`` packs the
    pieces, ``[N+1]`` with the same ``N`` on every rank), and:

    group : torch.distributed.ProcessGroup, optional
        The ranks, in piece order (None: the default group; without an initialized ``torch.distributed``,
        one rank). The exchange, ``G * N * HV * K * (K + V)`` float32, runs through its ``all_gather_into_tensor``
        on the current stream.
    initial_indices : int32 [N], optional
        Read on rank 0 only: the sequences start from rank 0's pool.
    final_indices : int32 [N], optional
        Written on the last rank (on every rank with ``final_on_every_rank``).
    piece_offsets : int64 [N], optional
        Tokens of sequence ``n`` on lower ranks: required with checkpoints on ranks other than 0 (each rank stores
        those whose token falls in its piece; such a piece must start at a multiple of 64 tokens). ``piece_offsets_cpu``:
        a host copy, validated before launch.

    Returns ``o`` of this rank's tokens. The CUDA backend runs it for bf16/fp16 inputs with ``K == V`` in
    {64, 128}; the CPU backend for every call.
    """
    import torch
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    num_ranks = dist.get_world_size(group) if distributed else 1
    if o is None:
        o = _empty(v, v.shape)
    n = int(cu_seqlens.shape[0]) - 1
    elems = exchange_elems(n, int(v.shape[-2]), int(q.shape[-1]), int(v.shape[-1]))
    exchange = torch.empty(num_ranks * elems, dtype=torch.float32, device=q.device)
    kw = dict(layout=layout, state=state, initial_indices=initial_indices, final_indices=final_indices, g=g,
              beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm,
              checkpoints=checkpoints, checkpoint_interval=checkpoint_interval,
              checkpoint_indices=checkpoint_indices, cu_seqlens_cpu=cu_seqlens_cpu, piece_offsets=piece_offsets,
              piece_offsets_cpu=piece_offsets_cpu, final_on_every_rank=final_on_every_rank, workspace=workspace,
              state_scales=state_scales, checkpoint_scales=checkpoint_scales, error_flag=error_flag, stream=None)
    _split(True, q, k, v, o, cu_seqlens, rank=rank, num_ranks=num_ranks, exchange=exchange, **kw)
    if num_ranks > 1 and elems > 0:
        dist.all_gather_into_tensor(exchange, exchange[rank * elems:(rank + 1) * elems], group=group)
    _split(False, q, k, v, o, cu_seqlens, rank=rank, num_ranks=num_ranks, exchange=exchange, **kw)
    return o
