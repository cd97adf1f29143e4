"""Runs one configuration over its cells, in its own process, and writes JSON.

    .venv/bin/python -m benchmarks.harness.worker JOB.json OUT.json

JOB holds the configuration, its cells and where the no-speculation outputs
live (the oracle reads them). Each cell: a short warm-up, then `repeats`
timed passes over its prompts: a count cell or a batch-1 cell sends `batch`
prompts at a time (one `generate` call per group); a timed cell of batch
b > 1 serves them all at concurrency b (continuous batching: a request
joins as soon as one finishes, as on a loaded server, instead of groups
that wait for their slowest member).

Counts are exact, and counted alike for every configuration: N_T is the
number of target passes that generated tokens (the prefill pass included),
N_gen the tokens returned.
- plugin configurations: the plugin's own per-step records (get_stats),
  which see every verification and never draft past max_tokens;
- vLLM configurations: the engine's passes that returned tokens to a
  request, counted by vLLM's latency histograms (one time-to-first-token per
  request, one inter-token latency per later pass: `passes`, equal to the
  engine steps at batch 1); N_D per request from vLLM's per-request
  spec-decode metrics (`per_request_spec_decode_metrics="summary"`); N_acc =
  N_gen - N_T (every pass emits one token of its own). Before 2026-12-06
  N_T was the passes that verified drafts (those metrics' histogram) plus
  the prefill pass: the same for draft models and heads, whose every later
  pass carries drafts (tests/e2e/test_exact_counts.py checks it against the
  plugin's records), but not for vLLM's prompt lookup (`ngram`), whose
  passes without a match draft nothing. vLLM's accepted counter also counts
  drafts accepted past max_tokens and then thrown away; it is kept as
  `n_accepted_vllm` for comparison.
N_D is the drafts sent to verification (vLLM's counter; for vLLM's fixed K
it includes drafts past max_tokens, real draft work). Plugin configurations
run with `time_policy` on: each cell stores the policy's time and the rest
of the draft side's time measured in that cell's own engine passes, the
one cost scale the report charges. Engine steps come from vLLM's iteration
histogram.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function

from benchmarks import vllm_run  # noqa: E402  (sets vLLM's environment first)
from benchmarks.harness.plan import Cell, Config, is_pearl  # noqa: E402
from benchmarks.paths import load_prompts  # noqa: E402
from vllm_adaptive_spec.parallel_draft import fractions  # noqa: E402


def token_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]


def sampling_params(cell: Cell, index: int):
    from vllm import SamplingParams

    if cell.temperature == 0.0:
        return SamplingParams(temperature=0.0, max_tokens=cell.max_tokens)
    return SamplingParams(temperature=cell.temperature, max_tokens=cell.max_tokens, seed=1000 + index)


def counters(llm) -> dict[str, int]:
    out = {"n_gen": 0, "n_draft": 0, "n_accepted_vllm": 0, "n_drafts": 0, "steps": 0, "passes": 0}
    for m in llm.get_metrics():
        if m.name == "vllm:generation_tokens":
            out["n_gen"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["n_draft"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["n_accepted_vllm"] += m.value
        elif m.name == "vllm:spec_decode_num_drafts":
            out["n_drafts"] += m.value
        elif m.name == "vllm:iteration_tokens_total":
            out["steps"] += m.count
        elif m.name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
            out["passes"] += m.count  # one per request's pass that returned tokens
    return out


def stats(llm) -> list[dict[str, Any]]:
    from vllm_adaptive_spec.integration.runtime import get_stats

    return get_stats(llm)


def plugin_totals(llm) -> dict[str, Any]:
    """The plugin's own records, summed over workers: exact counts, draft-length histogram,
    draft forwards per engine step and the policy's in-engine timing."""
    out: dict[str, Any] = {"n_gen": 0, "n_target": 0, "n_draft": 0, "n_accepted": 0, "n_drawn": 0, "n_tail": 0}
    out |= {"hist": {}, "proposed": {}, "forwards": {}, "tail_cut": 0, "none_rounds": 0}
    timing = {"policy_s": 0.0, "propose_s": 0.0, "decides": 0, "rounds": 0}
    timing |= {"steady_rounds": 0, "steady_gap_s": 0.0, "steady_target_s": 0.0, "gc_s": 0.0, "gc_runs": 0}
    parallel = dict.fromkeys(
        ("steps", "skipped", "timed_steps", "step_s", "draft_busy_s", "target_wait_s", "pre_drafted"), 0.0
    )
    for snap in stats(llm):
        for key in ("n_gen", "n_target", "n_draft", "n_accepted", "n_drawn", "n_tail"):
            out[key] += snap["workload"][key]
        out["tail_cut"] += snap["tail_cut"]
        out["none_rounds"] += snap.get("gate_none_rounds", 0)  # batch gate: rounds that verified no draft
        for name, src in (
            ("hist", "drafted_len_hist"),
            ("proposed", "proposed_len_hist"),
            ("forwards", "forwards_per_step"),
        ):
            for k, n in snap.get(src, {}).items():
                out[name][int(k)] = out[name].get(int(k), 0) + n
        for key in timing:
            timing[key] += snap.get("timing", {}).get(key, 0)
        for key in parallel:  # policy pearl: the draft thread's timeline
            parallel[key] += snap.get("parallel", {}).get(key, 0)
    return out | {"timing": timing, "parallel": parallel}


