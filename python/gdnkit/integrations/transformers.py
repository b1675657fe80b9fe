"""transformers' Qwen3-Next and Qwen3.5 Gated DeltaNet layers on gdnkit: prefill and decode, with the model's cache.

    import gdnkit.integrations.transformers as gdnkit_tf

    gdnkit_tf.enable()                      # every supported layer (transformers < 5.15: see "The seam")
    out = model.generate(input_ids, max_new_tokens=32)
    gdnkit_tf.disable()

    with gdnkit_tf.enabled():               # the same, for one block
        out = model.generate(input_ids, max_new_tokens=32)

    gdnkit_tf.patch_model(model)            # this model's layers only, until unpatch_model(model)

Supported: the ``*GatedDeltaNet`` layers of the modeling modules in :data:`MODULES` (Qwen3-Next, Qwen3.5
and Qwen3.5-MoE; ``Qwen3_5ForCausalLM`` and ``Qwen3_5ForConditionalGeneration`` share one module), in
transformers 4.57 and 5.x (seen: 4.57.6, 5.10.4, 5.15.1, 5.17.0, 5.24.0). Head dims and head counts are
gdnkit's: K, V in {64, 128, 256}, the q/k heads dividing the value heads (the defaults of Qwen3NextConfig and
Qwen3_5TextConfig, 128-dim heads with 16 q/k and 32 value heads, qualify).

The seam. Each layer computes its projections, short convolution, gates ``g`` (log decay, fp32) and
``beta`` itself and then calls one of two functions with FLA's arguments: the chunked rule for a prompt
(or any call without a recurrent state), the recurrent rule for one token with a state. transformers
binds them to FLA's kernels when ``fla`` imports and to its own torch code otherwise, in one of two ways:

- transformers >= 5.15: the layer's ``forward`` calls the module functions ``torch_chunk_gated_delta_rule``
  and ``torch_recurrent_gated_delta_rule`` of its modeling module (wrappers that pick FLA or the torch
  code). ``enable()`` replaces these two module globals with dispatchers that run gdnkit while enabled
  and the function they replaced otherwise; ``patch_model`` installs the same dispatchers and turns them
  on only inside the forward of that model's layers (forward hooks and a context variable).
- transformers 4.57 - 5.14: ``__init__`` stores ``chunk_gated_delta_rule or torch_chunk_gated_delta_rule``
  (FLA's function, None without fla) in ``self.chunk_gated_delta_rule``, likewise for
  ``self.recurrent_gated_delta_rule``. ``patch_model`` replaces these instance attributes; ``enable()``
  replaces the module globals, so it reaches the layers built after the call: patch models built
  before it with ``patch_model``.

Nothing of the layers is copied: their own code runs, only these two calls go to gdnkit.

What runs. The chunked rule is gdnkit's chunked prefill (``torch.ops.gdnkit.prefill``) over ``B``
sequences of ``T`` tokens, or over the packed sequences of ``cu_seqlens`` when the model passes them
(transformers forwards ``cu_seq_lens_q`` of padding-free batches; B is then 1). The recurrent rule is
gdnkit's decode for one token per sequence, the prefill otherwise. Padding needs nothing here: the layer
zeroes the hidden states of masked tokens before its projections (as on its own path), so gdnkit gets
the inputs transformers' functions get.

The cache. The state is the layer's ``[B, HV, K, V]`` (gdnkit's ``v_last`` layout) as in transformers'
cache; the returned final state is a new float32 tensor (as FLA's and the torch code's are), which the
layer stores in its cache itself; ``initial_state`` is read, never modified (decode updates a float32
copy). The output has the layer's dtype.

Copies. q, k, v and the gates are passed to gdnkit as they are where the kernels read them (any token
and head stride, last dim contiguous, batch axis continuing the token axis, rows that do not overlap,
16-byte aligned token rows on CUDA), else as one contiguous copy each. transformers hands over views of
its convolution's ``[B, C, T]`` output transposed to ``[B, T, C]``, whose channel stride is T: after a
prompt those are copied; the single-token decode views (channel stride 1) are passed as they are.
Inputs of another dtype than float32 / bfloat16 / float16 (a float64 model) are computed in float32 and
the output converted back, as transformers' torch code does.

Falls back to the function it replaced (with one warning per reason) where gdnkit cannot serve the call:
autograd (an input requires grad with grad mode on: gdnkit is forward-only) and devices other than CPU
and CUDA. Invalid shapes raise :class:`gdnkit.GdnkitError` as the ops do.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import sys
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import transformers
from torch import Tensor

from .. import torch_ops  # noqa: F401  (registers torch.ops.gdnkit.*)
from .._gdnkit import GdnkitError

__all__ = [
    "MODULES",
    "TRANSFORMERS_VERSION",
    "chunk_gated_delta_rule",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "patch_model",
    "recurrent_gated_delta_rule",
    "unpatch_model",
]

TRANSFORMERS_VERSION: str = getattr(transformers, "__version__", "unknown")

#: The modeling modules whose ``*GatedDeltaNet`` layers are served (those missing from the installed
#: transformers are skipped).
MODULES: Tuple[str, ...] = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)

# Module globals that a layer calls (>= 5.15: the torch_* names) or binds in __init__ (< 5.15: all four),
# and which rule each one is.
_GLOBALS: Dict[str, str] = {
    "torch_chunk_gated_delta_rule": "chunk",
    "torch_recurrent_gated_delta_rule": "recurrent",
    "chunk_gated_delta_rule": "chunk",
    "fused_recurrent_gated_delta_rule": "recurrent",
}
_TORCH_GLOBAL = {"chunk": "torch_chunk_gated_delta_rule", "recurrent": "torch_recurrent_gated_delta_rule"}
# Instance attributes holding the two rules (< 5.15).
_LAYER_ATTRS: Dict[str, str] = {"chunk_gated_delta_rule": "chunk", "recurrent_gated_delta_rule": "recurrent"}

_TOKEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)


# ---- the two rules on gdnkit ------------------------------------------------------------------

_VECTOR_BYTES = 16  # the CUDA kernels load token rows in 16-byte vectors


def _readable(x: Tensor, dim: int) -> bool:
    """Whether the kernels read ``x`` ``[B, T, heads(, dim)]`` in place (dim 1: a per-head scalar without
    the last axis): batch axis continuing the token axis, last dim contiguous, rows that do not overlap,
    and on CUDA token rows 16-byte aligned. The binding reads the token and head strides."""
    B, T, heads = x.shape[0], x.shape[1], x.shape[2]
    count = B * T
    if count == 0:
        return True
    if B > 1 and T > 1 and x.stride(0) != T * x.stride(1):
        return False
    ts = x.stride(0) if T == 1 else x.stride(1)
    hs = x.stride(2)
    if dim > 1 and x.stride(3) != 1:
        return False
    if (heads > 1 and hs < dim) or (count > 1 and ts < (heads - 1) * (hs if heads > 1 else 0) + dim):
        return False  # overlapping rows (expand)
    if x.is_cuda and dim > 1:
        step = _VECTOR_BYTES // x.element_size()
        if torch.compiler.is_compiling():  # fake tensors have no address; allocations are aligned
            offset_ok = x.storage_offset() % step == 0
        else:
            offset_ok = x.data_ptr() % _VECTOR_BYTES == 0
        if not offset_ok or (heads > 1 and hs % step) or (count > 1 and ts % step):
            return False
    return True


def _rows(x: Tensor) -> Tensor:
    """q / k / v ``[B, T, heads, dim]`` as the kernels read them: the tensor itself where they can
    (:func:`_readable`), else one contiguous copy (transformers' transposed convolution output)."""
    return x if _readable(x, x.shape[3]) else x.contiguous()


def _gate(x: Tensor, name: str, shape: Tuple[int, int, int], fp32: bool) -> Tensor:
    """g / beta ``[B, T, HV]``: any strides whose rows do not overlap; g float32."""
    if tuple(x.shape) != shape:
        raise GdnkitError(f"gdnkit.integrations.transformers: {name} must be [B, T, HV] = {list(shape)}, "
                          f"got {list(x.shape)}")
    if fp32 or x.dtype not in _TOKEN_DTYPES:
        x = x.float()
    return x if _readable(x, 1) else x.contiguous()


def _arange32(n: int, device: torch.device) -> Tensor:
    return torch.arange(n, dtype=torch.int32, device=device)


def _fixed_cu_seqlens(B: int, T: int, device: torch.device) -> Tensor:
    if T == 0:
        return torch.zeros(B + 1, dtype=torch.int32, device=device)
    return torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device)


