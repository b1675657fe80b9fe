#!/usr/bin/env python3
"""Plots of `gdnkit bench` JSON files (docs/benchmarks.md "Output").

    python3 tools/plot_bench.py bench_decode.json bench_verify.json bench_prefill.json --out DIR

Writes into DIR (default: $OUT, else the current folder), for the ops present in the files:
  decode_bandwidth.png   achieved TB/s vs batch, one line per shape/state/layout, copy ceiling drawn in
  verify_bandwidth.png   achieved TB/s vs batch per mode, one line per draft length T, copy ceiling drawn in
  prefill_time.png       ms vs total tokens per shape (log-log) with each point's memory floor, and
                         nominal TFLOP/s per sequence set
Rows whose status is not "ok" are skipped (they are in the tables). Needs matplotlib.
"""
import argparse
import json
import os
import sys
from collections import defaultdict


def load(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def ok_rows(runs, op):
    return [r for run in runs for r in run["rows"] if r["op"] == op and r["status"] == "ok" and r.get("time_us")]


def title_of(runs, what):
    devices = sorted({run["device"]["name"] for run in runs})
    return f"gdnkit {what}: {', '.join(devices)}"


def bandwidth_units(runs):
    """TB/s on GPUs; the CPU fallback's numbers are drawn in GB/s."""
    cpu = any(run.get("backend") == "cpu" for run in runs)
    return (1e3, "GB/s") if cpu else (1.0, "TB/s")


def draw_ceiling(ax, runs, op, scale, unit):
    """The copy ceiling of each run that measured `op` (the one its rows are a percentage of)."""
    ceilings = sorted({run["copy_ceiling"]["tbps"] for run in runs
                       if run["copy_ceiling"].get("tbps") and any(r["op"] == op for r in run["rows"])})
    for i, c in enumerate(ceilings):
        ax.axhline(c * scale, color="black", linestyle="--", linewidth=1,
                   label=f"copy ceiling {c * scale:.2f} {unit}" if i == 0 or len(ceilings) > 1 else None)


def short(row):
    state = {"float32": "fp32", "bfloat16": "bf16"}.get(row["state_dtype"], row["state_dtype"])
    return f"{row['shape']} {state} {row['layout']}"


def plot_decode(plt, runs, out):
    rows = ok_rows(runs, "decode")
    if not rows:
        return None
    scale, unit = bandwidth_units(runs)
    fig, ax = plt.subplots(figsize=(8, 5))
    lines = defaultdict(list)
    for r in rows:
        lines[short(r)].append((r["batch"], r["tbps"] * scale))
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    draw_ceiling(ax, runs, "decode", scale, unit)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch B (sequences, one token each)")
    ax.set_ylabel(f"achieved {unit} (state + q, k, v, o, gates)")
    ax.set_ylim(bottom=0)
    ax.set_title(title_of(runs, "decode, cold L2"))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path = os.path.join(out, "decode_bandwidth.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_verify(plt, runs, out):
    rows = ok_rows(runs, "verify")
    if not rows:
        return None
    scale, unit = bandwidth_units(runs)
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        lines = defaultdict(list)
        for r in rows:
            if r["mode"] == mode:
                lines[(short(r), r["draft_tokens"])].append((r["batch"], r["tbps"] * scale))
        for (label, t), pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"T={t} {label}")
        draw_ceiling(ax, runs, "verify", scale, unit)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch B")
        ax.set_ylabel(f"achieved {unit}")
        ax.set_ylim(bottom=0)
        ax.set_title(mode)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title_of(runs, "verify, cold L2"))
    path = os.path.join(out, "verify_bandwidth.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_prefill(plt, runs, out):
    rows = ok_rows(runs, "prefill")
    if not rows:
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [1, 1.2]})
    groups = defaultdict(list)
    for r in rows:
        groups[short(r) + (f" {r['mode']}" if r.get("mode") else "")].append(r)
    # Left: time vs total tokens (log-log), each point with its memory floor.
    for label, rs in sorted(groups.items()):
        rs.sort(key=lambda r: (r["total_tokens"], r["seqs"]))
        x = [r["total_tokens"] for r in rs]
        line, = ax.plot(x, [r["time_us"] / 1e3 for r in rs], marker="o", linestyle="none", label=label)
        floors = [(r["total_tokens"], r["floor_us"] / 1e3) for r in rs if r.get("floor_us")]
        if floors:
            ax.plot([f[0] for f in floors], [f[1] for f in floors], marker="_", markersize=12, linestyle="none",
                    color=line.get_color(), alpha=0.6, label=f"{label}: memory floor at the copy ceiling")
        for r in rs:
            ax.annotate(r["seqs"], (r["total_tokens"], r["time_us"] / 1e3), fontsize=6,
                        textcoords="offset points", xytext=(4, 3))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("total tokens T (all sequences)")
    ax.set_ylabel("ms per prefill (whole op)")
    ax.set_title("time vs tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    # Right: nominal TFLOP/s per sequence set (NxL = N sequences of L tokens), grouped bars.
    sets = []
    for r in sorted(rows, key=lambda r: (r["total_tokens"], r["seqs"])):
        if r["seqs"] not in sets:
            sets.append(r["seqs"])
    width = 0.8 / max(1, len(groups))
    cpu = any(run.get("backend") == "cpu" for run in runs)
    scale, unit = (1e3, "GFLOP/s") if cpu else (1.0, "TFLOP/s")
    for i, (label, rs) in enumerate(sorted(groups.items())):
        by_set = {r["seqs"]: r["tflops"] * scale for r in rs if r.get("tflops")}
        xs = [j + (i - (len(groups) - 1) / 2) * width for j, name in enumerate(sets) if name in by_set]
        bx.bar(xs, [by_set[name] for name in sets if name in by_set], width=width, label=label)
    bx.set_xticks(range(len(sets)))
    bx.set_xticklabels(sets, rotation=45, ha="right", fontsize=8)
    bx.set_ylabel(f"nominal {unit} = 4 T HV K V / time")
    bx.set_title("throughput per sequence set (NxL = N sequences of L tokens)")
    bx.grid(True, axis="y", alpha=0.3)
    bx.legend(fontsize=7)
    fig.suptitle(title_of(runs, "prefill"))
    path = os.path.join(out, "prefill_time.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="gdnkit bench --json files")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the PNGs")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_bench.py: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2
    runs = load(args.json)
    os.makedirs(args.out, exist_ok=True)
    written = [p for p in (plot_decode(plt, runs, args.out), plot_verify(plt, runs, args.out),
                           plot_prefill(plt, runs, args.out)) if p]
    for p in written:
        print(f"plot_bench.py: wrote {p}")
    if not written:
        print("plot_bench.py: no measured rows to plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
