"""The harness's interleaved timing through real vLLM: engines alive side by side in their own
processes, taking turns on the same prompt groups, with exact counts and paired ratios."""

from __future__ import annotations

from benchmarks.harness.interleaved import run_group
from benchmarks.harness.plan import Cell, Config


def test_two_engines_take_turns_and_count_exactly(tmp_path):
    members = [Config("no speculation", "nospec", "none"), Config("vLLM K=2", "vllm", "fixed K", 2)]
    cell = Cell("code_heldout", 2, 0.0, 4, 16, 2, timed=True)
    rows = run_group(members, [cell], tmp_path, 0)
    (base,), (k2,) = rows["no speculation"], rows["vLLM K=2"]
    assert base["paired_ratio"] == [1.0, 1.0]
    assert len(k2["paired_ratio"]) == 2 and all(r > 0 for r in k2["paired_ratio"])
    assert k2["output_hashes"] == base["output_hashes"]  # lossless
    assert base["n_gen"] == base["n_target"] == 4 * 16  # one pass per token without speculation
    assert k2["n_gen"] == 64 and 4 < k2["n_target"] < 64  # the prefill passes and fewer decode passes
    assert base["_prompt_ids"] and len(base["_outputs"]) == 4
