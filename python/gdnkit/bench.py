"""gdnkit vs its peers (FLA, FlashInfer) on identical inputs: ``python -m gdnkit.bench --out DIR``.

Peers (``--peers``, default: every one that imports): FLA (``flash-linear-attention``) and FlashInfer's GDN
kernels (``flashinfer.gdn_prefill`` / ``flashinfer.gdn_decode``: an installed FlashInfer, or the prebuilt
sm_90a bundle that ``setup.sh`` of ../shared/peers/flashinfer unpacks to ``$FI_BUNDLE``, default /tmp/fi).
All peers run on the same tensors, the same heads (``--shape``, default qwen3-next: H=16, HV=32, K=V=128),
bf16 q/k/v and gate projections, and the same timing method.

Decode (T = 1): gdnkit's ``decode`` (pool-indexed, in place, slots a random permutation) vs FLA's
``fused_recurrent_gated_delta_rule`` (initial state in, final state out; fp32 states only) vs FlashInfer's
``gated_delta_rule_decode_pretranspose`` (the same pool and slots, in place), gating and q/k L2 norm in the
kernel for all. Each timed CUDA-graph replay runs one call per input set, rotating through enough sets that
the replay touches at least 4x the L2 size of state (cold L2, as in serving); the median of the replays over
the number of calls is reported in microseconds per call. ``--state fp32,bf16`` adds bf16-pool rows.

Verify: T-token chains storing the final state in the pool (no intermediate cache): gdnkit's ``verify`` vs
FLA's ``fused_recurrent_gated_delta_rule`` on the same T tokens (and FlashInfer's MTP with the state update,
where its kernels are not limited to a prebuilt set). Verify with cache (``verify_cache``): the state after
every token written to a [B, T, HV, V, K] cache, the pool not updated: gdnkit's ``verify(intermediate=...)``
vs FlashInfer's MTP (``intermediate_states_buffer``, ``disable_state_update=True``). Both timed like decode.

Prefill: gdnkit's ``prefill`` (fused gating and L2 norm, initial states read from the pool, final states
written back) vs FLA's ``chunk_gated_delta_rule`` (the same, fused in the kernel) vs FlashInfer's
``chunk_gated_delta_rule``, whose gates are inputs (``g`` the decay factor alpha = exp(log-decay), ``beta``;
computed once before timing, as the caller's gating kernel would) and whose q/k L2 norm is a separate
kernel: "FlashInfer" times its kernel on q/k normalized beforehand, "FlashInfer+l2n" the call with
``use_qk_l2norm_in_kernel=True`` (normalize kernel + prefill kernel). CUDA events around each call, warm-up
first, median of >= 10 calls (5 for the largest sets); the timed calls are queued behind a GPU spin, so the
host's time to issue them is not counted as GPU time.

Each row reports the relative difference of gdnkit's outputs and states from each peer's on the same
inputs. FlashInfer's prebuilt bundle holds kernels for its own benchmark's shapes only; other shapes are
reported as "not prebuilt" rather than called. Writes fla_compare.{json,md} (gdnkit vs FLA, as before) and
peer_compare.{json,md} (every peer) to --out, after every row. Needs PyTorch with CUDA; without a peer only
gdnkit's times are reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

# The shapes of docs/benchmarks.md: (H q/k heads, HV value heads), K = V = 128. The functions below read the
# module's H and HV, which main() sets from --shape.
SHAPES = {"qwen3-next": (16, 32), "qwen3.5-397b-tp8": (2, 8), "qwen3.5-27b": (16, 48), "qwen3.5-397b": (16, 64)}
H, HV, K, V = 16, 32, 128, 128

DECODE_BATCHES = [1, 4, 16, 64, 128, 256, 512]
VERIFY_ROWS = [(8, 2), (8, 4), (64, 2), (64, 4), (256, 4)]
# verify with the intermediate cache: FlashInfer's MTP benchmark grid (B in 1, 8, 32, 128 x T in 2, 4, 8)
VERIFY_CACHE_ROWS = [(b, t) for b in (1, 8, 32, 128) for t in (2, 4, 8)]
# NxL = N sequences of L tokens (as `gdnkit bench` and docs/benchmarks.md name them); A+B = two sequences.
# Other benchmarks' "1024x8"-style names are also read as 8 sequences of 1024 (4x2048, 8x1024, 8x8192,
# 32x8192); read literally, 2048x4 and 1024x8 are thousands of short sequences (gdnkit's short-sequence
# path). 8192x8 and 8192x32 read literally are left to `gdnkit bench`: 8192 fp32 states are 16 GiB, and the
# comparison holds four copies.
PREFILL_SETS = {
    "1x2048": [2048], "1x8192": [8192], "1x32768": [32768], "1x65536": [65536],
    "4096+4096": [4096, 4096], "1024+7168": [1024, 7168], "4x2048": [2048] * 4, "8x1024": [1024] * 8,
    "8x8192": [8192] * 8, "32x8192": [8192] * 32, "2048x4": [4] * 2048, "1024x8": [8] * 1024,
}
PEERS = ("fla", "flashinfer")
OPS = ("decode", "verify", "verify_cache", "prefill")
NOT_PREBUILT = "not prebuilt"


def _torch():
    import torch

    return torch


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        import fla

        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        print(f"[bench] FLA not available ({e!r}): no FLA times", file=sys.stderr)
        return None, None, None


# ---- FlashInfer ---------------------------------------------------------------------------------

class FlashInfer:
    """FlashInfer's GDN entry points as loaded: an installed package, or the prebuilt sm_90a bundle (its
    kernels exist for the bundle's benchmark shapes only: ``prebuilt`` lists them, None means any shape)."""

    def __init__(self, prefill: Callable, decode: Callable, version: str, source: str,
                 prebuilt: Optional[Dict[str, Any]] = None, info: Optional[Dict[str, Any]] = None):
        self.prefill = prefill  # flashinfer.gdn_prefill.chunk_gated_delta_rule
        self.decode = decode  # flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose
        self.version = version
        self.source = source
        self.prebuilt = prebuilt
        self.info = info or {}

    def why_not(self, op: str, B: int = 0, T: int = 1, lens: Optional[List[int]] = None, state: str = "fp32",
                layout: str = "k_last") -> Optional[str]:
        """None if this call has a kernel, else why not (a note for the row)."""
        if layout != "k_last":
            return "K-last state only (pretranspose API)"
        pb = self.prebuilt
        if pb is None:
            return None
        if K != pb["K"] or V != pb["K"]:
            return NOT_PREBUILT
        if op == "prefill":
            return None if (H, HV, tuple(lens or ())) in pb["prefill"] else NOT_PREBUILT
        if (H, HV) != pb["decode_heads"] or state not in pb["states"]:
            return NOT_PREBUILT
        if op == "decode":
            return None if B in pb["decode_B"] else NOT_PREBUILT
        if op == "verify_cache":
            return None if (B in pb["mtp_B"] and T in pb["mtp_T"]) else NOT_PREBUILT
        return NOT_PREBUILT  # chains with the state update: not in the bundle

    @staticmethod
    def is_missing_kernel(e: BaseException) -> bool:
        return type(e).__name__ == "MissingPrebuiltKernel"

    def route(self, num_seqs: int, heads: int) -> str:
        """Which SM90 prefill kernel family FlashInfer's wrapper picks (its own host heuristic)."""
        try:
            import torch
            from flashinfer.gdn_kernels.delta_rule_dsl.varlen_helper import should_use_cp_host

            props = torch.cuda.get_device_properties(0)
            cp = should_use_cp_host(num_seqs * heads, props.multi_processor_count, props.name,
                                    device_capability=torch.cuda.get_device_capability(0))
            return "context-parallel" if cp else "fused per (seq, head)"
        except Exception as e:  # noqa: BLE001
            return f"? ({type(e).__name__})"