def _check_state(initial_state: Optional[Tensor], N: int, HV: int, K: int, V: int) -> None:
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise GdnkitError(f"gdnkit.integrations.transformers: initial_state must be [N, HV, K, V] = "
                          f"{[N, HV, K, V]}, got {list(initial_state.shape)}")


def _fresh_pool(initial_state: Optional[Tensor], N: int, HV: int, K: int, V: int, device: torch.device) -> Tensor:
    """A float32 pool the op may write: a copy of initial_state (never modified) or zeros."""
    if initial_state is None:
        return torch.zeros((N, HV, K, V), dtype=torch.float32, device=device)
    return initial_state.to(device=device, dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)


def _run(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
         output_final_state: bool, use_qk_l2norm: bool, cu_seqlens: Optional[Tensor], scale: Optional[float],
         decode_one_token: bool) -> Tuple[Tensor, Optional[Tensor]]:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise GdnkitError("gdnkit.integrations.transformers: expected query, key [B, T, H, K] and value "
                          f"[B, T, HV, V], got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}")
    B, T, H, K = query.shape
    HV, V = value.shape[2], value.shape[3]
    device = value.device
    out_dtype = value.dtype
    if query.dtype not in _TOKEN_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        # a float64 model (or mixed dtypes): computed in float32, as transformers' torch code does
        query, key, value = query.float(), key.float(), value.float()
    q, k, v = _rows(query), _rows(key), _rows(value)
    g = _gate(g, "g", (B, T, HV), fp32=True)
    beta = _gate(beta, "beta", (B, T, HV), fp32=False)
    l2 = bool(use_qk_l2norm)

    if decode_one_token and T == 1 and cu_seqlens is None:
        _check_state(initial_state, B, HV, K, V)
        state = _fresh_pool(initial_state, B, HV, K, V, device)
        o = torch.ops.gdnkit.decode(q, k, v, state, _arange32(B, device), None, g=g, beta=beta, layout="v_last",
                                    scale=scale, use_qk_l2norm=l2)
        return (o if o.dtype == out_dtype else o.to(out_dtype)), (state if output_final_state else None)

    cu_cpu: Optional[Tensor] = None
    if cu_seqlens is not None:
        if B != 1:
            raise GdnkitError(f"gdnkit.integrations.transformers: cu_seqlens needs packed input with B = 1, got "
                              f"B = {B}")
        N = cu_seqlens.shape[0] - 1
        cu = cu_seqlens if cu_seqlens.dtype in (torch.int32, torch.int64) else cu_seqlens.long()
        if cu.device != device:
            cu = cu.to(device)
        if cu_seqlens.device.type == "cpu" and device.type != "cpu":
            cu_cpu = cu_seqlens if cu_seqlens.dtype in (torch.int32, torch.int64) else cu_seqlens.long()
    else:
        N = B
        cu = _fixed_cu_seqlens(B, T, device)
        if device.type != "cpu":  # a host copy costs nothing here and lets CUDA launch only what it needs
            cu_cpu = _fixed_cu_seqlens(B, T, torch.device("cpu"))
    _check_state(initial_state, N, HV, K, V)

    pool: Optional[Tensor] = None
    init_idx: Optional[Tensor] = None
    final_idx: Optional[Tensor] = None
    if output_final_state:
        pool = _fresh_pool(initial_state, N, HV, K, V, device)
        final_idx = _arange32(N, device)
        if initial_state is not None:
            init_idx = final_idx
    elif initial_state is not None:  # read only: no final index, so the op writes nothing
        pool = initial_state if initial_state.dtype in _STATE_DTYPES else initial_state.float()
        pool = pool.to(device).contiguous()
        init_idx = _arange32(N, device)
    o = torch.ops.gdnkit.prefill(q, k, v, cu, pool, None, None, initial_indices=init_idx, final_indices=final_idx,
                                 g=g, beta=beta, layout="v_last", scale=scale, use_qk_l2norm=l2,
                                 cu_seqlens_cpu=cu_cpu)
    return (o if o.dtype == out_dtype else o.to(out_dtype)), (pool if output_final_state else None)