def _delta(after: dict, before: dict, repeats: int) -> dict:
    """Per-pass difference of two cumulative snapshots (nested dicts of numbers)."""
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = _delta(value, before.get(key, {}), repeats)
        else:
            out[key] = (value - before.get(key, 0)) / repeats
    return out


def request_counts(outs: list, speculative: bool) -> dict[str, int]:
    """N_gen, N_D, and N_T and N_acc as the passes that verified drafts (vLLM's per-request histogram)
    plus the prefill pass, of finished requests of an engine without the plugin: exact where every later
    pass drafts (draft models and heads; not prompt lookup: the harness counts the engine's `passes`)."""
    out = {"n_gen": 0, "n_target": 0, "n_draft": 0, "n_accepted": 0}
    for o in outs:
        n_gen = len(o.outputs[0].token_ids)
        m = o.outputs[0].spec_decode_metrics
        if speculative and m is None:
            raise RuntimeError("speculative engine without per-request spec-decode metrics (see make_llm's kwargs)")
        n_target = sum(m.histogram) + 1 if speculative else n_gen
        out["n_gen"] += n_gen
        out["n_target"] += n_target
        out["n_draft"] += m.num_draft_tokens if speculative else 0
        out["n_accepted"] += n_gen - n_target
    return out


_served = itertools.count()


def serve_at(llm, prompts: list[str], params: list, concurrency: int) -> list:
    """Continuous batching at a fixed concurrency, as a server under steady load: `concurrency` requests
    in flight, the next prompt joins as soon as one finishes. Returns the finished outputs in prompt order."""
    engine, tag = llm.llm_engine, f"served{next(_served)}-"
    done: dict[int, Any] = {}
    queued = 0
    while len(done) < len(prompts):
        while queued < len(prompts) and queued - len(done) < concurrency:
            engine.add_request(f"{tag}{queued}", prompts[queued], params[queued])
            queued += 1
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.removeprefix(tag))] = out
    return [done[i] for i in range(len(prompts))]


