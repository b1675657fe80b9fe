"""gdnkit vs FLA on identical inputs: ``python -m gdnkit.bench --out DIR``.

Decode: FLA's ``fused_recurrent_gated_delta_rule`` (one token, initial state in, final state out) vs
gdnkit's ``decode`` (pool-indexed, in place, slots a random permutation), the heads of one of the shapes
of docs/benchmarks.md (``--shape``, default qwen3-next: H=16, HV=32, K=V=128), bf16 q/k/v, fp32 state,
gating and q/k L2 norm in the kernel for both. Each timed CUDA-graph replay runs one call per input set,
rotating through enough sets that the replay touches at least 4x the L2 size of state (cold L2, as in
serving); the median of the replays over the number of calls is reported in microseconds per call.

Verify: FLA's ``fused_recurrent_gated_delta_rule`` on T tokens per sequence vs gdnkit's ``verify`` of a
T-token chain storing the final state in the pool (no intermediate cache), timed like decode.

Prefill: FLA's ``chunk_gated_delta_rule`` vs gdnkit's ``prefill`` on the sequence sets of
docs/benchmarks.md, same heads and dtypes, fused gating and L2 norm in the kernel, initial states read
and final states written.
CUDA events around each call, warm-up first, median of >= 10 calls (5 for the largest sets); the timed
calls are queued behind a GPU spin, so the host's time to issue them is not counted as GPU time.

Each row also reports the relative difference of gdnkit's outputs and states from FLA's on the same
inputs. Writes fla_compare.json and fla_compare.md to --out. Needs PyTorch with CUDA; FLA optional
(without it only gdnkit's times are reported).
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
from typing import Any, Callable, Dict, List, Optional

# The shapes of docs/benchmarks.md: (H q/k heads, HV value heads), K = V = 128. The functions below read the
# module's H and HV, which main() sets from --shape.
SHAPES = {"qwen3-next": (16, 32), "qwen3.5-397b-tp8": (2, 8), "qwen3.5-27b": (16, 48), "qwen3.5-397b": (16, 64)}
H, HV, K, V = 16, 32, 128, 128

DECODE_BATCHES = [1, 4, 16, 64, 128, 256, 512]
VERIFY_ROWS = [(8, 2), (8, 4), (64, 2), (64, 4), (256, 4)]
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


def _torch():
    import torch

    return torch


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        import fla

        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        print(f"[bench] FLA not available ({e!r}): gdnkit times only", file=sys.stderr)
        return None, None, None


def _rel(x, ref) -> float:
    torch = _torch()
    x = x.detach().double()
    ref = ref.detach().double()
    den = torch.linalg.vector_norm(ref).item()
    return torch.linalg.vector_norm(x - ref).item() / (den if den > 0 else 1.0)


def _graph_time_us(fn: Callable[[], None], calls: int, replays: int) -> float:
    """Median over replays of a CUDA graph holding `calls` calls of fn, per call, in microseconds."""
    torch = _torch()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up (JIT, kernel loading) outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
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


def bench_decode(B: int, layout: str, fla_recurrent, l2_bytes: int, replays: int, T: int = 1) -> Dict:
    """T = 1: gdnkit decode; T > 1: gdnkit verify of a T-token chain with the final state stored (no cache),
    vs FLA's fused_recurrent on the same T tokens per sequence (initial state in, final state out)."""
    torch = _torch()
    import gdnkit

    gen = torch.Generator(device="cuda").manual_seed(1000 * T + B)
    dev = "cuda"
    state_bytes = B * HV * K * V * 4
    sets = max(4, min(64, math.ceil(4 * l2_bytes / state_bytes)))
    sets = max(1, min(sets, int(12e9 // (3 * state_bytes))))  # pool + FLA's h0 and ht per set
    v_first = layout == "k_last"
    st_shape = (HV, V, K) if v_first else (HV, K, V)

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
    slots = [perm[s * B:(s + 1) * B] for s in range(sets)]
    pool = torch.empty(P, *st_shape, device=dev)
    for s in range(sets):
        pool[slots[s].long()] = h0[s]
    o = [torch.empty_like(v[s]) for s in range(sets)]

    def gdn_one(s, out=None):
        if T == 1:
            return gdnkit.decode(q[s].view(B, H, K), k[s].view(B, H, K), v[s].view(B, HV, V), pool, slots[s],
                                 layout=layout, a=a[s].view(B, HV), b=b[s].view(B, HV), A_log=A_log,
                                 dt_bias=dt_bias, o=None if out is None else out.view(B, HV, V))
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

    row: Dict[str, Any] = dict(op="decode" if T == 1 else "verify", name=f"B={B}" if T == 1 else f"B={B},T={T}",
                               B=B, T=T, layout=layout, calls_per_replay=sets)
    bytes_per_call = 2 * state_bytes + T * (2 * B * H * K * 2 + 2 * B * HV * V * 2 + 2 * B * HV * 2)
    row["bytes_per_call"] = bytes_per_call
    note = _gdnkit_call(gdn_all)
    if note is None:
        row["gdnkit_us"] = _graph_time_us(gdn_all, sets, replays)
        row["gdnkit_tbps"] = bytes_per_call / (row["gdnkit_us"] * 1e-6) / 1e12
    else:
        row["note"] = note
    if fla_recurrent is not None:
        with torch.no_grad():
            row["fla_us"] = _graph_time_us(fla_all, sets, replays)
        row["fla_tbps"] = bytes_per_call / (row["fla_us"] * 1e-6) / 1e12
    if "gdnkit_us" in row and "fla_us" in row:
        row["ratio"] = row["gdnkit_us"] / row["fla_us"]
        # the same call from the same state for both: outputs and final states
        pool[slots[0].long()] = h0[0]
        gdn_o = gdn_one(0)
        with torch.no_grad():
            fla_o, fla_ht = fla_recurrent(q[0], k[0], v[0], g=a[0], beta=b[0], initial_state=h0[0], **fla_kw)
        row["rel_o"] = _rel(gdn_o, fla_o.view(gdn_o.shape))
        row["rel_state"] = _rel(pool[slots[0].long()], fla_ht)
    del q, k, v, a, b, h0, pool, o
    torch.cuda.empty_cache()
    return row


def bench_prefill(name: str, lens: List[int], layout: str, fla_chunk, reps: int) -> Dict:
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
    row: Dict[str, Any] = dict(op="prefill", name=name, T=T, N=N, layout=layout)
    note = _gdnkit_call(gdn)
    if note is None:
        row["gdnkit_ms"] = _event_time_ms(gdn, 2, reps)
        row["gdnkit_tflops"] = flops / (row["gdnkit_ms"] * 1e-3) / 1e12
    else:
        row["note"] = note
    if fla_chunk is not None:
        row["fla_ms"] = _event_time_ms(fla, 2, reps)
        row["fla_tflops"] = flops / (row["fla_ms"] * 1e-3) / 1e12
    if "gdnkit_ms" in row and "fla_ms" in row:
        row["ratio"] = row["gdnkit_ms"] / row["fla_ms"]
        pool.copy_(h0)
        gdn()
        fla_o, fla_ht = fla()
        row["rel_o"] = _rel(o, fla_o)
        row["rel_state"] = _rel(pool, fla_ht)
    del q, k, v, a, b, o, pool, h0
    torch.cuda.empty_cache()
    return row


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def markdown(meta: Dict, rows: List[Dict]) -> str:
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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdnkit.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-out", help="folder for fla_compare.json and fla_compare.md")
    ap.add_argument("--ops", default="decode,verify,prefill", help="comma list of decode, verify, prefill")
    ap.add_argument("--shape", default="qwen3-next", choices=list(SHAPES), help="heads (docs/benchmarks.md)")
    ap.add_argument("--layout", default="k_last", choices=["k_last", "v_last"],
                    help="state layout for both (FLA: state_v_first = layout == k_last)")
    ap.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes")
    ap.add_argument("--verify", default=",".join(f"{b}x{t}" for b, t in VERIFY_ROWS),
                    help="verify rows BxT (B sequences of T draft tokens)")
    ap.add_argument("--sets", default=",".join(PREFILL_SETS), help="prefill sequence sets (docs/benchmarks.md)")
    ap.add_argument("--replays", type=int, default=20, help="decode graph replays (median)")
    ap.add_argument("--reps", type=int, default=10, help="prefill timed calls (median)")
    args = ap.parse_args(argv)
    global H, HV
    H, HV = SHAPES[args.shape]

    torch = _torch()
    if not torch.cuda.is_available():
        print("[bench] needs a CUDA device", file=sys.stderr)
        return 2
    import gdnkit

    fla_chunk, fla_recurrent, fla_version = _fla()
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, fla_version=fla_version or "n/a",
                gdnkit=gdnkit.build_info(), python=platform.python_version(), layout=args.layout, l2_bytes=l2,
                shape=args.shape,
                heads=dict(H=H, HV=HV, K=K, V=V), dtype="bf16 q/k/v/a/b, fp32 state",
                command="python -m gdnkit.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    meta["copy_ceiling_tbps"] = copy_ceiling_tbps()
    rows: List[Dict] = []
    ops = args.ops.split(",")
    if "decode" in ops:
        for B in [int(x) for x in args.batches.split(",") if x]:
            rows.append(bench_decode(B, args.layout, fla_recurrent, l2, args.replays))
            print(json.dumps(rows[-1]), flush=True)
    if "verify" in ops:
        for spec in [x for x in args.verify.split(",") if x]:
            B, T = (int(x) for x in spec.split("x"))
            rows.append(bench_decode(B, args.layout, fla_recurrent, l2, args.replays, T=T))
            print(json.dumps(rows[-1]), flush=True)
    if "prefill" in ops:
        for name in [x for x in args.sets.split(",") if x]:
            lens = PREFILL_SETS[name]
            reps = args.reps if sum(lens) < 200000 else max(5, args.reps // 2)
            rows.append(bench_prefill(name, lens, args.layout, fla_chunk, reps))
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fla_compare.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = markdown(meta, rows)
    with open(os.path.join(args.out, "fla_compare.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
