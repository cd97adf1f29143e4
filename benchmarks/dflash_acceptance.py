"""Per-position acceptance and mean acceptance length of DFlash drafters through vLLM.

    .venv/bin/python -m benchmarks.dflash_acceptance [--drafters heads/toy/dflash heads/toy/dflash-ce]
        [--workload code_heldout] [--n-prompts 200] [--max-tokens 128] [--batch 32] [--k 8]
        [--out benchmarks/results/dflash]

Plain vLLM `method: dflash` (no adaptive_spec) on the toy target, greedy, held-out
prompts (code by default) sent `batch` at a time (one `generate` call each, max_num_seqs =
batch). Counted as the harness counts (benchmarks/harness/worker.py), from vLLM's
per-request spec-decode metrics:
- N_gen: tokens returned; N_T: verification passes (the per-request histogram's
  sum) plus the prefill pass; tau = N_gen / N_T (exact);
- vLLM's mean acceptance length 1 + accepted / verify passes (its accepted count
  includes drafts accepted past max_tokens in a request's last round);
- per position k = 1..K: the share of verify passes whose accepted prefix reaches
  k (unconditional), and the share of those reaching k-1 that also accept k.
Also: whether the greedy output equals the target's without speculation, and an
offline replay of every request with the drafter's PyTorch module
(`training.dflash.replay_response`: HF target features, the block at each
round's anchor): rounds whose accepted count equals vLLM's (all but each
request's last round), a check that the module computes what vLLM runs.
Writes results.json and report.md under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from benchmarks import vllm_run  # noqa: F401  (sets vLLM's environment first)
from benchmarks.paths import REPO, TARGET, load_prompts

logger = logging.getLogger("benchmarks.dflash_acceptance")
DEFAULT_DRAFTERS = (REPO / "heads" / "toy" / "dflash", REPO / "heads" / "toy" / "dflash-ce")


def generate(llm, prompts: list[str], max_tokens: int, batch: int) -> list:
    params = vllm_run.greedy_params(max_tokens)
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
    return outs


def counts(outs: list, k: int) -> dict[str, Any]:
    """Exact counts and per-position acceptance from vLLM's per-request metrics."""
    hist = [0] * (k + 1)
    n_gen = n_target = n_draft = 0
    for o in outs:
        m = o.outputs[0].spec_decode_metrics
        n_gen += len(o.outputs[0].token_ids)
        n_target += sum(m.histogram) + 1
        n_draft += m.num_draft_tokens
        hist = [a + b for a, b in zip(hist, m.histogram)]
    passes = sum(hist)
    reach = [sum(hist[j:]) for j in range(1, k + 1)]  # passes whose accepted prefix reaches position j
    accepted = sum(reach)
    return {
        "n_gen": n_gen,
        "n_target": n_target,
        "n_draft": n_draft,
        "verify_passes": passes,
        "accepted_vllm": accepted,
        "tau": round(n_gen / n_target, 4),
        "mean_acceptance_length_vllm": round(1 + accepted / passes, 4),
        "accepted_histogram": hist,
        "acceptance_per_position": [round(r / passes, 4) for r in reach],
        "conditional_acceptance_per_position": [
            round(r / prev, 4) if prev else None for r, prev in zip(reach, [passes, *reach[:-1]])
        ],
    }


