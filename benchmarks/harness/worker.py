"""Runs one configuration over its cells, in its own process, and writes JSON.

    .venv/bin/python -m benchmarks.harness.worker JOB.json OUT.json

JOB holds the configuration, its cells and where the no-speculation outputs
live (the oracle reads them). Each cell: a short warm-up, then `repeats`
timed passes over its prompts, sent `batch` at a time (one `generate` call
per group). Counts come from vLLM's own counters, the same for every vLLM
configuration: N_D and N_acc are vLLM's spec-decode counters, N_gen the
generated tokens, and N_T = N_gen - N_acc (every target step emits exactly
one token of its own). Engine steps come from vLLM's iteration histogram.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function

from benchmarks import vllm_run  # noqa: E402  (sets vLLM's environment first)
from benchmarks.harness.plan import Cell, Config  # noqa: E402
from benchmarks.paths import load_prompts  # noqa: E402


def token_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]


def sampling_params(cell: Cell, index: int):
    from vllm import SamplingParams

    if cell.temperature == 0.0:
        return SamplingParams(temperature=0.0, max_tokens=cell.max_tokens)
    return SamplingParams(temperature=cell.temperature, max_tokens=cell.max_tokens, seed=1000 + index)


def counters(llm) -> dict[str, int]:
    out = {"n_gen": 0, "n_draft": 0, "n_accepted": 0, "steps": 0}
    for m in llm.get_metrics():
        if m.name == "vllm:generation_tokens":
            out["n_gen"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["n_draft"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["n_accepted"] += m.value
        elif m.name == "vllm:iteration_tokens_total":
            out["steps"] += m.count
    return out


def plugin_hist(llm) -> dict[int, int]:
    from vllm_adaptive_spec.integration.runtime import get_stats

    hist: dict[int, int] = {}
    for snap in get_stats(llm):
        for length, n in snap["drafted_len_hist"].items():
            hist[int(length)] = hist.get(int(length), 0) + n
    return hist


def run_cell(llm, cell: Cell, plugin: bool) -> dict[str, Any]:
    prompts = load_prompts(cell.workload, cell.n_prompts)
    params = [sampling_params(cell, i) for i in range(len(prompts))]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    before, hist0 = counters(llm), plugin_hist(llm) if plugin else {}
    seconds, outputs = [], None
    for _ in range(cell.repeats):
        start, outs = time.perf_counter(), []
        for i in range(0, len(prompts), cell.batch):
            outs += llm.generate(prompts[i : i + cell.batch], params[i : i + cell.batch], use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        outputs = outputs or [list(o.outputs[0].token_ids) for o in outs]
    after, hist1 = counters(llm), plugin_hist(llm) if plugin else {}
    delta = {key: (after[key] - before[key]) / cell.repeats for key in after}  # per pass
    return {
        "cell": cell.__dict__ | {"key": cell.key},
        "seconds": seconds,
        "tokens_per_s": [sum(map(len, outputs)) / s for s in seconds],
        **delta,
        "draft_len_hist": {k: (hist1.get(k, 0) - hist0.get(k, 0)) / cell.repeats for k in sorted(hist1)},
        "output_hashes": [token_hash(ids) for ids in outputs],
        "_outputs": outputs,
        "_prompt_ids": None,
    }


def run_engine(config: Config, cells: list[Cell]) -> list[dict]:
    kwargs: dict[str, Any] = {}
    if config.dynamic is not None:
        kwargs["speculative_config"] = vllm_run.spec_config(config.k) | {
            "num_speculative_tokens_per_batch_size": config.dynamic
        }
    k = config.k if config.kind in ("vllm", "plugin") and config.dynamic is None else None
    llm = vllm_run.make_llm(k=k, adaptive=config.adaptive, **kwargs)
    try:
        rows = [run_cell(llm, cell, plugin=config.kind == "plugin") for cell in cells]
        if config.kind == "nospec":  # the oracle needs the exact prompt ids
            tok = llm.get_tokenizer()
            for row in rows:
                prompts = load_prompts(row["cell"]["workload"], row["cell"]["n_prompts"])
                row["_prompt_ids"] = [tok(p).input_ids for p in prompts]
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
                "steps": r["n_target"],
                "draft_len_hist": r["draft_len_hist"],
                "output_hashes": [token_hash(ids) for ids in r["outputs"]],
            }
        )
    return rows


def run_oracle(cells: list[Cell], nospec_outputs: Path, ks: list[int]) -> list[dict]:
    """Target greedy output + one teacher-forced draft pass: the oracle and the fixed-K replay."""
    from benchmarks.toy_pair.measure import draft_matches
    from vllm_adaptive_spec.metrics import simulate_workload

    saved = json.loads(nospec_outputs.read_text())
    rows = []
    for cell in cells:
        ref = saved.get(cell.key)
        if ref is None or cell.temperature != 0.0:
            continue
        matches = draft_matches(ref["prompt_ids"], ref["outputs"])
        for k in ks:
            for oracle in (True, False):
                counts = simulate_workload(matches, k, oracle=oracle)
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
        result["replay"] = run_oracle(cells, Path(job["nospec_outputs"]), job["oracle_ks"])
    elif config.kind == "hf":
        result["cells"] = run_hf(config, cells)
    else:
        result["cells"] = run_engine(config, cells)
        if config.kind == "nospec":
            saved = {
                r["cell"]["key"]: {"prompt_ids": r["_prompt_ids"], "outputs": r["_outputs"]} for r in result["cells"]
            }
            Path(job["nospec_outputs"]).write_text(json.dumps(saved))
        for r in result["cells"]:
            r.pop("_outputs"), r.pop("_prompt_ids")
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
