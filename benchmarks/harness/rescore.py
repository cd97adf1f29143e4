"""S at a timed run's measured costs, on the counts of record.

    .venv/bin/python -m benchmarks.harness.rescore --counts benchmarks/results/harness_eagle3_mixed/report.json \\
        --timed benchmarks/results/regime_eagle3_mixed/fresh_epyc2/report.json

A regime run measures c = t_T / t_D and each policy's in-engine cost f on its batch-1 timed cells (16
prompts x 64 tokens), and its own counts come from those few tokens. The counts of record (the full
plan's count cells: 100 prompts x 128 tokens) are eight times larger, but their report has no c for the
drafter (its family ran counts only). This prices those counts at the timed run's c, charging each
adaptive row the f measured for the same configuration in the timed run: vLLM's fixed-K rows (no policy),
the oracle replay, and the plugin rows the timed run also ran. Rows the timed run did not time are left
out rather than charged a cost from another batch size. Greedy outputs are the same at every batch size
(the lossless check), so a batch-32 count cell's acceptance stands for batch 1's up to the draft's own
rounding. Prints, at the measured c and at c = 4 (both charging the timed f), each row's S, its ratio to
the best fixed K and its share of the oracle's gain over the best fixed K (in brackets), and writes them
(`rescored.json` beside the timed report unless --out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.harness.report import C_PAPER, _charged_speedup, best_of_kinds, oracle_share_lines, row_kinds

M, M4 = "S_measured_c", "S_c4"  # the timed run's c, and the papers' c = 4, each charging the timed run's f
LABELS = ((M, "S at measured c"), (M4, "S at c = 4"))


def timed_costs(timed: dict[str, Any]) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """From a timed report: workload -> c of its batch-1 greedy cell, (config, workload) -> f there."""
    cs = {key.split("/")[1]: r["c"] for key, r in timed["cost_ratios"].items() if key.endswith("/b1/t0")}
    fs = {
        (r["config"], r["cell"]["workload"]): r["policy_cost_frac_of_draft_step"]
        for r in timed["rows"]
        if r["cell"]["batch"] == 1 and r["kind"] == "plugin" and r["policy_cost_frac_of_draft_step"] is not None
    }
    return cs, fs


def rescore(counts: dict[str, Any], timed: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """count cell key -> {c, per S column its best fixed K and oracle, rows, lines}: each count cell's rows
    priced at the timed run's c (of the same workload) and at c = 4, charging the timed run's f."""
    cs, fs = timed_costs(timed)
    out: dict[str, dict[str, Any]] = {}
    for key in sorted({r["cell"]["key"] for r in counts["rows"] if not r["cell"]["timed"]}):
        workload = key.split("/")[1]
        if workload not in cs:
            continue
        c = cs[workload]
        rows = []
        for r in (r for r in counts["rows"] if r["cell"]["key"] == key and r["kind"] != "nospec"):
            f = 0.0 if r["kind"] == "vllm" else fs.get((r["config"], workload))
            if f is not None:
                rows.append(
                    r | {"f_timed": f} | {m: _charged_speedup(r, x, f, r["method"]) for m, x in ((M, c), (M4, C_PAPER))}
                )
        method = next((r["method"] for r in rows if r["family"] == "fixed K"), "draft_model")
        replay = [
            o | {m: _charged_speedup(o, x, 0.0, method) for m, x in ((M, c), (M4, C_PAPER))}
            for o in counts["replay"]
            if o["cell"]["key"] == key
        ]
        rows.sort(key=lambda r: -r[M])
        table = [{"config": r["config"], "f": r["f_timed"]} for r in rows]
        summary = {}
        for metric in (M, M4):
            fixed = max((r[metric] for r in row_kinds(rows)["fixed K"]), default=None)
            oracle = max((o[metric] for o in replay if o["oracle"]), default=None)
            summary[metric] = {"best_fixed_K": fixed, "oracle": oracle}
            for t, r in zip(table, rows):
                t[metric] = {
                    "S": r[metric],
                    "vs_best_fixed_K": r[metric] / fixed if fixed else None,
                    # (S - S_fixed) / (S_oracle - S_fixed): the share of the oracle's gain over the best fixed K
                    "oracle_gain_share": (r[metric] - fixed) / (oracle - fixed)
                    if fixed and oracle and oracle > fixed
                    else None,
                }
        lines = best_of_kinds(rows, LABELS) + oracle_share_lines(rows, replay, LABELS)
        out[key] = {"c": c, **summary, "rows": table, "lines": lines}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=Path, required=True, help="report.json with the count cells of record")
    ap.add_argument("--timed", type=Path, required=True, help="report.json of a run with timed batch-1 cells")
    ap.add_argument("--out", type=Path, default=None, help="JSON to write (default: rescored.json beside --timed)")
    args = ap.parse_args()
    result = rescore(json.loads(args.counts.read_text()), json.loads(args.timed.read_text()))
    if not result:
        raise SystemExit(f"no workload of {args.counts} has a timed batch-1 cell in {args.timed}")
    for key, res in result.items():
        print(f"{key} at c {res['c']:.2f} (from {args.timed}):")
        for line in res["lines"]:
            print(f"  - {line}")
        for r in res["rows"]:
            cols = [
                f"{label} S {r[m]['S']:.3f}"
                + ("" if r[m]["vs_best_fixed_K"] is None else f" {r[m]['vs_best_fixed_K']:.3f}x")
                + ("" if r[m]["oracle_gain_share"] is None else f" ({r[m]['oracle_gain_share']:.1%})")
                for m, label in ((M, "measured c:"), (M4, "c = 4:"))
            ]
            print(f"    {r['config']:40} f {r['f']:4.1%}  " + "  ".join(cols))
    out = args.out or args.timed.with_name("rescored.json")
    out.write_text(json.dumps({"counts": str(args.counts), "timed": str(args.timed), "cells": result}, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
