"""Helpers shared by the adapters: argument checks, dtype fixes, small index tensors."""

from __future__ import annotations

from typing import Optional, Union, overload

import torch
from torch import Tensor

from .. import torch_ops  # noqa: F401  (registers torch.ops.gdnkit.*)
from .._gdnkit import GdnkitError


Device = Union[torch.device, str, int]


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


def int32(t: Tensor) -> Tensor:
    """Index tensors as int32."""
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def arange32(n: int, device: Device) -> Tensor:
    """[0, 1, ..., n-1] as int32."""
    return torch.arange(n, dtype=torch.int32, device=device)


def fixed_cu_seqlens(B: int, T: int, device: Device) -> Tensor:
    """[0, T, 2T, ..., B*T] as int32."""
    if T == 0:
        return torch.zeros(B + 1, dtype=torch.int32, device=device)
    return torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device)


def check_heads(function: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k [B, T, H, K] and v [B, T, HV, V] with the same H for q and k."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise GdnkitError(f"{function}: expected q, k [B, T, H, K] and v [B, T, HV, V], got q {list(q.shape)}, "
                          f"k {list(k.shape)}, v {list(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise GdnkitError(f"{function}: q and k must have the same number of heads, got q {list(q.shape)}, "
                          f"k {list(k.shape)}")