def chunk_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
                           initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[Tensor] = None,
                           scale: Optional[float] = None, **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """transformers' ``torch_chunk_gated_delta_rule`` (FLA's ``chunk_gated_delta_rule``) on gdnkit's prefill.

    Args:
        query, key: ``[B, T, H, K]``; value: ``[B, T, HV, V]`` (HV a multiple of H; value head h reads
            q/k head ``h // (HV // H)``), one dtype.
        g: ``[B, T, HV]`` log-space decay; beta: ``[B, T, HV]``.
        chunk_size: accepted and ignored (gdnkit chunks internally).
        initial_state: ``[N, HV, K, V]`` or None (zeros); read, never modified.
        output_final_state: also return the final states.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head (epsilon 1e-6 inside the square root).
        cu_seqlens: ``[N+1]`` offsets of packed sequences (B = 1), or None (N = B).
        scale: query scale; None: ``1 / sqrt(K)`` (what transformers uses).
        **kwargs: the model's other keyword arguments, ignored.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in value's dtype; final_state ``[N, HV, K, V]`` float32, or
        None without ``output_final_state``.
    """
    return _run(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                scale, decode_one_token=False)


def recurrent_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[Tensor] = None,
                               scale: Optional[float] = None, **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """transformers' ``torch_recurrent_gated_delta_rule`` (FLA's ``fused_recurrent_gated_delta_rule``) on gdnkit.

    One token per sequence (T = 1, no ``cu_seqlens``) runs gdnkit's decode on a float32 copy of
    ``initial_state``; other calls its prefill. Arguments and results as :func:`chunk_gated_delta_rule`.
    """
    return _run(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                scale, decode_one_token=True)


