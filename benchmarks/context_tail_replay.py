"""What the context tail (adaptive_spec.context_tail, policies/tail.py) adds, replayed on training responses.

    (head -150 benchmarks/prompts/code_train.jsonl; head -150 benchmarks/prompts/prose_train.jsonl) \\
        > /tmp/mixed300.jsonl
    .venv/bin/python -m benchmarks.context_tail_replay --responses /tmp/mixed300_responses.jsonl \\
        --prompts /tmp/mixed300.jsonl --out benchmarks/results/context_tail_replay/draft_model.json

The toy target's greedy responses (128 tokens) to training prompts (the first 150 code, the next 150 prose,
as above), replayed with the bundled draft model teacher-forced (benchmarks.copy_signal: exact while a
chain agrees), greedy rounds at cap 16. Each round drafts what the rule says; with a tail of m, a row whose
context predicts its next token drafts one token instead, and after the drafts the tail appends up to m
tokens (never past the cap) that `ContextTail` predicts from the tokens known then (prompt, output, the
round's drafts); a tail token counts only where every draft before it was accepted. Also prompt lookup
alone (the tail with no draft model: what vLLM's `ngram` method drafts, though vLLM matches 2-4 tokens and
takes the earliest occurrence). S at c counts target passes and draft forwards (the tail and lookup cost
none), verification of any length at one pass's cost: a GPU's batch 1, not this CPU's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.copy_signal import draft_model_chains, greedy_responses
from benchmarks.paths import DRAFT
from vllm_adaptive_spec.policies.tail import ContextTail
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.tune import stop_lengths

CAP = 16
TAILS = (0, 4, 8, 15)


def replay(resp: data.Response, lengths: list[int], runs: list[int], tail: int, draft: bool = True) -> dict[str, int]:
    """One response: passes, draft forwards, tokens, tail tokens proposed and accepted."""
    ids = resp.prompt_ids + resp.response_ids
    first = len(resp.prompt_ids)
    n = len(resp.response_ids)
    ctx = ContextTail(tail)
    ctx.observe_tokens(["r"], [ids[: first + 1]])  # the prompt and token 0 (the prefill's)
    out = {"passes": 1, "drafts": 0, "tokens": 1, "tail_tokens": 0, "tail_accepted": 0}
    i = 1  # the next response token; round i's chain is chain i - 1 (copy_signal.draft_model_chains)
    while i < n:
        room = min(CAP, n - i - 1)  # room for the round's bonus token
        k = a = 0
        if draft:
            k = min(lengths[i - 1], room, 1 if tail and ctx.predicts("r") else CAP)
            a = min(runs[i - 1], k)
        # after a rejected draft the tail is proposed, never accepted: its length is what counts
        extra = ctx.tail("r", ids[first + i : first + i + a], room - k) if tail else []
        e = 0
        if a == k:
            while e < len(extra) and extra[e] == ids[first + i + k + e]:
                e += 1
        out["passes"] += 1
        out["drafts"] += k
        out["tail_tokens"] += len(extra)
        out["tail_accepted"] += e
        gained = a + e + 1
        ctx.observe_tokens(["r"], [ids[first + i : first + i + gained]])
        out["tokens"] += gained
        i += gained
    return out


def score(rows: list[dict[str, int]], c: float) -> dict[str, float]:
    tot = {k: sum(r[k] for r in rows) for k in rows[0]}
    return tot | {
        "tau": round(tot["tokens"] / tot["passes"], 4),
        "S": round(tot["tokens"] / (tot["passes"] + tot["drafts"] / c), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, help="JSONL of prompts to generate --responses from when it is missing")
    ap.add_argument("--cost-ratios", type=float, nargs="*", default=[4.0, 6.5])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resps = greedy_responses(ap, args.responses, args.prompts)
    lm = data.load_causal_lm(DRAFT)
    chains = [draft_model_chains(lm, r) for r in resps]
    rules = {
        "fixed K=1": lambda f, rep: torch.full_like(f.runs, 1),
        "fixed K=2": lambda f, rep: torch.full_like(f.runs, 2),
        "fixed K=3": lambda f, rep: torch.full_like(f.runs, 3),
        "copy 0.7": lambda f, rep: stop_lengths(~rep & (f.q_max < 0.7)),
        "confidence 0.4": lambda f, rep: stop_lengths(f.q_max < 0.4),
    }
    half = len(resps) // 2
    result: dict = {"responses": len(resps), "families": {"code": [0, half], "prose": [half, len(resps)]}, "rows": []}
    for family, (lo, hi) in result["families"].items():
        for c in args.cost_ratios:
            for name, rule in rules.items():
                for m in TAILS:
                    got = [
                        replay(resps[i], rule(*chains[i]).tolist(), chains[i][0].runs.tolist(), m)
                        for i in range(lo, hi)
                    ]
                    result["rows"].append({"family": family, "c": c, "rule": name, "tail": m} | score(got, c))
            for m in (4, 8, 15):  # prompt lookup alone: no draft model
                got = [replay(resps[i], [], [], m, draft=False) for i in range(lo, hi)]
                result["rows"].append({"family": family, "c": c, "rule": "lookup alone", "tail": m} | score(got, c))
    for row in result["rows"]:
        print(
            f"{row['family']:5} c={row['c']:<4} {row['rule']:15} tail {row['tail']:2}: S {row['S']:.3f} "
            f"tau {row['tau']:.2f} drafts/pass {row['drafts'] / row['passes']:.2f} "
            f"tail accepted {row['tail_accepted']}/{row['tail_tokens']}",
            flush=True,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
