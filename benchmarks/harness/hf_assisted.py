"""HF transformers assisted generation on the toy pair: the peer outside vLLM.

    .venv/bin/python -m benchmarks.harness.hf_assisted --mode heuristic --value 5
    .venv/bin/python -m benchmarks.harness.hf_assisted --mode confidence --value 0.4 --workload prose_heldout
    .venv/bin/python -m benchmarks.harness.hf_assisted --mode plain

Target benchmarks/models/toy-target, assistant benchmarks/models/toy-draft,
float32 on CPU, batch size 1 (HF's assisted generation supports no other),
greedy decoding, one `generate` call per prompt. Stopping at the tokenizer's
EOS is left on, as in the vLLM runs (ignore_eos=False); N_gen counts what is
generated, EOS included.

Counts (ALGORITHMS.md "Metrics"), which HF does not report, come from
wrapping two methods of `AssistedCandidateGenerator` from the outside for the
duration of a run (`_instrumented`, which restores them): `get_candidates`
gives each round's draft length (N_D), `update_candidate_strategy(input_ids,
scores, num_matches)` runs once per target forward pass (N_T) with the
accepted count (N_acc, after HF's own crop at EOS or the length limit). Every
round appends num_matches + 1 tokens, so N_gen = N_T + N_acc, which is also
how the vLLM harness derives N_T. One difference in what a round is: HF's
first target pass is the prefill and already verifies a draft made from the
prompt, where vLLM's prefill step emits one token with no draft.

How HF (5.x, read in transformers/generation/candidate_generator.py, utils.py
and stopping_criteria.py) schedules the assistant:

- Every assistant setting is read from the *assistant model's*
  `generation_config` (deep-copied when each `generate` call builds its
  `AssistedCandidateGenerator`); passing `num_assistant_tokens=...` or
  `assistant_confidence_threshold=...` to the target's `generate` does not
  reach the assistant. This module sets them on the assistant's config before
  every call, so each prompt starts afresh, as a vLLM request does.
- Unset fields get HF's global defaults: num_assistant_tokens=20,
  num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.4.
  So HF's default assisted generation *is* the confidence rule with a fixed
  cap of 20 (the K=5 "heuristic" schedule was the 4.x default). Setting the
  threshold to None does not turn it off (None is replaced by 0.4); 0.0 does.
- The confidence rule is a stopping criterion of the assistant's own
  `generate`: after each drafted token y_t it stops if q_t(y_t) < threshold;
  y_t stays in the draft (ALGORITHMS.md "confidence"). The cap is
  num_assistant_tokens (and the room left before max_length).
- The schedule runs independently in `update_candidate_strategy`: with
  "heuristic" (or "heuristic_transient") K' = K + 2 when the round accepted
  every drafted token (num_matches == drafted), else max(1, K - 1), with no
  upper cap (unlike the plugin's heuristic, capped at the engine's K); with
  "constant" K stays. Both can be combined; the default pairing with the
  threshold is "constant" with K=20, which mode "confidence" uses (the cap is
  `k_cap`). A round that stops early on confidence and is fully accepted
  counts as "all accepted" for the heuristic.
- With scikit-learn installed, HF also adapts the threshold within a
  `generate` call: it keeps every drafted token's q(y) and whether it was
  accepted, and after each round (given 6+ samples of both outcomes) sets the
  threshold to the ROC point minimising FPR + 3 FNR. scikit-learn is not in
  this environment, so the threshold stays fixed (`threshold_adapts` in the
  result says which).
- In "heuristic" mode this module sets the threshold to 0.0, otherwise HF's
  default 0.4 would also be active.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import Counter
from functools import lru_cache

import torch

from benchmarks.paths import DRAFT, TARGET, load_prompts

MODES = ("heuristic", "confidence")
DEFAULT_K_CAP = 20  # HF's num_assistant_tokens default, the cap with the confidence rule


@lru_cache(maxsize=1)
def _load():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    return tok, target, draft


def _encode(tok, prompts: list[str]) -> list[torch.Tensor]:
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids  # [1, T]
        # vLLM encodes with the same post-processor: BOS first.
        if ids[0, 0].item() != tok.bos_token_id:
            raise RuntimeError(f"prompt does not start with BOS: {ids[0, :4].tolist()}")
        out.append(ids)
    return out


class _Stats:
    def __init__(self) -> None:
        self.n_target = 0
        self.n_draft = 0
        self.n_accepted = 0
        self.hist: Counter[int] = Counter()
        self._pending: list[int] = []  # draft lengths of rounds not yet verified

    def drafted(self, n: int) -> None:
        self._pending.append(n)

    def verified(self, num_matches: int) -> None:
        n = self._pending.pop(0) if self._pending else 0
        self.n_target += 1
        self.n_draft += n
        self.n_accepted += int(num_matches)
        self.hist[n] += 1


@contextlib.contextmanager
def _instrumented(stats: _Stats):
    """Counts rounds, drafted and accepted tokens of every AssistedCandidateGenerator while active."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator as ACG

    orig_get, orig_update = ACG.get_candidates, ACG.update_candidate_strategy

    def get_candidates(self, input_ids, *args, **kwargs):
        cand, logits = orig_get(self, input_ids, *args, **kwargs)
        stats.drafted(cand.shape[-1] - input_ids.shape[-1])
        return cand, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        stats.verified(int(num_matches))
        return orig_update(self, input_ids, scores, num_matches)

    ACG.get_candidates, ACG.update_candidate_strategy = get_candidates, update_candidate_strategy
    try:
        yield stats
    finally:
        ACG.get_candidates, ACG.update_candidate_strategy = orig_get, orig_update


