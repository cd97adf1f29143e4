"""Replay ablations of the trained Pacer pre-verifier (no retraining).

    .venv/bin/python -m benchmarks.pacer_ablations --head heads/toy/pacer.safetensors \\
        --responses /tmp/vas_full/responses.jsonl --n-responses 500

On the held-out greedy responses the training run replayed (same hash split),
the exact greedy replay (cap 16, S at c = 4) for: halting mean / any / last,
growth 1.0 vs 1.05, block size 1..7, and the context the layer sees at
inference (the trained window, the full context, none). Each row is the best
threshold for its setting. Writes `<stem>.ablations.json` and `.md` next to
the head. The position-embedding ablation needs a retrained layer
(`train pacer --no-position`) and is not run here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_adaptive_spec.heads.pacer import load_pacer
from vllm_adaptive_spec.metrics import replay_row
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.pacer import TrainConfig, draft_chains, predict, replay_counts
from vllm_adaptive_spec.training.specdecpp import is_heldout

DRAFT = Path("benchmarks/models/toy-draft")


def best_row(alphas, chains, cfg: TrainConfig, block: int, growth: float, rule: str) -> dict:
    rows = [
        replay_row(
            {"block_size": block, "threshold": t, "growth": growth, "halting": rule},
            replay_counts(alphas, chains, cfg.cap, block, t, growth, rule)[0],
            cfg.cost_ratio,
        )
        for t in cfg.thresholds
    ]
    return max(rows, key=lambda r: r["speedup"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=Path("heads/toy/pacer.safetensors"))
    ap.add_argument("--responses", type=Path, required=True)
    ap.add_argument("--n-responses", type=int)
    ap.add_argument("--replay-responses", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layer, meta = load_pacer(args.head)
    cfg = TrainConfig()
    responses = data.load_responses(args.responses)[: args.n_responses]
    held = [r for r in responses if is_heldout(r, cfg.val_frac) and r.mode == "greedy"][: args.replay_responses]
    draft = data.load_causal_lm(DRAFT)
    chains = [draft_chains(draft, r, list(range(len(r.response_ids))), cfg.chain_length) for r in held]
    window = int(meta["context_window"])
    b0, g0, rule0 = int(meta["block_size"]), float(meta["growth"]), str(meta["halting"])
    sections: dict[str, list] = {}
    alphas = predict(layer, chains, window)
    sections["halting"] = [best_row(alphas, chains, cfg, b0, g0, rule) for rule in ("mean", "any", "last")]
    sections["growth"] = [best_row(alphas, chains, cfg, b0, g, rule0) for g in (1.0, 1.05)]
    sections["block_size"] = [best_row(alphas, chains, cfg, b, g0, rule0) for b in range(1, 8)]
    sections["context"] = []
    for name, w in ((f"window {window} (trained)", window), ("full", -1), ("none", 0)):
        row = best_row(predict(layer, chains, w), chains, cfg, b0, g0, rule0)
        sections["context"].append({"context": name, **row})
    result = {"head": str(args.head), "responses": len(chains), "cap": cfg.cap, "cost_ratio": cfg.cost_ratio}
    result["sections"] = sections
    stem = args.head.name.removesuffix(".safetensors")
    args.head.with_name(stem + ".ablations.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# Pacer replay ablations ({len(chains)} held-out responses, cap {cfg.cap}, S at c = {cfg.cost_ratio})",
        "",
        "Each row: the best threshold for that setting; the others at the layer's recommended values.",
        "Rebuild: `.venv/bin/python -m benchmarks.pacer_ablations --responses <responses.jsonl> --n-responses 500`",
    ]
    for name, rows in sections.items():
        keys = list(rows[0])
        lines += ["", f"## {name}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    args.head.with_name(stem + ".ablations.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