def replay_check(drafter_dir: Path, outs: list, k: int) -> dict[str, Any]:
    """Offline replay of each request with the PyTorch module, against vLLM's per-step counts."""
    import torch

    from vllm_adaptive_spec.heads.dflash import load_hf_dir
    from vllm_adaptive_spec.training import data
    from vllm_adaptive_spec.training.dflash import accepted_per_anchor, walk_rounds
    from vllm_adaptive_spec.training.eagle3 import target_features

    target = data.load_causal_lm(TARGET)
    drafter, cfg = load_hf_dir(drafter_dir, target.get_input_embeddings().weight, target.lm_head.weight)
    if cfg.block_size != k:  # vLLM's block has k masks: another function than the one trained
        return {"skipped": f"the drafter was trained for K = {cfg.block_size}, served at K = {k}"}
    same = total = requests_same = 0
    predicted_accepted = 0
    with torch.no_grad():
        for o in outs:
            resp = data.Response(list(o.prompt_token_ids), list(o.outputs[0].token_ids), "greedy")
            acc = accepted_per_anchor(drafter, target_features(target, resp, cfg.hf_layer_ids))
            theirs = list(o.outputs[0].spec_decode_metrics.per_step_accepted)
            # at each of vLLM's rounds (its anchors follow from its own counts), the module's block
            anchor, equal = 0, []
            for n in theirs[:-1]:
                equal.append(acc[anchor] == n)
                anchor += n + 1
            same, total = same + sum(equal), total + len(equal)
            requests_same += all(equal)
            predicted_accepted += sum(walk_rounds(acc))
    return {
        "rounds_compared": total,
        "rounds_equal": same,
        "requests_with_all_rounds_equal": requests_same,
        "requests": len(outs),
        "replay_accepted": predicted_accepted,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_prompts(args.workload, args.n_prompts)
    common = {"max_num_seqs": args.batch}
    llm = vllm_run.make_llm(**common)
    try:
        reference = [list(o.outputs[0].token_ids) for o in generate(llm, prompts, args.max_tokens, args.batch)]
    finally:
        vllm_run.close_llm(llm)
    results: dict[str, Any] = {
        "setup": {
            "target": str(TARGET.relative_to(REPO)),
            "prompts": f"{args.workload}[:{len(prompts)}]",
            "max_tokens": args.max_tokens,
            "batch": args.batch,
            "num_speculative_tokens": args.k,
            "decoding": "greedy",
        },
        "drafters": {},
    }
    for path in args.drafters:
        spec = {"method": "dflash", "model": str(path), "num_speculative_tokens": args.k}
        start = time.perf_counter()
        llm = vllm_run.make_llm(speculative_config=spec, per_request_spec_decode_metrics="detailed", **common)
        try:
            outs = generate(llm, prompts, args.max_tokens, args.batch)
        finally:
            vllm_run.close_llm(llm)
        seconds = time.perf_counter() - start
        row = counts(outs, args.k)
        row["greedy_equal_to_no_speculation"] = sum(list(o.outputs[0].token_ids) == r for o, r in zip(outs, reference))
        row["requests"] = len(outs)
        row["replay"] = replay_check(path, outs, args.k) if args.replay else {"skipped": "--no-replay"}
        row["engine_seconds"] = round(seconds, 1)
        results["drafters"][str(Path(path).relative_to(REPO)) if Path(path).is_relative_to(REPO) else str(path)] = row
        logger.info("%s: %s", path, row)
    return results


def report(results: dict[str, Any]) -> str:
    s = results["setup"]
    k = s["num_speculative_tokens"]
    lines = [
        "# DFlash drafters through vLLM",
        "",
        f"Target `{s['target']}`, {s['prompts']} x {s['max_tokens']} tokens, {s['decoding']}, batch {s['batch']}, "
        f"`method: dflash`, K = {k} (`python -m benchmarks.dflash_acceptance`).",
        "",
        "| drafter | tau = N_gen / N_T | vLLM mean acceptance length | greedy = no speculation | "
        "module replay: rounds equal |",
        "|---|---|---|---|---|",
    ]
    for name, r in results["drafters"].items():
        rp = r["replay"]
        replay = "-" if "skipped" in rp else f"{rp['rounds_equal']}/{rp['rounds_compared']}"
        lines.append(
            f"| `{name}` | {r['tau']:.3f} | {r['mean_acceptance_length_vllm']:.3f} | "
            f"{r['greedy_equal_to_no_speculation']}/{r['requests']} | {replay} |"
        )
    lines += ["", "Acceptance per position (share of verify passes whose accepted prefix reaches k):", ""]
    lines += ["| drafter | " + " | ".join(str(j) for j in range(1, k + 1)) + " |", "|---" * (k + 1) + "|"]
    for name, r in results["drafters"].items():
        lines.append(f"| `{name}` | " + " | ".join(f"{x:.3f}" for x in r["acceptance_per_position"]) + " |")
    lines += ["", "Conditional acceptance per position (reaches k, given it reached k-1):", ""]
    lines += ["| drafter | " + " | ".join(str(j) for j in range(1, k + 1)) + " |", "|---" * (k + 1) + "|"]
    for name, r in results["drafters"].items():
        cells = ["-" if x is None else f"{x:.3f}" for x in r["conditional_acceptance_per_position"]]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "N_T counts every target pass (the prefill included); vLLM's mean acceptance length counts verify "
        "passes only and drafts accepted past max_tokens. The replay drafts, at each of vLLM's rounds, the "
        "same anchor's block with the PyTorch module on the HF target's features and compares its accepted "
        "count with vLLM's per-step count (every round but each request's last).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafters", nargs="+", type=Path, default=list(DEFAULT_DRAFTERS))
    ap.add_argument("--workload", default="code_heldout", help="prompt family (benchmarks/prompts/<name>.jsonl)")
    ap.add_argument("--n-prompts", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dflash")
    ap.add_argument("--threads", type=int, help="torch threads for the offline replay")
    ap.add_argument(
        "--no-replay", dest="replay", action="store_false", help="skip the offline replay check (the slow part)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "report.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