def load_flashinfer(bundle: Optional[str] = None, site: Optional[str] = None) -> Tuple[Optional[FlashInfer], str]:
    """(FlashInfer, "") or (None, why). The prebuilt bundle is used when ``bundle`` (default ``$FI_BUNDLE``, else
    /tmp/fi) holds ``aot/`` and ``py/`` as setup.sh unpacks them, with apache-tvm-ffi in ``site`` (default
    ``$FI_SITE``, else /tmp/fisite); otherwise an installed ``flashinfer`` package."""
    bundle = bundle or os.environ.get("FI_BUNDLE") or "/tmp/fi"
    site = site or os.environ.get("FI_SITE") or "/tmp/fisite"
    aot, py = os.path.join(bundle, "aot"), os.path.join(bundle, "py")
    prebuilt = None
    info: Dict[str, Any] = {}
    try:
        if os.path.isdir(aot) and os.path.isfile(os.path.join(py, "fi_aot.py")):
            for p in (site, py):
                if os.path.isdir(p) and p not in sys.path:
                    sys.path.insert(0, p)
            os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fi_ws")
            os.environ.setdefault("TVM_FFI_CACHE_DIR", "/tmp/fi_ws/tvm-ffi")
            import fi_aot  # the bundle's loader: stubs the CuTe DSL compiler, serves the prebuilt kernels

            if not getattr(fi_aot, "_gdnkit_installed", False):  # once per process
                fi_aot.install(aot)
                fi_aot._gdnkit_installed = True
            man = fi_aot.manifest() or {}
            prebuilt = dict(K=fi_aot.K, prefill={(h, hv, tuple(lens)) for h, hv, lens in fi_aot.PREFILL_CASES},
                            decode_heads=(fi_aot.DECODE_H, fi_aot.DECODE_HV), decode_B=set(fi_aot.DECODE_BS),
                            mtp_B=set(fi_aot.MTP_BS), mtp_T=set(fi_aot.MTP_TS),
                            states={"fp32" if s == "float32" else "bf16" for s in fi_aot.STATE_DTYPES})
            info = dict(arch=man.get("arch"), prebuilt_for_sms=man.get("num_sms"),
                        prebuilt_on=man.get("device_name"), cute_dsl=man.get("cute_dsl"),
                        prebuilt_kernels=len(man.get("kernels", {})))
            source = f"prebuilt {man.get('arch')} bundle ({len(man.get('kernels', {}))} kernels)"
        else:
            source = "installed package"
        from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose
        from flashinfer.gdn_prefill import chunk_gated_delta_rule

        import flashinfer

        version = str(getattr(flashinfer, "__version__", "?"))
        return FlashInfer(chunk_gated_delta_rule, gated_delta_rule_decode_pretranspose, version, source, prebuilt,
                          info), ""
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


# ---- timing -------------------------------------------------------------------------------------

class CaptureError(RuntimeError):
    """fn ran eagerly but could not be captured in a CUDA graph."""


def _rel(x, ref) -> float:
    torch = _torch()
    x = x.detach().double()
    ref = ref.detach().double()
    den = torch.linalg.vector_norm(ref).item()
    return torch.linalg.vector_norm(x - ref).item() / (den if den > 0 else 1.0)