def _configure_assistant(draft, mode: str, value: float | int, k_cap: int) -> None:
    gc = draft.generation_config
    if mode == "heuristic":
        gc.num_assistant_tokens = int(value)
        gc.num_assistant_tokens_schedule = "heuristic"
        gc.assistant_confidence_threshold = 0.0  # 0.0 disables; None would become HF's default 0.4
    elif mode == "confidence":
        gc.num_assistant_tokens = int(k_cap)
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = float(value)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _generate(target, tok, ids: torch.Tensor, max_new_tokens: int, assistant=None) -> list[int]:
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        assistant_model=assistant,
    )
    return out[0, ids.shape[1] :].tolist()


def _run(prompts, max_new_tokens: int, repeats: int, assistant=None, configure=None) -> dict:
    tok, target, _ = _load()
    encoded = _encode(tok, prompts)
    with torch.inference_mode():
        if configure:
            configure()
        _generate(target, tok, encoded[0], min(8, max_new_tokens), assistant)  # warm-up
        seconds, outputs, first = [], None, None
        for r in range(max(1, repeats)):
            stats = _Stats()
            with _instrumented(stats):
                t0 = time.perf_counter()
                outs = []
                for ids in encoded:
                    if configure:
                        configure()  # every prompt starts from the initial K / threshold
                    outs.append(_generate(target, tok, ids, max_new_tokens, assistant))
                seconds.append(time.perf_counter() - t0)
            if r == 0:
                outputs, first = outs, stats
    n_gen = sum(len(o) for o in outputs)
    return {
        "n_gen": n_gen,
        "n_target": first.n_target if assistant is not None else n_gen,
        "n_draft": first.n_draft,
        "n_accepted": first.n_accepted,
        "seconds": seconds,
        "tokens_per_s": [n_gen / s for s in seconds],
        "outputs": outputs,
        "draft_len_hist": dict(sorted(first.hist.items())),
    }


def run_assisted(
    prompts: list[str],
    max_new_tokens: int,
    mode: str,
    value: float | int,
    repeats: int = 1,
    *,
    k_cap: int = DEFAULT_K_CAP,
) -> dict:
    """Assisted generation over `prompts`, one at a time.

    mode "heuristic": value is the initial K (HF default 5 in 4.x), schedule
    "heuristic", no confidence stop. mode "confidence": value is
    assistant_confidence_threshold, schedule "constant" with cap `k_cap`
    (HF's defaults: 20). Returns counts (first repeat), per-repeat wall time
    of the whole prompt set after a warm-up, outputs of the first repeat and
    {draft length: rounds}.
    """
    from transformers.utils import is_sklearn_available

    _, _, draft = _load()
    result = _run(prompts, max_new_tokens, repeats, draft, lambda: _configure_assistant(draft, mode, value, k_cap))
    if result["n_target"] + result["n_accepted"] != result["n_gen"]:
        raise RuntimeError(f"counts disagree: {result['n_target']} + {result['n_accepted']} != {result['n_gen']}")
    result["threshold_adapts"] = mode == "confidence" and is_sklearn_available()
    return result


def run_plain(prompts: list[str], max_new_tokens: int, repeats: int = 1) -> dict:
    """HF greedy decoding with the target alone: n_target = n_gen, no draft."""
    return _run(prompts, max_new_tokens, repeats)


def summary(result: dict) -> dict:
    n_gen = result["n_gen"]
    return {
        "tau": round(n_gen / result["n_target"], 4) if result["n_target"] else None,
        "draft_per_token": round(result["n_draft"] / n_gen, 4) if n_gen else None,
        "discard_rate": round((result["n_draft"] - result["n_accepted"]) / n_gen, 4) if n_gen else None,
        "tokens_per_s": round(statistics.median(result["tokens_per_s"]), 2),
        **{k: result[k] for k in ("n_gen", "n_target", "n_draft", "n_accepted")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("plain", *MODES), default="heuristic")
    ap.add_argument("--value", type=float, default=None, help="initial K (heuristic, default 5) or threshold (0.4)")
    ap.add_argument("--k-cap", type=int, default=DEFAULT_K_CAP, help="confidence mode: num_assistant_tokens")
    ap.add_argument("--n-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workload", choices=("code_heldout", "prose_heldout"), default="code_heldout")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's own setting)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = load_prompts(args.workload, args.n_prompts)
    line = {"workload": args.workload, "n_prompts": len(prompts), "max_tokens": args.max_tokens, "mode": args.mode}
    line["threads"] = torch.get_num_threads()
    plain = run_plain(prompts, args.max_tokens, args.repeats)
    if args.mode == "plain":
        line.update(summary(plain))
    else:
        value = args.value if args.value is not None else (5 if args.mode == "heuristic" else 0.4)
        res = run_assisted(prompts, args.max_tokens, args.mode, value, args.repeats, k_cap=args.k_cap)
        line.update(value=value, **summary(res))
        line["plain_tokens_per_s"] = summary(plain)["tokens_per_s"]
        line["equal_to_plain"] = res["outputs"] == plain["outputs"]
        line["n_differ"] = sum(a != b for a, b in zip(res["outputs"], plain["outputs"]))
        line["draft_len_hist"] = res["draft_len_hist"]
        line["threshold_adapts"] = res["threshold_adapts"]
    print(json.dumps(line))


if __name__ == "__main__":
    main()
