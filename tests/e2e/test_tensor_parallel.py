"""The plugin with tensor parallelism 2 (multiprocessing executor).

Every TP rank runs its own adaptive proposer; the stop decisions of rank 0
are broadcast so that all ranks run the same number of draft forwards
(`proposer._tp_group`). Both ranks' statistics must therefore agree exactly,
and the output must equal the target model's at the same TP size (bf16
all-reduces make TP=2 greedy outputs differ from TP=1 on some prompts, so the
reference is a TP=2 engine without speculation).

On CPU, vLLM binds each rank's OpenMP threads to its own cores. Its automatic
binding wants one NUMA node per rank and fails on a one-node machine ("Not
enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so unless
VLLM_CPU_OMP_THREADS_BIND is set already, the allowed CPUs are split in two
halves, one per rank.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.paths import load_prompts
from tests.conftest import close_llm, first_mismatch, greedy, make_llm, spec_config

pytestmark = pytest.mark.e2e

TP = 2
N_PROMPTS = 10
MAX_TOKENS = 32
ADAPTIVE = {"policy": "svip", "threshold": 0.8}


@pytest.fixture(scope="module")
def tp_env(engine_processes):
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as mp:
        if current_platform.is_cpu():
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < TP:
                pytest.skip(f"tensor parallel {TP} on CPU needs {TP} CPUs, {len(cpus)} allowed")
            if not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
                half = len(cpus) // TP
                groups = [cpus[i * half : (i + 1) * half] for i in range(TP)]
                mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups))
        elif current_platform.device_count() < TP:
            pytest.skip(f"tensor parallel {TP} needs {TP} devices")
        yield


def _tp_llm(**kwargs):
    return make_llm(tensor_parallel_size=TP, distributed_executor_backend="mp", **kwargs)


@pytest.fixture(scope="module")
def prompts_tp() -> list[str]:
    return load_prompts("code_heldout", N_PROMPTS)


@pytest.fixture(scope="module")
def reference_tp(tp_env, prompts_tp) -> list[list[int]]:
    """Greedy tokens of the target alone at TP=2 (engine closed afterwards)."""
    llm = _tp_llm()
    try:
        return greedy(llm, prompts_tp, MAX_TOKENS)
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def adaptive_tp_llm(tp_env, reference_tp):
    llm = _tp_llm(speculative_config=spec_config(4), additional_config={"adaptive_spec": ADAPTIVE})
    yield llm
    close_llm(llm)


def _rank_view(worker):
    """Runs inside each TP worker, via collective_rpc."""
    from vllm.distributed.parallel_state import get_tp_group

    from vllm_adaptive_spec.integration import runtime

    drafter = worker.model_runner.drafter
    return {
        "pid": os.getpid(),
        "tp_rank": get_tp_group().rank_in_group,
        "active": runtime.active_policies(worker.model_runner),
        "broadcasts": getattr(drafter, "_tp_group", None) is not None,
    }


def test_tp2_lossless_and_ranks_take_the_same_stopping_decisions(adaptive_tp_llm, reference_tp, prompts_tp):
    from vllm_adaptive_spec.integration.runtime import get_stats

    views = adaptive_tp_llm.collective_rpc(_rank_view)
    assert sorted(v["tp_rank"] for v in views) == list(range(TP))
    assert len({v["pid"] for v in views}) == TP
    assert all(v["active"] == ["svip"] and v["broadcasts"] for v in views), views

    got = greedy(adaptive_tp_llm, prompts_tp, MAX_TOKENS)
    assert got == reference_tp, first_mismatch(got, reference_tp)

    stats = get_stats(adaptive_tp_llm)
    assert len(stats) == TP, "one snapshot per rank"
    rank0, rank1 = stats
    assert rank0["policy"] == rank1["policy"] == "svip"
    assert rank0["workload"]["n_gen"] == sum(map(len, got))
    assert rank0["workload"]["n_draft"] > 0
    # svip at threshold 0.8 stops some drafts before the cap K=4
    assert any(length < 4 for length in rank0["drafted_len_hist"])
    assert rank0["drafted_len_hist"] == rank1["drafted_len_hist"]
    assert rank0["forwards_per_step"] == rank1["forwards_per_step"]
    assert rank0["workload"] == rank1["workload"]
