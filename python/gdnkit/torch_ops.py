"""torch.library custom ops over gdnkit: ``torch.ops.gdnkit.{decode,verify,commit,prefill,convert_layout}``.

Importing this module registers them. Each op declares what it mutates (the state pool, the verify
cache, prefill checkpoints, the error flag) and has a fake (meta) implementation, so torch.compile
traces them without running them and CUDA graphs capture them (CUDA ops run on the current stream and
never synchronize). Outputs are new contiguous tensors of v's shape and dtype.

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

__all__ = ["decode", "verify", "commit", "prefill", "convert_layout"]


def _stream(t: Tensor) -> int:
    return int(torch.cuda.current_stream(t.device).cuda_stream) if t.is_cuda else 0


@torch.library.custom_op("gdnkit::decode", mutates_args=("state", "error_flag"))
def decode(q: Tensor, k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, error_flag: Optional[Tensor],
           g: Optional[Tensor] = None, beta: Optional[Tensor] = None, a: Optional[Tensor] = None,
           b: Optional[Tensor] = None, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
           layout: str = "k_last", scale: Optional[float] = None, use_qk_l2norm: bool = True) -> Tensor:
    """gdnkit.decode as a custom op; returns o."""
    return ops.decode(q, k, v, state, state_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                      dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, error_flag=error_flag,
                      stream=_stream(v))


@decode.register_fake
def _(q, k, v, state, state_indices, error_flag, g=None, beta=None, a=None, b=None, A_log=None, dt_bias=None,
      layout="k_last", scale=None, use_qk_l2norm=True):
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::verify", mutates_args=("state", "intermediate", "error_flag"))
def verify(q: Tensor, k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, intermediate: Optional[Tensor],
           error_flag: Optional[Tensor], g: Optional[Tensor] = None, beta: Optional[Tensor] = None,
           a: Optional[Tensor] = None, b: Optional[Tensor] = None, A_log: Optional[Tensor] = None,
           dt_bias: Optional[Tensor] = None, layout: str = "k_last", scale: Optional[float] = None,
           use_qk_l2norm: bool = True, cu_seqlens: Optional[Tensor] = None, parent: Optional[Tensor] = None,
           intermediate_indices: Optional[Tensor] = None, update_state: bool = False,
           num_draft_tokens: int = 0) -> Tensor:
    """gdnkit.verify as a custom op; returns o."""
    return ops.verify(q, k, v, state, state_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                      dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                      parent=parent, intermediate=intermediate, intermediate_indices=intermediate_indices,
                      update_state=update_state, num_draft_tokens=num_draft_tokens, error_flag=error_flag,
                      stream=_stream(v))


@verify.register_fake
def _(q, k, v, state, state_indices, intermediate, error_flag, g=None, beta=None, a=None, b=None, A_log=None,
      dt_bias=None, layout="k_last", scale=None, use_qk_l2norm=True, cu_seqlens=None, parent=None,
      intermediate_indices=None, update_state=False, num_draft_tokens=0):
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::commit", mutates_args=("state", "error_flag"))
def commit(k: Tensor, v: Tensor, state: Tensor, state_indices: Tensor, accepted: Tensor,
           error_flag: Optional[Tensor], source: str = "cache", q: Optional[Tensor] = None, g: Optional[Tensor] = None, beta: Optional[Tensor] = None,
           a: Optional[Tensor] = None, b: Optional[Tensor] = None, A_log: Optional[Tensor] = None,
           dt_bias: Optional[Tensor] = None, layout: str = "k_last", scale: Optional[float] = None,
           use_qk_l2norm: bool = True, cu_seqlens: Optional[Tensor] = None, parent: Optional[Tensor] = None,
           intermediate: Optional[Tensor] = None, intermediate_indices: Optional[Tensor] = None,
           accepted_path: Optional[Tensor] = None, num_draft_tokens: int = 0) -> None:
    """gdnkit.commit as a custom op (updates the pool in place)."""
    ops.commit(k, v, state, state_indices, accepted, source=source, layout=layout, q=q, g=g, beta=beta, a=a, b=b,
               A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
               parent=parent, intermediate=intermediate, intermediate_indices=intermediate_indices,
               accepted_path=accepted_path, num_draft_tokens=num_draft_tokens, error_flag=error_flag,
               stream=_stream(v))


@commit.register_fake
def _(k, v, state, state_indices, accepted, error_flag, source="cache", q=None, g=None, beta=None, a=None, b=None,
      A_log=None, dt_bias=None, layout="k_last", scale=None, use_qk_l2norm=True, cu_seqlens=None, parent=None,
      intermediate=None, intermediate_indices=None, accepted_path=None, num_draft_tokens=0):
    return None


@torch.library.custom_op("gdnkit::prefill", mutates_args=("state", "checkpoints", "error_flag"))
def prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, state: Optional[Tensor],
            checkpoints: Optional[Tensor], error_flag: Optional[Tensor], initial_indices: Optional[Tensor] = None, final_indices: Optional[Tensor] = None,
            g: Optional[Tensor] = None, beta: Optional[Tensor] = None, a: Optional[Tensor] = None,
            b: Optional[Tensor] = None, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
            layout: str = "k_last", scale: Optional[float] = None, use_qk_l2norm: bool = True,
            checkpoint_interval: int = 0, checkpoint_indices: Optional[Tensor] = None,
            cu_seqlens_cpu: Optional[Tensor] = None) -> Tensor:
    """gdnkit.prefill as a custom op; returns o."""
    return ops.prefill(q, k, v, cu_seqlens, state=state, initial_indices=initial_indices,
                       final_indices=final_indices, layout=layout, g=g, beta=beta, a=a, b=b, A_log=A_log,
                       dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, checkpoints=checkpoints,
                       checkpoint_interval=checkpoint_interval, checkpoint_indices=checkpoint_indices,
                       cu_seqlens_cpu=cu_seqlens_cpu, error_flag=error_flag, stream=_stream(v))


@prefill.register_fake
def _(q, k, v, cu_seqlens, state, checkpoints, error_flag, initial_indices=None, final_indices=None, g=None,
      beta=None, a=None, b=None, A_log=None, dt_bias=None, layout="k_last", scale=None, use_qk_l2norm=True,
      checkpoint_interval=0, checkpoint_indices=None, cu_seqlens_cpu=None):
    return v.new_empty(v.shape)


@torch.library.custom_op("gdnkit::convert_layout", mutates_args=())
def convert_layout(src: Tensor, src_layout: str) -> Tensor:
    """gdnkit.convert_layout out of place: returns the pool in the other layout."""
    return ops.convert_layout(src, src_layout=src_layout, stream=_stream(src))


@convert_layout.register_fake
def _(src, src_layout):
    return src.new_empty((src.shape[0], src.shape[1], src.shape[3], src.shape[2]))
