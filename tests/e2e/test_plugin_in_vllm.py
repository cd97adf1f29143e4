"""The plugin inside real vLLM (CPU build) on the bundled toy pair."""

from __future__ import annotations

import os
import time
from importlib.metadata import entry_points

import pytest

from benchmarks import vllm_run
from tests.conftest import TRACE_FILE, close_llm, make_llm, spec_config

pytestmark = pytest.mark.e2e


def _worker_view(worker):
    """Runs inside each vLLM worker process (via collective_rpc)."""
    from vllm_adaptive_spec.integration import plugin, runtime

    drafter = getattr(worker.model_runner, "drafter", None)
    return {
        "pid": os.getpid(),
        "registered": plugin.is_registered(),
        "active": runtime.active_policies(worker.model_runner),
        "drafter": None if drafter is None else f"{type(drafter).__module__}.{type(drafter).__qualname__}",
    }


def test_entry_point_is_discoverable():
    eps = entry_points(group="vllm.general_plugins")
    assert any(ep.value == "vllm_adaptive_spec.integration.plugin:register" for ep in eps)


def test_register_runs_in_every_vllm_process(spec_llm):
    views = spec_llm.collective_rpc(_worker_view)
    pids = {int(line.split()[0]) for line in open(TRACE_FILE) if line.strip()}
    assert os.getpid() in pids, "front-end process"
    assert all(v["registered"] for v in views)
    assert {v["pid"] for v in views} <= pids, "every worker"
    # (the session's engines run in this process: test_lossless_with_engine_core_processes checks a worker
    # in an engine-core process of its own)


def test_without_adaptive_spec_nothing_changes(spec_llm):
    for view in spec_llm.collective_rpc(_worker_view):
        assert view["active"] == []
        assert view["drafter"] == "vllm.v1.spec_decode.draft_model.DraftModelProposer"


def test_with_adaptive_spec_the_plugin_is_active(adaptive_llm):
    for view in adaptive_llm.collective_rpc(_worker_view):
        assert view["active"] == ["fixed"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (
            {"speculative_config": spec_config(), "additional_config": {"adaptive_spec": {"policy": "nope"}}},
            "adaptive_spec.policy: unknown policy 'nope'",
        ),
        (
            {"speculative_config": spec_config(), "additional_config": {"adaptive_spec": {"polcy": "fixed"}}},
            "adaptive_spec.polcy: unknown field",
        ),
        ({"additional_config": {"adaptive_spec": {"policy": "fixed"}}}, "speculative_config.method=None"),
        (
            {"speculative_config": spec_config(), "additional_config": {"adaptive_spec": "fixed"}},
            "adaptive_spec: expected a mapping",
        ),
        (  # the runner's unpadded path bypassed the loop's feedback: EAGLE-3 ran lossless, counting no drafts
            {
                "speculative_config": vllm_run.spec_config(4, "eagle3") | {"disable_padded_drafter_batch": True},
                "additional_config": {"adaptive_spec": {"policy": "svip"}},
            },
            "speculative_config.disable_padded_drafter_batch=False (got True)",
        ),
        (  # the policies read the whole draft distribution, which a local argmax never gathers
            {
                "speculative_config": vllm_run.spec_config(4, "eagle3") | {"use_local_argmax_reduction": True},
                "additional_config": {"adaptive_spec": {"policy": "fixed"}},
            },
            "speculative_config.use_local_argmax_reduction=False (got True)",
        ),
        (  # a skipped first pass loses the target's hidden states the next one would read
            {
                "speculative_config": vllm_run.spec_config(4, "eagle3"),
                "additional_config": {"adaptive_spec": {"policy": "svip", "skip_first_pass": True}},
            },
            "adaptive_spec.skip_first_pass: true needs speculative_config.method='draft_model', got 'eagle3'",
        ),
    ],
)
def test_bad_config_fails_at_startup_with_one_clear_error(kwargs, needle):
    from vllm_adaptive_spec import ConfigError

    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        make_llm(**kwargs)
    assert needle in str(err.value)
    assert time.monotonic() - start < 60


_TWO_ENGINES = """
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
from benchmarks.paths import load_prompts
from tests.conftest import greedy, make_llm, spec_config
from vllm_adaptive_spec.integration.runtime import get_stats

engines = [
    make_llm(speculative_config=spec_config(), additional_config={"adaptive_spec": {"policy": p}}, max_num_seqs=4)
    for p in ("fixed", "svip")
]
greedy(engines[0], load_prompts("code_heldout", 2), 16)
for llm in engines:
    print("ENGINE", [(s["policy"], s["workload"]["n_gen"]) for s in get_stats(llm)])
"""


def test_get_stats_reports_each_engine_of_a_process_only():
    """Two engines in one process (no engine-core or worker processes) share the plugin's module: each
    engine's statistics must be its own (before the fix each reported both proposers)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = os.environ | {"PYTHONPATH": root}
    run = subprocess.run([sys.executable, "-c", _TWO_ENGINES], cwd=root, env=env, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("ENGINE")]
    assert run.returncode == 0 and len(lines) == 2, run.stderr[-3000:]
    assert lines == ["ENGINE [('fixed', 32)]", "ENGINE [('svip', 0)]"]


@pytest.mark.parametrize("method, policy", [("draft_model", "svip"), ("eagle3", "confidence")])
def test_lossless_with_engine_core_processes(engine_processes, method, policy, prompts, reference_tokens):
    """The test session runs its engines in-process (tests/conftest); users run vLLM's default, an
    engine-core process holding the worker. There the plugin registers in that process, its config
    reaches the worker, greedy output equals no speculation's and the statistics come back over
    collective_rpc, requests released."""
    from tests.conftest import first_mismatch, greedy, released_stats

    adaptive = {"adaptive_spec": {"policy": policy}}
    llm = make_llm(speculative_config=vllm_run.spec_config(6, method), additional_config=adaptive)
    try:
        got = greedy(llm, prompts)
        (snap,) = released_stats(llm)
        views = llm.collective_rpc(_worker_view)
    finally:
        close_llm(llm)
    assert got == reference_tokens, first_mismatch(got, reference_tokens)
    assert snap["workload"]["n_draft"] > 0 and snap["requests"] == {} and snap["tracked"] == 0
    worker_pids = {v["pid"] for v in views}
    assert os.getpid() not in worker_pids, "the worker runs in the engine's own process"
    traced = {int(line.split()[0]) for line in open(TRACE_FILE) if line.strip()}
    assert worker_pids <= traced and all(v["registered"] and v["active"] == [policy] for v in views)