class CellRun:
    """One cell on one engine, in steps a coordinator can interleave with other engines:
    `CellRun(...)` warms up and snapshots the counters, `run_group(repeat, g)` times prompt group g,
    `finish()` returns the row. A timed cell of batch b > 1 is one group served at concurrency b
    (`serve_at`); any other cell runs one `generate` call of b prompts per group."""

    def __init__(self, llm, cell: Cell, kind: str):
        self.llm, self.cell, self.kind, self.plugin = llm, cell, kind, kind == "plugin"
        self.prompts = load_prompts(cell.workload, cell.n_prompts)
        self.params = [sampling_params(cell, i) for i in range(len(self.prompts))]
        self.served = cell.timed and cell.batch > 1
        size = len(self.prompts) if self.served else cell.batch
        self.groups = [(i, min(i + size, len(self.prompts))) for i in range(0, len(self.prompts), size)]
        llm.generate(self.prompts[:2], self.params[:2], use_tqdm=False)  # warm-up
        self.before, self.own0 = counters(llm), plugin_totals(llm) if self.plugin else {}
        self.seconds = [0.0] * cell.repeats
        self.outputs: list[list[int] | None] = [None] * len(self.prompts)
        self.exact: dict[str, float] = {}

    def run_group(self, repeat: int, g: int) -> float:
        lo, hi = self.groups[g]
        start = time.perf_counter()
        if self.served:
            outs = serve_at(self.llm, self.prompts[lo:hi], self.params[lo:hi], self.cell.batch)
        else:
            outs = self.llm.generate(self.prompts[lo:hi], self.params[lo:hi], use_tqdm=False)
        took = time.perf_counter() - start
        self.seconds[repeat] += took
        if repeat == 0:
            self.outputs[lo:hi] = [list(o.outputs[0].token_ids) for o in outs]
        if not self.plugin:
            counts = request_counts(outs, speculative=self.kind != "nospec")
            self.exact = {k: self.exact.get(k, 0) + v / self.cell.repeats for k, v in counts.items()}
        return took

    def finish(self) -> dict[str, Any]:
        cell, outputs = self.cell, self.outputs
        delta = _delta(counters(self.llm), self.before, cell.repeats)
        row: dict[str, Any] = {"cell": cell.__dict__ | {"key": cell.key}, "seconds": self.seconds}
        row["tokens_per_s"] = [sum(map(len, outputs)) / s for s in self.seconds]
        row |= delta  # vLLM's counters; the exact counts below replace n_gen and n_draft
        if self.plugin:
            own = _delta(plugin_totals(self.llm), self.own0, cell.repeats)
            row |= {k: own[k] for k in ("n_gen", "n_target", "n_draft", "n_accepted", "n_drawn", "n_tail")}
            row["n_tail_cut"] = own["tail_cut"]  # tail tokens the tail gate cut
            row["gate_none_rounds"] = own["none_rounds"]  # rounds the batch gate verified no draft in
            row["draft_len_hist"] = dict(sorted(own["hist"].items()))
            if own["proposed"]:  # context_tail: what each round sent to verification, tail included
                row["proposed_len_hist"] = dict(sorted(own["proposed"].items()))
            row["draft_forwards_per_step"] = dict(sorted(own["forwards"].items()))
            row["policy_timing"] = own["timing"]  # per pass, this cell's batch size
            if own["parallel"]["steps"]:
                row["parallel"] = own["parallel"] | fractions(own["parallel"])
            gate_costs = [snap["gate_costs"] for snap in stats(self.llm) if "gate_costs" in snap]
            if gate_costs:  # adaptive_spec.costs "online": the curves the gate decided on at the end
                row["gate_costs"] = gate_costs[0]
        else:
            if self.exact["n_gen"] and not delta["passes"]:  # the engine's metrics are another engine's
                raise RuntimeError("no pass counts from this engine's metrics: one engine per process")
            row |= self.exact | {"n_target": delta["passes"], "n_accepted": self.exact["n_gen"] - delta["passes"]}
            row["draft_len_hist"] = {}
        row["output_hashes"] = [token_hash(ids) for ids in outputs]
        row["_outputs"], row["_prompt_ids"] = outputs, None
        return row


def run_cell(llm, cell: Cell, kind: str) -> dict[str, Any]:
    """The cell alone on its engine: repeats one after another."""
    run = CellRun(llm, cell, kind)
    for repeat in range(cell.repeats):
        for g in range(len(run.groups)):
            run.run_group(repeat, g)
    return run.finish()


