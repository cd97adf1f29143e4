"""What the batch gate costs per draft step, by batch size (microbenchmark, one thread).

    .venv/bin/python -m benchmarks.gate_cost [--out benchmarks/results/gate_cost]

The gate reads one feature per row, log q_max of the step's draft distribution
over the vocabulary (default 151,936 tokens, a real Qwen3's; the toy pair's is
6,144: `--vocab 6144`). Two ways to get it, timed on the
same log-distributions, interleaved, medians of repeats:
- `max pass`: a pass over [B, V] (what sampled batches still do, and what
  every batch did before `draft_top`, with a second pass for the NaN check);
- `greedy gather`: when every row is greedy its token is the argmax, and
  log q_max is a gather of B values (`batch_gate.draft_top`).
Plus the gate's own work: a whole round that it ends after one step
(start, one step, finish, grading after verification) and `after_step` from
the feature's host copy on (once per further draft step). Writes gate_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.paths import REPO
from vllm_adaptive_spec.policies.acceptance import max_log_odds
from vllm_adaptive_spec.policies.base import finite_rows
from vllm_adaptive_spec.policies.batch_gate import BatchGate, draft_top
from vllm_adaptive_spec.policies.costs import DEFAULT_COSTS

VOCAB = 151_936
BATCHES = (1, 4, 16, 32)


def _ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(batch: int, repeats: int, vocab: int = VOCAB) -> dict:
    logp = torch.log_softmax(torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)), -1)
    tokens = logp.argmax(-1)  # [B] greedy drafts
    ones = [True] * batch  # the gate reads the loop's host copy of each step's decisions
    lengths = [1] * batch
    gate = BatchGate(DEFAULT_COSTS)
    top = logp.amax(-1)

    req_ids = [str(i) for i in range(batch)]

    drafted, accepted = [1] * batch, [0] * batch

    def one_step_round() -> None:  # what a round costs when the gate ends it after one step
        gate.start_round(req_ids, 4)
        gate.after_step(top.tolist(), ones, ones, lengths, 0)
        gate.finish_round()
        gate.end_round(req_ids, drafted, accepted)

    def step() -> None:
        gate.after_step(top.tolist(), ones, ones, lengths, 0)

    fns = {
        "max pass + NaN check (before)": lambda: (finite_rows(logp), max_log_odds(logp)),
        "max pass (sampled batches)": lambda: draft_top(logp, tokens, greedy=False),
        "greedy gather": lambda: draft_top(logp, tokens, greedy=True),
        "gate round of one step (start, step, finish, grading)": one_step_round,
        "gate after_step (per step)": step,
    }
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved
        for name, fn in fns.items():
            samples[name].append(_ms(fn, 5))
    return {name: round(statistics.median(v), 4) for name, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gate_cost")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    args = ap.parse_args()
    torch.set_num_threads(1)  # vLLM's CPU engine runs its step on one core here
    rows = {b: measure(b, args.repeats, args.vocab) for b in BATCHES}
    for b, row in rows.items():
        print(f"batch {b:>2}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"vocab": args.vocab, "threads": 1, "repeats": args.repeats, "ms_per_draft_step": rows}
    (args.out / "gate_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'gate_cost.json'}")


if __name__ == "__main__":
    main()