def _graph_time_us(fn: Callable[[], None], calls: int, replays: int) -> float:
    """Median over replays of a CUDA graph holding `calls` calls of fn, per call, in microseconds.

    Raises what fn raises when run eagerly (the warm-up), and CaptureError when only the capture fails."""
    torch = _torch()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up (JIT, kernel loading) outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001
        del graph
        torch.cuda.synchronize()
        raise CaptureError(f"{type(e).__name__}: {e}") from e
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def _event_time_ms(fn: Callable[[], None], warmup: int, reps: int) -> float:
    """Median GPU time of one fn() call, each between its own pair of events.

    The timed calls are queued behind a GPU spin (torch.cuda._sleep, where PyTorch has it, after at least
    one warm-up call) long enough for the host to issue all of them, so the host's time to issue a call
    (Python, argument conversion) overlaps the GPU's work instead of showing up as idle GPU time between
    the events.
    """
    torch = _torch()
    issue_s = math.inf  # the host's time to issue one call (the quickest warm-up call: the first may compile)
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        issue_s = min(issue_s, time.perf_counter() - t0)
        torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and warmup > 0:  # spin: twice the issue time of all calls at 2 GHz, 0.1 to 100 ms
        sleep(int(min(max(2.0 * reps * issue_s, 1e-4), 0.1) * 2e9))
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_ceiling_tbps() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second, in TB/s."""
    torch = _torch()
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _event_time_ms(lambda: b.copy_(a), 3, 15)
    del a, b
    return 2 * n / (ms * 1e-3) / 1e12


def _gdnkit_call(fn: Callable[[], object]):
    """Run fn; an op the CUDA backend does not implement becomes a note instead of a failure."""
    import gdnkit

    try:
        fn()
        _torch().cuda.synchronize()
        return None
    except gdnkit.GdnkitNotImplementedError as e:
        return f"gdnkit: {e}"


def _short(e: BaseException, n: int = 160) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def _add_note(row: Dict[str, Any], note: str, key: str = "note") -> None:
    """Append to row[key]: "note" (gdnkit and FLA, as fla_compare shows it) or "flashinfer_note"."""
    row[key] = f"{row[key]}; {note}" if row.get(key) else note


def _peer_graph_time(row: Dict[str, Any], peer: str, fn: Callable[[], None], calls: int, replays: int,
                     fi: Optional[FlashInfer] = None) -> bool:
    """row[peer + '_us'] from CUDA-graph replays; a failure becomes a note. True when timed."""
    torch = _torch()
    key, prefix = ("flashinfer_note", "") if peer == "flashinfer" else ("note", f"{peer}: ")
    try:
        with torch.no_grad():
            row[f"{peer}_us"] = _graph_time_us(fn, calls, replays)
        return True
    except CaptureError as e:
        # eager events around the same calls, for the record only (not the method of the other columns)
        try:
            with torch.no_grad():
                row[f"{peer}_eager_us"] = _event_time_ms(fn, 2, max(5, replays // 2)) * 1e3 / calls
            extra = f"; eager {row[f'{peer}_eager_us']:.2f} us, not comparable"
        except Exception:  # noqa: BLE001
            extra = ""
        _add_note(row, f"{prefix}CUDA-graph capture failed ({_short(e, 100)}){extra}", key)
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        _add_note(row, prefix + (NOT_PREBUILT if fi is not None and fi.is_missing_kernel(e) else _short(e)), key)
    return False


# ---- decode, verify, verify with cache ------------------------------------------------------------

def bench_recurrent(op: str, B: int, T: int, layout: str, state: str, fla_recurrent, fi: Optional[FlashInfer],
                    l2_bytes: int, replays: int) -> Dict:
    """op "decode" (T = 1), "verify" (a T-token chain, the final state stored) or "verify_cache" (the state
    after every token cached, the pool unchanged), pool-indexed on the same inputs for every peer."""
    torch = _torch()
    import gdnkit

    gen = torch.Generator(device="cuda").manual_seed(1000 * T + B + (7 if op == "verify_cache" else 0))
    dev = "cuda"
    sdt = torch.float32 if state == "fp32" else torch.bfloat16
    esz = 4 if state == "fp32" else 2
    v_first = layout == "k_last"
    st_shape = (HV, V, K) if v_first else (HV, K, V)
    cached = op == "verify_cache"
    run_fla = fla_recurrent is not None and op in ("decode", "verify") and state == "fp32"
    fi_why = None if fi is None else fi.why_not(op, B=B, T=T, state=state, layout=layout)
    run_fi = fi is not None and fi_why is None

    state_bytes = B * HV * K * V * esz
    per_set = state_bytes * ((1 + T) if cached else (3 if run_fla else 2))  # pool + cache, or FLA's h0 and ht
    sets = max(4, min(64, math.ceil(4 * l2_bytes / state_bytes)))
    sets = max(1, min(sets, int(12e9 // per_set)))

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    q = [rn(B, T, H, K) for _ in range(sets)]
    k = [rn(B, T, H, K) for _ in range(sets)]
    v = [rn(B, T, HV, V) for _ in range(sets)]
    a = [rn(B, T, HV) for _ in range(sets)]
    b = [rn(B, T, HV) for _ in range(sets)]
    A_log = torch.log(torch.rand(HV, generator=gen, device=dev) * 15 + 1)
    dt_bias = 0.5 * torch.randn(HV, generator=gen, device=dev)
    h0 = [0.1 * torch.randn(B, *st_shape, generator=gen, device=dev) for _ in range(sets)]
    P = sets * B
    perm = torch.randperm(P, generator=gen, device=dev).to(torch.int32)
    # one allocation per set: kernels that assume 16-byte aligned index tensors get them (a slice of perm is not)
    slots = [perm[s * B:(s + 1) * B].clone() for s in range(sets)]
    pool = torch.empty(P, *st_shape, device=dev, dtype=sdt)
    for s in range(sets):
        pool[slots[s].long()] = h0[s].to(sdt)
    if not run_fla:  # h0[0] is kept to reset the compared slots; the rest only fed FLA
        h0 = [h0[0].to(sdt)] + [None] * (sets - 1)
    o = [torch.empty_like(v[s]) for s in range(sets)]
    cache: List[Any] = [torch.empty(B, T, *st_shape, device=dev, dtype=sdt) for s in range(sets)] if cached else []
    iidx = torch.arange(B, dtype=torch.int32, device=dev)

    def gdn_one(s, out=None):
        if op == "decode":
            return gdnkit.decode(q[s].view(B, H, K), k[s].view(B, H, K), v[s].view(B, HV, V), pool, slots[s],
                                 layout=layout, a=a[s].view(B, HV), b=b[s].view(B, HV), A_log=A_log,
                                 dt_bias=dt_bias, o=None if out is None else out.view(B, HV, V))
        if cached:
            return gdnkit.verify(q[s], k[s], v[s], pool, slots[s], layout=layout, a=a[s], b=b[s], A_log=A_log,
                                 dt_bias=dt_bias, intermediate=cache[s], intermediate_indices=iidx,
                                 update_state=False, o=out)
        return gdnkit.verify(q[s], k[s], v[s], pool, slots[s], layout=layout, a=a[s], b=b[s], A_log=A_log,
                             dt_bias=dt_bias, update_state=True, o=out)

    def gdn_all():
        for s in range(sets):
            gdn_one(s, o[s])

    fla_kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                  dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=v_first)

    def fla_all():
        for s in range(sets):
            fla_recurrent(q[s], k[s], v[s], g=a[s], beta=b[s], initial_state=h0[s], **fla_kw)

    o_fi: List[Any] = [torch.empty_like(v[s]) for s in range(sets)] if run_fi else []

    def fi_one(s, out):
        assert fi is not None
        kw: Dict[str, Any] = dict(scale=None, output=out, use_qk_l2norm=True, initial_state=pool,
                                  initial_state_indices=slots[s], backend="flashinfer")
        if T > 1:
            kw.update(disable_state_update=cached, intermediate_states_buffer=cache[s] if cached else None)
        return fi.decode(q[s], k[s], v[s], None, A_log, a[s], dt_bias, b[s], **kw)

    def fi_all():
        for s in range(sets):
            fi_one(s, o_fi[s])

    name = f"B={B}" if op == "decode" else f"B={B},T={T}"
    row: Dict[str, Any] = dict(op=op, name=name, B=B, T=T, layout=layout, state=state, calls_per_replay=sets)
    tokens = T * (2 * B * H * K * 2 + 2 * B * HV * V * 2 + 2 * B * HV * 2)
    bytes_per_call = (state_bytes * (1 + T) if cached else 2 * state_bytes) + tokens
    row["bytes_per_call"] = bytes_per_call
    note = _gdnkit_call(gdn_all)
    if note is None:
        row["gdnkit_us"] = _graph_time_us(gdn_all, sets, replays)
    else:
        row["note"] = note
    if run_fla:
        _peer_graph_time(row, "fla", fla_all, sets, replays)
    if run_fi:
        _peer_graph_time(row, "flashinfer", fi_all, sets, replays, fi)
    elif fi is not None:
        row["flashinfer_note"] = fi_why
    for peer in ("gdnkit", "fla", "flashinfer"):
        if f"{peer}_us" in row:
            row[f"{peer}_tbps"] = bytes_per_call / (row[f"{peer}_us"] * 1e-6) / 1e12

    # the same call from the same state for every peer: outputs and final states (cached states)
    if "gdnkit_us" in row and ("fla_us" in row or "flashinfer_us" in row):
        s0 = slots[0].long()
        pool[s0] = h0[0].to(sdt)
        gdn_o = gdn_one(0).clone()
        gdn_st = (cache[0] if cached else pool[s0]).clone()
        if "fla_us" in row:
            row["ratio"] = row["gdnkit_us"] / row["fla_us"]
            with torch.no_grad():
                fla_o, fla_ht = fla_recurrent(q[0], k[0], v[0], g=a[0], beta=b[0], initial_state=h0[0], **fla_kw)
            row["rel_o"] = _rel(gdn_o, fla_o.view(gdn_o.shape))
            row["rel_state"] = _rel(gdn_st, fla_ht)
        if "flashinfer_us" in row:
            row["flashinfer_ratio"] = row["gdnkit_us"] / row["flashinfer_us"]
            pool[s0] = h0[0].to(sdt)
            with torch.no_grad():
                fi_one(0, o_fi[0])
            torch.cuda.synchronize()
            row["flashinfer_rel_o"] = _rel(gdn_o, o_fi[0].view(gdn_o.shape))
            row["flashinfer_rel_state"] = _rel(gdn_st, cache[0] if cached else pool[s0])
    del q, k, v, a, b, h0, pool, o, o_fi, cache
    torch.cuda.empty_cache()
    return row


# ---- prefill --------------------------------------------------------------------------------------

def bench_prefill(name: str, lens: List[int], layout: str, fla_chunk, fi: Optional[FlashInfer], reps: int) -> Dict:
    torch = _torch()
    import gdnkit

    gen = torch.Generator(device="cuda").manual_seed(7)
    dev = "cuda"
    T, N = sum(lens), len(lens)
    v_first = layout == "k_last"
    st_shape = (HV, V, K) if v_first else (HV, K, V)

    def rn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    q, k, v = rn(1, T, H, K), rn(1, T, H, K), rn(1, T, HV, V)
    a, b = rn(1, T, HV), rn(1, T, HV)
    A_log = torch.log(torch.rand(HV, generator=gen, device=dev) * 15 + 1)
    dt_bias = 0.5 * torch.randn(HV, generator=gen, device=dev)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    cu32 = torch.tensor(offsets, dtype=torch.int32, device=dev)
    cu64_cpu = torch.tensor(offsets, dtype=torch.int64)
    cu64 = cu64_cpu.to(dev)
    h0 = 0.1 * torch.randn(N, *st_shape, generator=gen, device=dev)
    pool = h0.clone()
    idx = torch.arange(N, dtype=torch.int32, device=dev)
    o = torch.empty_like(v)

    def gdn():
        gdnkit.prefill(q, k, v, cu32, state=pool, initial_indices=idx, final_indices=idx, layout=layout, a=a, b=b,
                       A_log=A_log, dt_bias=dt_bias, cu_seqlens_cpu=cu64_cpu, o=o)

    fla_kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=v_first,
                  cu_seqlens=cu64, cu_seqlens_cpu=cu64_cpu)

    def fla():
        with torch.no_grad():
            return fla_chunk(q, k, v, a, b, **fla_kw)

    flops = 4.0 * T * HV * K * V
    row: Dict[str, Any] = dict(op="prefill", name=name, T=T, N=N, layout=layout, state="fp32")
    note = _gdnkit_call(gdn)
    if note is None:
        row["gdnkit_ms"] = _event_time_ms(gdn, 2, reps)
        row["gdnkit_tflops"] = flops / (row["gdnkit_ms"] * 1e-3) / 1e12
    else:
        row["note"] = note
    if fla_chunk is not None:
        try:
            row["fla_ms"] = _event_time_ms(fla, 2, reps)
            row["fla_tflops"] = flops / (row["fla_ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            _add_note(row, f"fla: {_short(e)}")

    # FlashInfer: [T, heads, dim] tensors, gates as inputs (alpha = exp(g), beta = sigmoid(b)), fp32 K-last states
    fi_why = None if fi is None else fi.why_not("prefill", lens=lens, layout=layout)
    fi_calls: Dict[str, Callable[[], Any]] = {}
    fi_out: Dict[str, Tuple[Any, Any]] = {}
    if fi is not None and fi_why is None:
        import torch.nn.functional as F

        q3, k3, v3 = q[0], k[0], v[0]

        def l2n(x):  # gdnkit's (and FlashInfer's) q/k L2 norm: x / sqrt(sum(x^2) + 1e-6), in fp32
            xf = x.float()
            return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)

        qn, kn = l2n(q3), l2n(k3)
        g_log = -torch.exp(A_log) * F.softplus(a[0].float() + dt_bias)
        alpha = torch.exp(g_log).contiguous()
        beta = torch.sigmoid(b[0].float()).contiguous()
        def fi_call(qq, kk, l2: bool, o_fi, ht_fi) -> Callable[[], Any]:
            assert fi is not None

            def call():
                with torch.no_grad():
                    return fi.prefill(qq, kk, v3, g=alpha, beta=beta, scale=None, initial_state=h0,
                                      output_final_state=True, cu_seqlens=cu32, use_qk_l2norm_in_kernel=l2,
                                      output=o_fi, output_state=ht_fi, max_seqlen=max(lens))
            return call

        for key, (qq, kk, l2) in (("", (qn, kn, False)), ("_l2n", (q3, k3, True))):
            fi_out[key] = (torch.empty(T, HV, V, dtype=v.dtype, device=dev),
                           torch.empty(N, HV, V, K, dtype=torch.float32, device=dev))
            fi_calls[key] = fi_call(qq, kk, l2, *fi_out[key])
        row["flashinfer_route"] = fi.route(N, max(H, HV))
        for key, call in fi_calls.items():
            try:
                row[f"flashinfer{key}_ms"] = _event_time_ms(call, 2, reps)
                row[f"flashinfer{key}_tflops"] = flops / (row[f"flashinfer{key}_ms"] * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001
                torch.cuda.synchronize()
                _add_note(row, ("+l2n: " if key else "")
                          + (NOT_PREBUILT if fi.is_missing_kernel(e) else _short(e)), "flashinfer_note")
    elif fi is not None:
        row["flashinfer_note"] = fi_why

    if "gdnkit_ms" in row and any(f"{p}_ms" in row for p in ("fla", "flashinfer", "flashinfer_l2n")):
        pool.copy_(h0)
        gdn()
        torch.cuda.synchronize()
        if "fla_ms" in row:
            row["ratio"] = row["gdnkit_ms"] / row["fla_ms"]
            fla_o, fla_ht = fla()
            row["rel_o"] = _rel(o, fla_o)
            row["rel_state"] = _rel(pool, fla_ht)
        for key in ("", "_l2n"):
            if f"flashinfer{key}_ms" in row:
                row[f"flashinfer{key}_ratio"] = row["gdnkit_ms"] / row[f"flashinfer{key}_ms"]
                fi_calls[key]()
                torch.cuda.synchronize()
                o_fi, ht_fi = fi_out[key]
                row[f"flashinfer{key}_rel_o"] = _rel(o[0], o_fi)
                row[f"flashinfer{key}_rel_state"] = _rel(pool, ht_fi)
    del q, k, v, a, b, o, pool, h0, fi_calls, fi_out
    torch.cuda.empty_cache()
    return row


# ---- reports --------------------------------------------------------------------------------------

def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def _pair(r: Dict, a: str, b: str) -> str:
    """'x / y' of two relative errors, '-' where neither was measured."""
    if a not in r and b not in r:
        return "-"
    return f"{_fmt(r.get(a), '.1e')} / {_fmt(r.get(b), '.1e')}"


def _table(out: List[str], title: str, cols: List[Tuple[str, Callable[[Dict], str]]], rows: List[Dict]) -> None:
    if not rows:
        return
    out += [f"## {title}", "", "| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f(r) for _, f in cols) + " |")
    out.append("")


def markdown(meta: Dict, rows: List[Dict]) -> str:
    """gdnkit vs FLA (fla_compare.md)."""
    out = [f"# gdnkit vs FLA on {meta['device']}", "",
           f"Shape {meta.get('shape', 'qwen3-next')} (H={meta['heads']['H']}, HV={meta['heads']['HV']}, "
           f"K={meta['heads']['K']}, V={meta['heads']['V']}). "
           f"FLA {meta['fla_version']}, torch {meta['torch']}, layout {meta['layout']}, "
           f"copy ceiling {meta['copy_ceiling_tbps']:.2f} TB/s (1 GiB D2D, read + write). "
           f"Command: `{meta['command']}`", "",
           "ratio = gdnkit time / FLA time (< 1: gdnkit faster). rel = ||gdnkit - FLA|| / ||FLA|| on the same inputs.",
           ""]
    # (op, section title, [(header, row key, format)]); every table ends with the same ratio/error columns.
    tail = [("ratio", "ratio", ".2f")]
    errs = [("rel o", "rel_o", ".1e"), ("rel state", "rel_state", ".1e")]
    sections = [
        ("decode", "Decode (us per call, cold L2, CUDA-graph replays)",
         [("B", "B", None), ("gdnkit us", "gdnkit_us", ".2f"), ("FLA us", "fla_us", ".2f")] + tail +
         [("gdnkit TB/s", "gdnkit_tbps", ".2f"), ("FLA TB/s", "fla_tbps", ".2f")] + errs),
        ("verify", "Verify: T-token chains, final state stored (us per call, cold L2, CUDA-graph replays)",
         [("B", "B", None), ("T", "T", None), ("gdnkit us", "gdnkit_us", ".2f"), ("FLA us", "fla_us", ".2f")] + tail +
         [("gdnkit TB/s", "gdnkit_tbps", ".2f"), ("FLA TB/s", "fla_tbps", ".2f")] + errs),
        ("prefill", "Prefill (ms per call; TFLOP/s = 4 T HV K V / time)",
         [("set", "name", None), ("tokens", "T", None), ("gdnkit ms", "gdnkit_ms", ".3f"), ("FLA ms", "fla_ms", ".3f")] +
         tail + [("gdnkit TFLOP/s", "gdnkit_tflops", ".1f"), ("FLA TFLOP/s", "fla_tflops", ".1f")] + errs),
    ]
    for op, title, cols in sections:
        sel = [r for r in rows if r["op"] == op]
        if not sel:
            continue
        out += [f"## {title}", "", "| " + " | ".join(h for h, _, _ in cols) + " | note |",
                "|" + "---|" * (len(cols) + 1)]
        for r in sel:
            cells = [str(r[k]) if f is None else _fmt(r.get(k), f) for _, k, f in cols]
            out.append("| " + " | ".join(cells) + f" | {r.get('note', '')} |")
        out.append("")
    return "\n".join(out)


def markdown_peers(meta: Dict, rows: List[Dict]) -> str:
    """gdnkit vs every peer (peer_compare.md)."""
    fi = meta.get("flashinfer") or {}
    fi_desc = f"FlashInfer {fi['version']} ({fi['source']})" if fi.get("version") else "FlashInfer n/a"
    out = [f"# gdnkit vs FLA and FlashInfer on {meta['device']}", "",
           f"Shape {meta.get('shape', 'qwen3-next')} (H={meta['heads']['H']}, HV={meta['heads']['HV']}, "
           f"K={meta['heads']['K']}, V={meta['heads']['V']}), bf16 q/k/v and gate projections, layout "
           f"{meta['layout']}. FLA {meta['fla_version']}, {fi_desc}, torch {meta['torch']}, copy ceiling "
           f"{meta['copy_ceiling_tbps']:.2f} TB/s (1 GiB D2D, read + write). Command: `{meta['command']}`", "",
           "x/FLA, x/FI = gdnkit time / peer time (< 1: gdnkit faster). rel o / state = ||gdnkit - peer|| / "
           "||peer|| of the outputs / final states (cached states for verify with cache) on the same inputs. "
           "'-': not run (FLA: fp32 states only, no intermediate cache; FlashInfer: see note).", ""]

    def f(key, spec):
        return lambda r: _fmt(r.get(key), spec)

    def note(r):
        parts = [r["note"]] if r.get("note") else []
        if r.get("flashinfer_note"):
            parts.append(f"flashinfer: {r['flashinfer_note']}")
        return "; ".join(parts)

    rec_cols = [("B", f("B", "d")), ("state", lambda r: r.get("state", "fp32")),
                ("gdnkit us", f("gdnkit_us", ".2f")), ("FLA us", f("fla_us", ".2f")),
                ("FlashInfer us", f("flashinfer_us", ".2f")), ("x/FLA", f("ratio", ".2f")),
                ("x/FI", f("flashinfer_ratio", ".2f")), ("gdnkit TB/s", f("gdnkit_tbps", ".2f")),
                ("FLA TB/s", f("fla_tbps", ".2f")), ("FI TB/s", f("flashinfer_tbps", ".2f")),
                ("rel o / state vs FLA", lambda r: _pair(r, "rel_o", "rel_state")),
                ("rel o / state vs FI", lambda r: _pair(r, "flashinfer_rel_o", "flashinfer_rel_state")),
                ("note", note)]
    with_t = rec_cols[:1] + [("T", f("T", "d"))] + rec_cols[1:]
    _table(out, "Decode (us per call, cold L2, CUDA-graph replays)", rec_cols,
           [r for r in rows if r["op"] == "decode"])
    _table(out, "Verify: T-token chains, final state stored (us per call, cold L2, CUDA-graph replays)", with_t,
           [r for r in rows if r["op"] == "verify"])
    cache_cols = [c for c in with_t if "FLA" not in c[0]]
    _table(out, "Verify with cache: the state after every token cached, pool unchanged (FlashInfer's MTP; us per "
                "call, cold L2, CUDA-graph replays)", cache_cols, [r for r in rows if r["op"] == "verify_cache"])
    pre = [r for r in rows if r["op"] == "prefill"]
    if pre:
        out += ["FlashInfer prefill takes its gates as inputs (alpha = exp(g), beta), computed before timing; "
                "'FlashInfer' is its prefill kernel on q/k normalized beforehand, 'FlashInfer+l2n' the call with "
                "use_qk_l2norm_in_kernel=True (its normalize kernel, then the prefill kernel). gdnkit and FLA fuse "
                "gating and L2 norm.", ""]
    _table(out, "Prefill (ms per call; TFLOP/s = 4 T HV K V / time)",
           [("set", lambda r: r["name"]), ("tokens", f("T", "d")), ("gdnkit ms", f("gdnkit_ms", ".3f")),
            ("FLA ms", f("fla_ms", ".3f")), ("FlashInfer ms", f("flashinfer_ms", ".3f")),
            ("FlashInfer+l2n ms", f("flashinfer_l2n_ms", ".3f")), ("x/FLA", f("ratio", ".2f")),
            ("x/FI", f("flashinfer_ratio", ".2f")), ("x/(FI+l2n)", f("flashinfer_l2n_ratio", ".2f")),
            ("gdnkit TFLOP/s", f("gdnkit_tflops", ".1f")),
            ("rel o / state vs FLA", lambda r: _pair(r, "rel_o", "rel_state")),
            ("rel o / state vs FI+l2n", lambda r: _pair(r, "flashinfer_l2n_rel_o", "flashinfer_l2n_rel_state")),
            ("FI route", lambda r: r.get("flashinfer_route", "-")), ("note", note)], pre)
    return "\n".join(out)


def _fla_view(meta: Dict, rows: List[Dict]) -> Tuple[Dict, List[Dict]]:
    """fla_compare's content: the FLA rows (fp32 states) without the FlashInfer fields, as before."""
    m = {k: v for k, v in meta.items() if k not in ("flashinfer", "peers")}
    m["dtype"] = "bf16 q/k/v/a/b, fp32 state"
    sel = []
    for r in rows:
        if r["op"] in ("decode", "verify", "prefill") and r.get("state", "fp32") == "fp32":
            sel.append({k: v for k, v in r.items() if not k.startswith("flashinfer") and k != "state"})
    return m, sel


