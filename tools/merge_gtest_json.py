#!/usr/bin/env python3
"""Merge the JSON reports of a GoogleTest binary run in shards (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX) into one
report of the same format: the test suites of every shard, the counts summed, the longest shard's time, the source
paths relative to the repository.

    python3 tools/merge_gtest_json.py shard0.json shard1.json ... > gpu_tests.json
"""
import json
import sys


def main(paths):
    shards = [json.load(open(p)) for p in paths]
    out = {k: v for k, v in shards[0].items() if k != "testsuites"}
    for key in ("tests", "failures", "disabled", "errors"):
        out[key] = sum(int(s.get(key, 0)) for s in shards)
    out["time"] = max(shards, key=lambda s: float(s["time"].rstrip("s")))["time"]
    suites = {}
    for s in shards:
        for suite in s.get("testsuites", []):
            merged = suites.setdefault(suite["name"], {**suite, "testsuite": [], "tests": 0, "failures": 0,
                                                       "disabled": 0, "errors": 0})
            merged["testsuite"] += suite["testsuite"]
            for key in ("tests", "failures", "disabled", "errors"):
                merged[key] += int(suite.get(key, 0))
    for suite in suites.values():  # source paths relative to the repository, wherever it was built
        for case in suite["testsuite"]:
            if "file" in case and "/tests/" in case["file"]:
                case["file"] = "tests/" + case["file"].rsplit("/tests/", 1)[1]
    out["testsuites"] = list(suites.values())
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