# ---- dispatch: gdnkit where it can serve the call, the replaced function otherwise --------------------

_lock = threading.RLock()
_enabled_globally = False
# > 0 inside the forward of a layer that patch_model hooked (transformers >= 5.15)
_scope: "contextvars.ContextVar[int]" = contextvars.ContextVar("gdnkit_transformers_scope", default=0)
# modeling module name -> {global name: the object it held before the dispatchers}
_replaced: Dict[str, Dict[str, Any]] = {}
# modeling module name -> number of hooked layers relying on its dispatchers
_hooked: Dict[str, int] = {}
_warned: set = set()

_PATCH_ATTR = "_gdnkit_transformers_patch"


def _warn_once(reason: str, message: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _fallback_reason(tensors: Iterable[Any]) -> Optional[str]:
    grad = torch.is_grad_enabled()
    for t in tensors:
        if not isinstance(t, Tensor):
            continue
        if t.device.type not in ("cpu", "cuda"):
            return f"device {t.device.type}"
        if grad and t.requires_grad:
            return "autograd"
    return None


def _serve(rule: str, original: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Run ``rule`` on gdnkit, or ``original`` where gdnkit cannot serve the call."""
    reason = _fallback_reason(list(args[:5]) + [kwargs.get(n) for n in ("g", "beta", "initial_state")])
    if reason is not None:
        _warn_once(reason, f"gdnkit.integrations.transformers: {reason} is not served by gdnkit (forward-only, CPU "
                   f"and CUDA); these calls run transformers' own function")
        return original(*args, **kwargs)
    # looked up at call time, so tests (and users) can wrap the module functions
    impl = globals()["chunk_gated_delta_rule" if rule == "chunk" else "recurrent_gated_delta_rule"]
    return impl(*args, **kwargs)


def _describe(wrapper: Callable[..., Any], original: Any, rule: str) -> None:
    for attr in ("__module__", "__name__", "__qualname__"):
        value = getattr(original, attr, None)
        if isinstance(value, str):
            try:
                setattr(wrapper, attr, value)
            except (AttributeError, TypeError):
                pass
    wrapper.__doc__ = f"gdnkit dispatcher for the {rule} gated delta rule (gdnkit.integrations.transformers)"
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper._gdnkit_original = original  # type: ignore[attr-defined]


def _dispatcher(rule: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A module global's replacement: gdnkit while enabled (globally or inside a hooked layer)."""
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if _enabled_globally or _scope.get() > 0:
            return _serve(rule, original, args, kwargs)
        return original(*args, **kwargs)

    _describe(dispatch, original, rule)
    return dispatch


def _bound(rule: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A layer attribute's replacement (transformers < 5.15): always gdnkit, where it can serve the call."""
    original = getattr(original, "_gdnkit_original", original)

    def serve(*args: Any, **kwargs: Any) -> Any:
        return _serve(rule, original, args, kwargs)

    _describe(serve, original, rule)
    return serve


def _install(module: Any) -> bool:
    """Replace the module's rule globals by dispatchers (once). False when it has none."""
    name = module.__name__
    if name in _replaced:
        return True
    present = {n: module.__dict__[n] for n in _GLOBALS if n in module.__dict__}
    if not any(n in present for n in _TORCH_GLOBAL.values()):
        return False
    for n, rule in _GLOBALS.items():
        if n not in present:
            continue
        original = present[n]
        if original is None:  # FLA's name without fla (< 5.15): the torch code is what it stood for
            original = present.get(_TORCH_GLOBAL[rule])
        if original is None:
            continue
        setattr(module, n, _dispatcher(rule, original))
    _replaced[name] = present
    return True


def _uninstall_unused() -> None:
    """Restore the module globals no longer needed (neither enabled globally nor hooked layers)."""
    if _enabled_globally:
        return
    for name in list(_replaced):
        if _hooked.get(name, 0) > 0:
            continue
        module = sys.modules.get(name)
        if module is not None:
            for n, original in _replaced[name].items():
                setattr(module, n, original)
        del _replaced[name]


def _modules(names: Optional[Sequence[str]]) -> List[Any]:
    found = []
    for name in MODULES if names is None else names:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    return found


def enable(modules: Optional[Sequence[str]] = None) -> List[str]:
    """Run the Gated DeltaNet layers of ``modules`` (default :data:`MODULES`) on gdnkit until :func:`disable`.

    On transformers >= 5.15 this reaches every layer, of models built before or after the call; on older
    versions the layers built after it (use :func:`patch_model` for models that exist already).

    Returns:
        The modeling modules patched (those of ``modules`` the installed transformers has).
    """
    global _enabled_globally
    with _lock:
        done = [m.__name__ for m in _modules(modules) if _install(m)]
        if not done:
            warnings.warn(f"gdnkit.integrations.transformers: transformers {TRANSFORMERS_VERSION} has none of the "
                          f"supported modeling modules {list(MODULES if modules is None else modules)}",
                          RuntimeWarning, stacklevel=2)
        _enabled_globally = True
        return done


def disable() -> None:
    """Undo :func:`enable`: layers not patched by :func:`patch_model` run transformers' functions again."""
    global _enabled_globally
    with _lock:
        _enabled_globally = False
        _uninstall_unused()


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _enabled_globally


@contextlib.contextmanager
def enabled(modules: Optional[Sequence[str]] = None) -> Iterator[List[str]]:
    """:func:`enable` for a ``with`` block (restores the previous setting on exit)."""
    was = _enabled_globally
    done = enable(modules)
    try:
        yield done
    finally:
        if not was:
            disable()


def _layers(model: torch.nn.Module, modules: Optional[Sequence[str]]) -> List[torch.nn.Module]:
    names = set(MODULES if modules is None else modules)
    return [m for m in model.modules()
            if type(m).__module__ in names and type(m).__name__.endswith("GatedDeltaNet")]


def _enter(module: torch.nn.Module, args: Any) -> None:
    _scope.set(_scope.get() + 1)


def _leave(module: torch.nn.Module, args: Any, output: Any) -> None:
    _scope.set(max(_scope.get() - 1, 0))


def patch_model(model: torch.nn.Module, modules: Optional[Sequence[str]] = None) -> int:
    """Run this model's Gated DeltaNet layers on gdnkit (whatever :func:`enable` says) until
    :func:`unpatch_model`.

    Args:
        model: a transformers model (or any module holding such layers).
        modules: the modeling modules whose layers to patch (default :data:`MODULES`).

    Returns:
        The number of layers patched by this call (layers patched before are left as they are).

    Raises:
        ValueError: the model has no supported Gated DeltaNet layer.
    """
    layers = _layers(model, modules)
    if not layers:
        raise ValueError(f"gdnkit.integrations.transformers: {type(model).__name__} has no Gated DeltaNet layer "
                         f"of {list(MODULES if modules is None else modules)}")
    count = 0
    with _lock:
        for layer in layers:
            if getattr(layer, _PATCH_ATTR, None) is not None:
                continue
            attrs = {a: layer.__dict__[a] for a in _LAYER_ATTRS if a in layer.__dict__}
            if len(attrs) == len(_LAYER_ATTRS):  # < 5.15: the rules are instance attributes
                for a, fn in attrs.items():
                    layer.__dict__[a] = _bound(_LAYER_ATTRS[a], fn)
                patch: Dict[str, Any] = {"attrs": attrs}
            else:  # >= 5.15: the forward calls module globals
                module = sys.modules[type(layer).__module__]
                if not _install(module):
                    raise ValueError(f"gdnkit.integrations.transformers: {type(layer).__qualname__} of "
                                     f"{module.__name__} (transformers {TRANSFORMERS_VERSION}) calls no known "
                                     "gated delta rule function")
                try:
                    leave = layer.register_forward_hook(_leave, always_call=True)
                except TypeError:  # torch without always_call
                    leave = layer.register_forward_hook(_leave)
                enter = layer.register_forward_pre_hook(_enter)
                _hooked[module.__name__] = _hooked.get(module.__name__, 0) + 1
                patch = {"hooks": (enter, leave), "module": module.__name__}
            object.__setattr__(layer, _PATCH_ATTR, patch)
            count += 1
    return count


def unpatch_model(model: torch.nn.Module) -> int:
    """Undo :func:`patch_model` on this model. Returns the number of layers restored."""
    count = 0
    with _lock:
        for layer in model.modules():
            patch = getattr(layer, _PATCH_ATTR, None)
            if patch is None:
                continue
            if "attrs" in patch:
                for a, fn in patch["attrs"].items():
                    layer.__dict__[a] = fn
            else:
                for handle in patch["hooks"]:
                    handle.remove()
                _hooked[patch["module"]] -= 1
            object.__delattr__(layer, _PATCH_ATTR)
            count += 1
        _uninstall_unused()
    return count