def write_outputs(out_dir: str, meta: Dict, rows: List[Dict], quiet: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    fmeta, frows = _fla_view(meta, rows)
    for stem, m, rs, md in (("fla_compare", fmeta, frows, markdown), ("peer_compare", meta, rows, markdown_peers)):
        with open(os.path.join(out_dir, stem + ".json"), "w") as f:
            json.dump(dict(meta=m, rows=rs), f, indent=1)
        with open(os.path.join(out_dir, stem + ".md"), "w") as f:
            f.write(md(m, rs) + "\n")
    if not quiet:
        print(markdown_peers(meta, rows))


def _merge_rows(out_dir: str, meta: Dict, run: set) -> List[Dict]:
    """--merge: the rows of peer_compare.json in out_dir whose (op, state) this run does not measure (same
    shape and layout)."""
    path = os.path.join(out_dir, "peer_compare.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        old = json.load(f)
    om = old.get("meta", {})
    if om.get("shape") != meta["shape"] or om.get("layout") != meta["layout"]:
        print(f"[bench] --merge: {path} is for another shape/layout; not merged", file=sys.stderr)
        return []
    meta["merged_commands"] = om.get("merged_commands", [om.get("command")]) + [meta["command"]]
    return [r for r in old.get("rows", []) if (r.get("op"), r.get("state", "fp32")) not in run]


def _pairs(spec: str) -> List[Tuple[int, int]]:
    out = []
    for x in spec.split(","):
        if x:
            B, T = (int(y) for y in x.lower().split("x"))
            out.append((B, T))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdnkit.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-out",
                    help="folder for fla_compare.{json,md} (gdnkit vs FLA) and peer_compare.{json,md} (every peer)")
    ap.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    ap.add_argument("--peers", default="auto",
                    help="comma list of fla, flashinfer (each must load, else exit 2), 'auto' (those that load) "
                         "or 'none'")
    ap.add_argument("--shape", default="qwen3-next", choices=list(SHAPES), help="heads (docs/benchmarks.md)")
    ap.add_argument("--layout", default="k_last", choices=["k_last", "v_last"],
                    help="state layout for all (FLA: state_v_first = layout == k_last; FlashInfer: k_last only)")
    ap.add_argument("--state", default="fp32",
                    help="pool dtypes for decode and verify_cache: fp32, bf16 or fp32,bf16 (FLA: fp32 only)")
    ap.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes")
    ap.add_argument("--verify", default=",".join(f"{b}x{t}" for b, t in VERIFY_ROWS),
                    help="verify rows BxT (B sequences of T draft tokens)")
    ap.add_argument("--verify-cache", default=",".join(f"{b}x{t}" for b, t in VERIFY_CACHE_ROWS),
                    help="verify_cache rows BxT")
    ap.add_argument("--sets", default=",".join(PREFILL_SETS), help="prefill sequence sets (docs/benchmarks.md)")
    ap.add_argument("--replays", type=int, default=20, help="decode graph replays (median)")
    ap.add_argument("--reps", type=int, default=10, help="prefill timed calls (median)")
    ap.add_argument("--flashinfer-bundle", default=None,
                    help="FlashInfer's prebuilt bundle as setup.sh unpacked it (default $FI_BUNDLE, else /tmp/fi); "
                         "without it an installed flashinfer is used")
    ap.add_argument("--flashinfer-site", default=None,
                    help="where setup.sh installed apache-tvm-ffi (default $FI_SITE, else /tmp/fisite)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of other ops already in --out's peer_compare.json (runs split by --ops)")
    args = ap.parse_args(argv)
    global H, HV
    H, HV = SHAPES[args.shape]

    ops = [x for x in args.ops.split(",") if x]
    states = [x for x in args.state.split(",") if x]
    bad = [x for x in ops if x not in OPS] + [x for x in states if x not in ("fp32", "bf16")]
    sets = [x for x in args.sets.split(",") if x]
    bad += [x for x in sets if x not in PREFILL_SETS]
    peers_arg = args.peers.strip().lower()
    wanted = [] if peers_arg == "none" else list(PEERS) if peers_arg == "auto" else [
        x for x in peers_arg.split(",") if x]
    bad += [x for x in wanted if x not in PEERS]
    if bad:
        ap.error(f"unknown value(s): {', '.join(bad)}")
    required = peers_arg not in ("auto", "none")

    torch = _torch()
    if not torch.cuda.is_available():
        print("[bench] needs a CUDA device", file=sys.stderr)
        return 2
    import gdnkit

    fla_chunk = fla_recurrent = fla_version = None
    if "fla" in wanted:
        fla_chunk, fla_recurrent, fla_version = _fla()
        if fla_chunk is None and required:
            print("[bench] --peers names fla, which does not import", file=sys.stderr)
            return 2
    fi: Optional[FlashInfer] = None
    if "flashinfer" in wanted:
        fi, why = load_flashinfer(args.flashinfer_bundle, args.flashinfer_site)
        if fi is None:
            print(f"[bench] FlashInfer not available ({why}): no FlashInfer times", file=sys.stderr)
            if required:
                print("[bench] --peers names flashinfer, which does not load (on the GPU machine: bash "
                      ".peers/flashinfer/setup.sh first)", file=sys.stderr)
                return 2
        else:
            print(f"[bench] FlashInfer {fi.version}: {fi.source}", file=sys.stderr)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))
    meta: Dict[str, Any] = dict(
        device=torch.cuda.get_device_name(0), torch=torch.__version__, fla_version=fla_version or "n/a",
        gdnkit=gdnkit.build_info(), python=platform.python_version(), layout=args.layout, l2_bytes=l2,
        shape=args.shape, heads=dict(H=H, HV=HV, K=K, V=V), dtype="bf16 q/k/v/a/b, state dtype per row",
        command="python -m gdnkit.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        peers=[p for p, ok in (("fla", fla_chunk is not None), ("flashinfer", fi is not None)) if ok],
        sms=props.multi_processor_count)
    if fi is not None:
        meta["flashinfer"] = dict(version=fi.version, source=fi.source, **fi.info)
        if fi.info.get("prebuilt_for_sms") not in (None, props.multi_processor_count):
            print(f"[bench] WARNING: FlashInfer's kernels were prebuilt for {fi.info['prebuilt_for_sms']} SMs, "
                  f"this device has {props.multi_processor_count}", file=sys.stderr)
    meta["copy_ceiling_tbps"] = copy_ceiling_tbps()
    run = {(op, st) for op in ops for st in (states if op in ("decode", "verify_cache") else ["fp32"])}
    rows: List[Dict] = _merge_rows(args.out, meta, run) if args.merge else []

    def done(row: Dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_outputs(args.out, meta, rows)

    if "decode" in ops:
        for state in states:
            for B in [int(x) for x in args.batches.split(",") if x]:
                done(bench_recurrent("decode", B, 1, args.layout, state, fla_recurrent, fi, l2, args.replays))
    if "verify" in ops:
        for B, T in _pairs(args.verify):
            done(bench_recurrent("verify", B, T, args.layout, "fp32", fla_recurrent, fi, l2, args.replays))
    if "verify_cache" in ops:
        for state in states:
            for B, T in _pairs(args.verify_cache):
                done(bench_recurrent("verify_cache", B, T, args.layout, state, None, fi, l2, args.replays))
    if "prefill" in ops:
        for name in sets:
            lens = PREFILL_SETS[name]
            reps = args.reps if sum(lens) < 200000 else max(5, args.reps // 2)
            done(bench_prefill(name, lens, args.layout, fla_chunk, fi, reps))
    write_outputs(args.out, meta, rows, quiet=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
