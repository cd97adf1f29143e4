"""Does "the draft repeats its context" say more about acceptance than q_t does? (the `copy` policy)

    (head -150 benchmarks/prompts/code_train.jsonl; head -150 benchmarks/prompts/prose_train.jsonl) \\
        > /tmp/mixed300.jsonl
    .venv/bin/python -m benchmarks.copy_signal --drafter draft_model --responses /tmp/mixed300_responses.jsonl \\
        --prompts /tmp/mixed300.jsonl --out benchmarks/results/copy_signal/draft_model.json
    .venv/bin/python -m benchmarks.copy_signal --drafter eagle3 --draft heads/toy/eagle3-mixed \\
        --responses /tmp/mixed300_responses.jsonl --cost-ratios 4 6.5 12 \\
        --out benchmarks/results/copy_signal/eagle3-mixed.json

--responses: the toy target's greedy responses (128 tokens) to training prompts, the file
`vllm-adaptive-spec tune` and `train` read and write; with --prompts it is generated through vLLM when
it is missing. The first --n greedy responses are replayed, greedy rounds at cap 16,
exactly as `tune` replays them (`training/tune.py`): an independent draft model teacher-forced (exact
while a chain agrees), an EAGLE-3 head on its own chains. At every draft step the copy feature is the
policy's: y_t continues a trigram of the context before the round (the two tokens before y_t, drafts
of the round included, followed by y_t somewhere in the prompt and output up to the round's bonus
token). The responses are split in two halves by a hash of the prompt; on each, the threshold of
confidence (stop if q_t < t) and of copy (stop if y_t repeats nothing and q_t < t) is chosen on the
other half's replay, and scored: S at each --cost-ratio, against the best fixed K and the oracle of
the scored half (no policy cost charged). It also prints (and saves as `repeat_runs`) the acceptance of
draft t by whether it repeats and whether every draft before it in its round did.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from benchmarks.paths import DRAFT, TARGET
from vllm_adaptive_spec.heads import eagle3
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.eagle3 import accepted_prefix, target_features
from vllm_adaptive_spec.training.tune import (
    ChainFeatures,
    TuneConfig,
    _features,
    baselines,
    draft_model_features,
    replay_rule,
    stop_lengths,
)

CAP = 16
GRID = [round(0.05 * i, 2) for i in range(1, 20)] + [1.0]


def first_ends(ids: list[int]) -> dict[tuple[int, int, int], int]:
    """Each trigram of ids -> the position of its last token at its first occurrence."""
    out: dict[tuple[int, int, int], int] = {}
    for e in range(2, len(ids)):
        out.setdefault((ids[e - 2], ids[e - 1], ids[e]), e)
    return out


def repeats(ids: list[int], before: list[int], drafts: list[list[int]], context_end: list[int]) -> torch.Tensor:
    """[C, cap] bool: chain c's draft t continues a trigram that ends at or before context_end[c]. Its
    key: before[c] (the two tokens before the round's first draft), then the chain's own drafts."""
    ends = first_ends(ids)
    rows = []
    for pair, chain, end in zip(before, drafts, context_end):
        a, b = pair
        row = []
        for y in chain:
            row.append(ends.get((a, b, y), len(ids)) <= end)
            a, b = b, y
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


@torch.no_grad()
def draft_model_chains(draft_lm, resp: data.Response) -> tuple[ChainFeatures, torch.Tensor]:
    """The draft model's round at every response position (`tune.draft_model_features`) and its repeats.
    Round j's bonus token is response position s = P + j; step t reads position s + t (teacher-forced)."""
    feats = draft_model_features(draft_lm, resp, CAP)
    ids = resp.prompt_ids + resp.response_ids
    n = len(ids)
    argmax = draft_lm(input_ids=torch.tensor(ids)[None]).logits[0].argmax(-1)  # [L]
    starts = list(range(len(resp.prompt_ids), n - 1))
    where = (torch.tensor(starts)[:, None] + torch.arange(CAP)[None, :]).clamp_max(n - 1)  # [C, cap]
    before = [(ids[s - 1], ids[s]) for s in starts]
    return feats, repeats(ids, before, argmax[where].tolist(), starts)


@torch.no_grad()
def eagle3_chains(head, target_lm, layer_ids, resp: data.Response) -> tuple[ChainFeatures, torch.Tensor]:
    """The head's own chain from every round start (as `specdecpp_eagle3.response_chains`) and its repeats.
    Chain c (start s) drafts x_{s+2}, ... after the context x_0 .. x_{s+1}."""
    seq = target_features(target_lm, resp, layer_ids)
    n, first = len(seq.ids), len(resp.prompt_ids)
    starts = torch.arange(first - 1, n - 2)
    tokens, states = eagle3.draft_chains(head, seq.ids[1:], seq.aux[: n - 1], starts, CAP, with_states=True)
    where = (starts[:, None] + 2 + torch.arange(CAP)[None, :]).clamp_max(n - 1)
    feats = _features(head.logits(states), accepted_prefix(tokens, seq.ids[where], n - 2 - starts))
    ids = seq.ids.tolist()
    s = starts.tolist()
    return feats, repeats(ids, [(ids[c], ids[c + 1]) for c in s], tokens.tolist(), [c + 1 for c in s])


def score(feats, copies, cost_ratios: list[float], prompts: list[list[int]]) -> dict:
    half = [int(hashlib.sha256(json.dumps(p).encode()).hexdigest(), 16) % 2 for p in prompts]
    rules = {
        "confidence": lambda th, i: stop_lengths(feats[i].q_max < th),
        "copy": lambda th, i: stop_lengths(~copies[i] & (feats[i].q_max < th)),
    }
    out = []
    for c in cost_ratios:
        cfg = TuneConfig(drafter="draft_model", cap=CAP, cost_ratio=c)
        for scored in (0, 1):
            test = [i for i, h in enumerate(half) if h == scored]
            train = [i for i, h in enumerate(half) if h != scored]

            def s(idx, rule, th, cfg=cfg):
                return replay_rule([feats[i] for i in idx], [rule(th, i) for i in idx], cfg, {})["speedup"]

            base = baselines([feats[i] for i in test], cfg)
            fixed, oracle = base["best_fixed"]["speedup"], base["oracle"]["speedup"]
            row = {"c": c, "scored_half": scored, "responses": len(test), "best_fixed_k": base["best_fixed"]}
            row["oracle"] = oracle
            for name, rule in rules.items():
                th = max(GRID, key=lambda t: s(train, rule, t))
                got = s(test, rule, th)
                row[name] = {
                    "threshold": th,
                    "speedup": got,
                    "vs_best_fixed": round(got / fixed, 4),
                    "oracle_share": round((got - fixed) / (oracle - fixed), 4),
                }
            out.append(row)
            print(
                f"c={c} half {scored}: fixed K={base['best_fixed']['fixed_k']} {fixed:.3f}, oracle {oracle:.3f}; "
                + "; ".join(
                    f"{n} {row[n]['threshold']}: {row[n]['speedup']:.3f} ({row[n]['vs_best_fixed']:.3f}x, "
                    f"{row[n]['oracle_share']:.0%} of the oracle's gain)"
                    for n in rules
                ),
                flush=True,
            )
    return {"rows": out, "repeat_share": round(float(torch.cat([x.flatten() for x in copies]).float().mean()), 4)}


def repeat_runs(feats, copies, steps: int = 8) -> list[dict]:
    """Acceptance of draft t by whether it repeats and whether drafts 0..t-1 of its round all did, over
    the chains that reached step t (drafts 0..t-1 accepted): the evidence a gate could read in a run of
    repeats. Returns one row per (t, prior all repeats, repeats) with drafts verified and accepted."""
    runs = torch.cat([f.runs for f in feats])  # [C] agreeing drafts from each round start
    rep = torch.cat(copies)  # [C, cap]
    prior = torch.cat([torch.ones_like(rep[:, :1]), torch.cumprod(rep.int(), 1)[:, :-1].bool()], 1)  # [C, cap]
    rows = []
    for t in range(min(steps, rep.shape[1])):
        reached, accepted = runs >= t, runs > t
        for all_before in (True, False):
            for repeats_now in (True, False):
                m = reached & (prior[:, t] == all_before) & (rep[:, t] == repeats_now)
                n = int(m.sum())
                if n:
                    a = int((m & accepted).sum())
                    rows.append(
                        {
                            "t": t,
                            "prior_all_repeats": all_before,
                            "repeats": repeats_now,
                            "n": n,
                            "accepted": a,
                            "rate": round(a / n, 4),
                        }
                    )
    return rows


def greedy_responses(ap: argparse.ArgumentParser, path: Path, prompts: Path | None) -> list[data.Response]:
    """The toy target's greedy responses in `path`, generated through vLLM from `prompts` when missing."""
    if not path.exists():
        if prompts is None:
            ap.error(f"--responses {path} does not exist; pass --prompts to generate it")
        from vllm_adaptive_spec.integration.datagen import generate_responses

        texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines() if line.strip()]
        data.save_responses(generate_responses(TARGET, texts, 128, ("greedy",), 1.0, 0), path)
    return [r for r in data.load_responses(path) if r.mode == "greedy" and len(r.response_ids) > 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=("draft_model", "eagle3"), default="draft_model")
    ap.add_argument("--draft", type=Path, help="the drafter's directory (default: the bundled one)")
    ap.add_argument("--responses", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, help="JSONL of prompts to generate --responses from when it is missing")
    ap.add_argument("--n", type=int, default=300, help="greedy responses replayed")
    ap.add_argument("--cost-ratios", type=float, nargs="*", default=[4.0, 6.5])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resps = greedy_responses(ap, args.responses, args.prompts)[: args.n]
    if args.drafter == "draft_model":
        lm = data.load_causal_lm(args.draft or DRAFT)
        got = [draft_model_chains(lm, r) for r in resps]
    else:
        target_lm = data.load_causal_lm(TARGET)
        head, cfg = eagle3.load_hf_dir(args.draft or "heads/toy/eagle3", target_lm.get_input_embeddings().weight)
        head.eval()
        got = [eagle3_chains(head, target_lm, cfg.aux_layer_ids, r) for r in resps]
    result = score([f for f, _ in got], [c for _, c in got], args.cost_ratios, [r.prompt_ids for r in resps])
    result["settings"] = {"drafter": args.drafter, "draft": str(args.draft or "bundled"), "responses": len(resps)}
    result["repeat_runs"] = repeat_runs([f for f, _ in got], [c for _, c in got])
    for row in result["repeat_runs"]:
        print(
            f"t={row['t']} drafts before all repeats: {row['prior_all_repeats']!s:5} repeats: {row['repeats']!s:5} "
            f"accepted {row['accepted']}/{row['n']} = {row['rate']:.3f}"
        )
    print(f"drafts that repeat a context trigram: {result['repeat_share']:.0%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