def make_engine(config: Config):
    """The configuration's engine on the toy pair (or the scaled copies benchmarks.paths points at)."""
    kwargs: dict[str, Any] = {}
    if config.dynamic is not None:
        kwargs["speculative_config"] = vllm_run.spec_config(config.k, config.method) | {
            "num_speculative_tokens_per_batch_size": config.dynamic
        }
    if config.kind == "vllm":
        kwargs["per_request_spec_decode_metrics"] = "summary"  # exact passes per request
    k = config.k if config.kind in ("vllm", "plugin") and config.dynamic is None else None
    adaptive = None if config.adaptive is None else {**config.adaptive, "time_policy": True}
    if is_pearl(config):  # one request at a time; no stopping rule to time (the thread keeps a timeline)
        adaptive, kwargs["max_num_seqs"] = config.adaptive, 1
    return vllm_run.make_llm(k=k, adaptive=adaptive, method=config.method, **kwargs)


def add_prompt_ids(llm, rows: list[dict]) -> None:
    """The oracle replays no-speculation outputs: it needs the exact prompt ids."""
    tok = llm.get_tokenizer()
    for row in rows:
        prompts = load_prompts(row["cell"]["workload"], row["cell"]["n_prompts"])
        row["_prompt_ids"] = [tok(p).input_ids for p in prompts]


def run_engine(config: Config, cells: list[Cell]) -> list[dict]:
    llm = make_engine(config)
    try:
        rows = [run_cell(llm, cell, config.kind) for cell in cells]
        if config.kind == "nospec":
            add_prompt_ids(llm, rows)
    finally:
        vllm_run.close_llm(llm)
    return rows


def run_hf(config: Config, cells: list[Cell]) -> list[dict]:
    from benchmarks.harness.hf_assisted import run_assisted

    rows = []
    for cell in cells:
        r = run_assisted(
            load_prompts(cell.workload, cell.n_prompts),
            cell.max_tokens,
            config.hf["mode"],
            config.hf["value"],
            repeats=cell.repeats,
        )
        rows.append(
            {
                "cell": cell.__dict__ | {"key": cell.key},
                "seconds": r["seconds"],
                "tokens_per_s": r["tokens_per_s"],
                "n_gen": r["n_gen"],
                "n_draft": r["n_draft"],
                "n_accepted": r["n_accepted"],
                "n_target": r["n_target"],
                "steps": r["n_target"],
                "draft_len_hist": r["draft_len_hist"],
                "output_hashes": [token_hash(ids) for ids in r["outputs"]],
            }
        )
    return rows


def eagle3_runs(prompt_ids: list[list[int]], outputs: list[list[int]], cap: int) -> list[list[int]]:
    """runs[r][i]: how many of the EAGLE-3 head's greedy drafts agree with output r from token i on,
    the head unrolled on its own state as vLLM drafts a round (transformers' float32 target features)."""
    import torch

    from benchmarks.paths import DRAFTERS, TARGET
    from vllm_adaptive_spec.heads.eagle3 import draft_chains, load_hf_dir
    from vllm_adaptive_spec.training.data import Response, load_causal_lm
    from vllm_adaptive_spec.training.eagle3 import accepted_prefix, target_features

    target = load_causal_lm(TARGET)
    head, cfg = load_hf_dir(DRAFTERS["eagle3"], target.get_input_embeddings().weight)
    runs = []
    for p, g in zip(prompt_ids, outputs):
        seq = target_features(target, Response(p, g, "greedy"), cfg.aux_layer_ids)
        n, first = len(seq.ids), len(p)
        # token i of the output is x_{first+i}; a round at i starts the head's chain at c = first + i - 2
        starts = torch.arange(first - 1, n - 2)  # i = 1 .. len(g) - 1
        row = [0]
        if len(starts):
            drafted = draft_chains(head, seq.ids[1:], seq.aux[: n - 1], starts, cap)  # [C, cap]
            where = (starts[:, None] + 2 + torch.arange(cap)[None, :]).clamp_max(n - 1)
            row += accepted_prefix(drafted, seq.ids[where], n - 2 - starts).tolist()
        runs.append(row[: len(g)])
    return runs


