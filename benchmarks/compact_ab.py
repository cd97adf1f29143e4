"""Does compacting the draft batch pay on this CPU? `compact_drafts` on and off, side by side.

    .venv/bin/python -m benchmarks.compact_ab [--method eagle3] [--batches 4 16 32] [--repeats 7] \\
        [--family code_heldout] [--draft-mlp-factor 20] --out benchmarks/results/compact_ab_eagle3

Per batch size, in one process (`loop_profile.ab`: every engine alive, taking turns on the same
2 x batch held-out prompts x 64 tokens, order rotated each repeat, greedy, ignore_eos): vLLM's K=2,
and the plugin with confidence 0.4 at cap 8 without the batch gate (rows stop one by one, so
compaction has rows to leave out) and with it (the default), each with `compact_drafts` off and on.
Prints and saves (OUT/b{batch}.json) each engine's median seconds, its per-repeat speed against
vLLM K=2, its draft forwards and the row computations compaction left out; the same tokens as
vLLM's are checked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function

CONFIGS: dict[str, tuple[int | None, dict | None]] = {
    "vLLM K=2": (2, None),
    "confidence 0.4, cap 8, no gate": (8, {"policy": "confidence", "batch_aware": False, "compact_drafts": False}),
    "confidence 0.4, cap 8, no gate, compacted": (
        8,
        {"policy": "confidence", "batch_aware": False, "compact_drafts": True},
    ),
    "confidence 0.4, cap 8, gate": (8, {"policy": "confidence", "compact_drafts": False}),
    "confidence 0.4, cap 8, gate, compacted": (8, {"policy": "confidence", "compact_drafts": True}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle3", choices=("draft_model", "eagle3"))
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--family", default="code_heldout")
    ap.add_argument("--draft-mlp-factor", type=int, default=1, help="a cost-scaled copy of the draft model")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: the worker in this process
    if args.draft_mlp_factor > 1:
        if args.method != "draft_model":
            ap.error("--draft-mlp-factor scales the draft model: --method draft_model")
        from benchmarks.scaled_models import use_scaled_copies

        use_scaled_copies(1, args.draft_mlp_factor)
    from benchmarks.loop_profile import ab

    args.out.mkdir(parents=True, exist_ok=True)
    # every plugin engine times its draft side (time_policy: a few perf_counter calls a step)
    configs = {n: (k, None if a is None else a | {"time_policy": True}) for n, (k, a) in CONFIGS.items()}
    for batch in args.batches:
        result = ab(args.method, 2, batch, args.repeats, configs, n_prompts=2 * batch, family=args.family)
        for name, row in result["engines"].items():
            loop = row.get("loop", {})
            print(
                f"b{batch} {name}: median {row['median_s']:.3f} s, {row['speed_vs_first']:.3f}x vLLM K=2 "
                f"{row['per_repeat']}, same tokens {row['same_tokens_as_first']}, {loop}",
                flush=True,
            )
        result["compacted_vs_not"] = paired(result["engines"])
        for name, got in result["compacted_vs_not"].items():
            print(f"b{batch} {name}: compacted / not: {got}")
        (args.out / f"b{batch}.json").write_text(json.dumps(result, indent=1) + "\n")


def paired(engines: dict) -> dict:
    """Per configuration: speed with compact_drafts over speed without, per repeat (both engines timed in
    the same repeat against the same vLLM K=2 run), and the median; and the draft side's time per round
    (the engine's own clock over the whole run) with compaction over without."""
    out = {}
    for name, row in engines.items():
        on = engines.get(f"{name}, compacted")
        if on is not None:
            ratios = [round(a / b, 4) for a, b in zip(on["per_repeat"], row["per_repeat"])]
            out[name] = {"median": statistics.median(ratios), "per_repeat": ratios}
            if "draft_ms_per_round" in on.get("loop", {}):
                out[name]["draft_side_per_round"] = round(
                    on["loop"]["draft_ms_per_round"] / row["loop"]["draft_ms_per_round"], 4
                )
    return out


if __name__ == "__main__":
    main()
