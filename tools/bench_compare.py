#!/usr/bin/env python3
"""Side by side: µs per row of two or more `gdnkit bench --json` files of the same sweep (an A/B).

    python3 tools/bench_compare.py BEFORE.json AFTER.json [MORE.json ...]

One line per row of the first file: its key (shape, op, mode, state dtype, layout, T, B, sequence set), the µs of each file,
the last file's time over the first's, and the last file's % of its own copy ceiling.
"""
import json
import sys


def shape_name(row):
    s = row.get("shape") or ""
    return s if isinstance(s, str) else s.get("name", "")


def key(row):
    # prefill's mode names the path the library took (short, chunked), which an A/B may change
    return (shape_name(row), row["op"], "" if row["op"] == "prefill" else row.get("mode") or "", row["state_dtype"], row["layout"], row.get("draft_tokens") or 0,
            row["batch"], row.get("seqs") or "")


def main(paths):
    if len(paths) < 2:
        sys.exit(__doc__)
    runs = [{key(r): r for r in json.load(open(p))["rows"]} for p in paths]
    print("row", *[p.split("/")[-1] for p in paths], "last/first", "% copy (last)")
    for k, first in runs[0].items():
        t = [run[k]["time_us"] if k in run and run[k]["time_us"] else float("nan") for run in runs]
        last = runs[-1].get(k, {})
        pct = last.get("pct_copy_ceiling") or float("nan")
        print(" ".join(str(x) for x in k if x != ""), " ".join(f"{x:9.2f}" for x in t), f"{t[-1] / t[0]:.3f}",
              f"{pct:.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