def dflash_runs(prompt_ids: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """runs[r][i]: how many drafts of the DFlash drafter's block agree with output r from token i on, the
    block drafted (at the block size it was trained for) after the target emitted token i - 1
    (transformers' float32 target features). A cut never changes what a round accepts, so the oracle
    over cut points is exact from these."""
    from benchmarks.paths import DRAFTERS, TARGET
    from vllm_adaptive_spec.heads.dflash import load_hf_dir
    from vllm_adaptive_spec.training.data import Response, load_causal_lm
    from vllm_adaptive_spec.training.dflash import accepted_per_anchor
    from vllm_adaptive_spec.training.eagle3 import target_features

    target = load_causal_lm(TARGET)
    drafter, cfg = load_hf_dir(DRAFTERS["dflash"], target.get_input_embeddings().weight, target.lm_head.weight)
    runs = []
    for p, g in zip(prompt_ids, outputs):
        acc = accepted_per_anchor(drafter, target_features(target, Response(p, g, "greedy"), cfg.hf_layer_ids))
        runs.append(([0] + acc)[: len(g)])  # anchor of the round at token i: the output's token i - 1
    return runs


def save_nospec_outputs(path: Path, rows: list[dict]) -> None:
    """Add no speculation's prompt ids and outputs per cell (rows that carry them) to the file the oracle
    replays; entries of other cells stay."""
    saved = json.loads(path.read_text()) if path.exists() else {}
    for r in rows:
        if r.get("_prompt_ids") is not None and r.get("_outputs") is not None:
            saved[r["cell"]["key"]] = {"prompt_ids": r["_prompt_ids"], "outputs": r["_outputs"]}
    path.write_text(json.dumps(saved))


def run_oracle(cells: list[Cell], nospec_outputs: Path, ks: list[int], method: str = "draft_model") -> list[dict]:
    """Target greedy output + the drafter's greedy predictions: the oracle and the fixed-K replay.
    A draft model is read teacher-forced in one pass; an EAGLE-3 head is unrolled from every position."""
    from benchmarks.toy_pair.measure import draft_matches
    from vllm_adaptive_spec.metrics import simulate_workload

    saved = json.loads(nospec_outputs.read_text())
    rows = []
    for cell in cells:
        ref = saved.get(cell.key)
        if ref is None or cell.temperature != 0.0:
            continue
        if method in ("eagle3", "dflash"):
            if method == "eagle3":
                runs = eagle3_runs(ref["prompt_ids"], ref["outputs"], max(ks))
            else:
                runs = dflash_runs(ref["prompt_ids"], ref["outputs"])
            matches = [[r > 0 for r in row] for row in runs]
        else:
            matches, runs = draft_matches(ref["prompt_ids"], ref["outputs"]), None
        for k in ks:
            for oracle in (True, False):
                counts = simulate_workload(matches, k, oracle=oracle, runs=runs)
                rows.append(
                    {
                        "cell": cell.__dict__ | {"key": cell.key},
                        "k": k,
                        "oracle": oracle,
                        "n_gen": counts.n_gen,
                        "n_target": counts.n_target,
                        "n_draft": counts.n_draft,
                        "n_accepted": counts.n_accepted,
                    }
                )
    return rows


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    config = Config(**job["config"])
    cells = [Cell(**c) for c in job["cells"]]
    result: dict[str, Any] = {"config": config.to_dict()}
    if config.kind == "oracle":
        result["replay"] = run_oracle(cells, Path(job["nospec_outputs"]), job["oracle_ks"], config.method)
    elif config.kind == "hf":
        result["cells"] = run_hf(config, cells)
    else:
        result["cells"] = run_engine(config, cells)
        if config.kind == "nospec":
            save_nospec_outputs(Path(job["nospec_outputs"]), result["cells"])
        for r in result["cells"]:
            r.pop("_outputs"), r.pop("_prompt_ids")
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
