"""The peers' own GDN functions for the adapter tests: imported when the peer is installed, else loaded from its
released sources.

vLLM and SGLang rarely install beside the PyTorch a GPU machine has (vLLM 0.33.0 pins its own torch; SGLang's
package pulls its serving stack), yet their GDN ops are plain Python and Triton. When the package does not import,
the modules of those ops are loaded from a directory of released sources, ``GDNKIT_PEER_SOURCES`` (written by
``tools/fetch-peer-sources.sh``): the peer's own files, unchanged, with the few framework helpers they import
(platform queries, ceil-div, a host-to-device copy) provided by the small stand-ins below while they load.
The stand-ins leave ``sys.modules`` as it was once loading ends; the loaded modules go under a private name.

    ops = vllm_fla_ops()                       # None when neither the package nor the sources are there
    fn = sglang_fused_sigmoid_gating()         # SGLang's fused_sigmoid_gating_delta_rule_update, or None
    why_missing("vllm")                        # the skip reason
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Callable, Dict, Optional

ENV = "GDNKIT_PEER_SOURCES"

VLLM_PACKAGES = ("vllm.third_party.flash_linear_attention.ops", "vllm.model_executor.layers.fla.ops")
VLLM_SOURCE = "vllm/third_party/flash_linear_attention/ops"
VLLM_FUNCTIONS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                  "fused_recurrent_gated_delta_rule_packed_decode", "fused_sigmoid_gating_delta_rule_update")
# module of each function inside the ops package (the package's __init__ also imports layers we do not need)
VLLM_MODULES = {"chunk_gated_delta_rule": "chunk", "fused_recurrent_gated_delta_rule": "fused_recurrent",
                "fused_recurrent_gated_delta_rule_packed_decode": "fused_recurrent",
                "fused_sigmoid_gating_delta_rule_update": "fused_sigmoid_gating"}

SGLANG_MODULES = ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",
                  "sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent")
SGLANG_SOURCE = "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py"

_missing: Dict[str, str] = {}


def _sources() -> Optional[Path]:
    d = os.environ.get(ENV)
    return Path(d) if d else None


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


@contextlib.contextmanager
def _stand_ins(modules: Dict[str, types.ModuleType]):
    """Puts `modules` in sys.modules while the peer's files load, then restores what was there."""
    saved = {n: sys.modules.get(n) for n in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _packages(*names: str) -> Dict[str, types.ModuleType]:
    """Empty parent packages, so that `vllm.x.y` resolves without running the peer's own __init__ files."""
    out = {}
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            n = ".".join(parts[:i])
            out.setdefault(n, _module(n, __path__=[]))
    return out


def _capability(device=None):
    import torch
    return torch.cuda.get_device_capability(device)


def _vllm_stand_ins() -> Dict[str, types.ModuleType]:
    import torch
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    class Platform:  # vllm.platforms.current_platform on an NVIDIA GPU
        @staticmethod
        def is_rocm():
            return False

        @staticmethod
        def is_cuda():
            return True

        @staticmethod
        def is_cuda_alike():
            return True

        @staticmethod
        def is_device_capability_family(family, device_id=None):
            major, minor = _capability(device_id)
            return (major * 10 + minor) // 10 == family // 10

        @staticmethod
        def is_arch_support_pdl():
            return _capability()[0] >= 9

    def async_tensor_h2d(data, device=None, dtype=None, out=None):
        t = torch.as_tensor(data, dtype=dtype if dtype is not None else (out.dtype if out is not None else None))
        if out is not None:
            return out.copy_(t, non_blocking=True)
        return t.to(device, non_blocking=True)

    mods = _packages("vllm.utils")
    mods.update({
        "vllm.triton_utils": _module("vllm.triton_utils", triton=triton, tl=tl, tldevice=tldevice),
        "vllm.platforms": _module("vllm.platforms", current_platform=Platform()),
        "vllm.utils.math_utils": _module("vllm.utils.math_utils", RCP_LN2=1.4426950216,
                                         cdiv=lambda a, b: -(a // -b),
                                         next_power_of_2=lambda n: 1 if n < 1 else 1 << (n - 1).bit_length()),
        "vllm.utils.torch_utils": _module("vllm.utils.torch_utils", async_tensor_h2d=async_tensor_h2d),
        "vllm.utils.gpu_sync_debug": _module("vllm.utils.gpu_sync_debug",
                                             gpu_sync_allowed=lambda first_only=False: contextlib.nullcontext()),
        "vllm.utils.platform_utils": _module(
            "vllm.utils.platform_utils",
            num_compute_units=lambda device=None: torch.cuda.get_device_properties(device).multi_processor_count),
    })
    return mods


def _sglang_stand_ins() -> Dict[str, types.ModuleType]:
    import torch

    def sm():
        major, minor = _capability()
        return major * 10 + minor

    mods = _packages("sglang.kernels.jit", "sglang.srt")
    mods["sglang.kernels.jit.utils"] = _module("sglang.kernels.jit.utils", is_arch_support_pdl=lambda: sm() >= 90)
    mods["sglang.srt.utils"] = _module("sglang.srt.utils", get_device_sm=sm, is_cuda=lambda: torch.version.cuda is not None,
                                       is_hip=lambda: False, is_gfx95_supported=lambda: False,
                                       is_sm90_supported=lambda: sm() >= 90 and sm() < 100)
    return mods


def _load_file(name: str, path: Path, package: Optional[str] = None) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if package is not None:
        mod.__package__ = package
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _import_first(names) -> Optional[types.ModuleType]:
    for n in names:
        try:
            return importlib.import_module(n)
        except Exception:  # noqa: BLE001 - a peer that fails to import for any reason is absent
            continue
    return None


def _load_from_sources(peer: str, rel: str, is_there: Callable[[Path], bool], stand_ins: Callable, load: Callable):
    """load(path) with the peer's stand-ins in place, for the released sources at $GDNKIT_PEER_SOURCES/rel;
    None (and the reason in why_missing) when they are absent or do not load."""
    src = _sources()
    path = src / rel if src else None
    if path is None or not is_there(path):
        _missing[peer] = f"{peer} is not importable and {ENV} has no {rel} (tools/fetch-peer-sources.sh writes it)"
        return None
    try:
        with _stand_ins(stand_ins()):
            return load(path)
    except Exception as e:  # noqa: BLE001 - a source that fails to load leaves the peer absent
        _missing[peer] = f"{peer}'s sources at {path} did not load: {type(e).__name__}: {e}"
        return None


def vllm_fla_ops() -> Optional[types.SimpleNamespace]:
    """vLLM's FLA-derived GDN functions (VLLM_FUNCTIONS) as attributes, or None (see why_missing)."""
    mod = _import_first(VLLM_PACKAGES)
    if mod is not None and all(hasattr(mod, f) for f in VLLM_FUNCTIONS):
        return types.SimpleNamespace(**{f: getattr(mod, f) for f in VLLM_FUNCTIONS}, origin=mod.__name__)

    def load(d: Path) -> types.SimpleNamespace:
        pkg = "_gdnkit_peer_vllm_fla_ops"
        sys.modules[pkg] = _module(pkg, __path__=[str(d)], __package__=pkg)
        fns = {f: getattr(importlib.import_module(f"{pkg}.{VLLM_MODULES[f]}"), f) for f in VLLM_FUNCTIONS}
        return types.SimpleNamespace(**fns, origin=str(d))

    return _load_from_sources("vllm", VLLM_SOURCE, Path.is_dir, _vllm_stand_ins, load)


def sglang_fused_sigmoid_gating() -> Optional[Callable]:
    """SGLang's fused_sigmoid_gating_delta_rule_update, or None (see why_missing)."""
    mod = _import_first(SGLANG_MODULES)
    if mod is not None and hasattr(mod, "fused_sigmoid_gating_delta_rule_update"):
        return mod.fused_sigmoid_gating_delta_rule_update
    return _load_from_sources(
        "sglang", SGLANG_SOURCE, Path.is_file, _sglang_stand_ins,
        lambda f: _load_file("_gdnkit_peer_sglang_fused_sigmoid_gating", f).fused_sigmoid_gating_delta_rule_update)


def why_missing(peer: str) -> str:
    return _missing.get(peer, f"{peer} not loaded")
