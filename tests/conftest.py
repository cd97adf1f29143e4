"""Shared fixtures. The end-to-end tests share session-scoped engines on the bundled toy pair.

Engines run in the test process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: engine core and worker in this
process, as vLLM's `InprocClient` runs them): one starts and stops in about 4 s on this 2-core CPU
against about 27 s with an engine-core process. The plugin's paths across processes stay covered:
`vllm serve`, the Ray and tensor-parallel tests run their engines and workers in other processes, and
`test_plugin_in_vllm.test_lossless_with_engine_core_processes` runs vLLM's default (the
`engine_processes` fixture).
`VLLM_ENABLE_V1_MULTIPROCESSING=1 bash scripts/test.sh` runs every test that way (slower)."""

from __future__ import annotations

import contextlib
import os
import tempfile

# Must be set before vLLM is imported anywhere in the session.
# (benchmarks.vllm_run sets the KV cache size and offline mode.)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
# vLLM reads this once the first engine is up (vllm.envs caches every variable then): decide it here.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
TRACE_FILE = os.environ.setdefault(
    "VLLM_ADAPTIVE_SPEC_TRACE_FILE", tempfile.NamedTemporaryFile(prefix="vas-trace-", delete=False).name
)

import pytest  # noqa: E402

from benchmarks import vllm_run  # noqa: E402
from benchmarks.paths import load_prompts  # noqa: E402
from benchmarks.vllm_run import STRUCTURED_JSON, STRUCTURED_REGEX, close_llm  # noqa: E402,F401

K = 4
N_PROMPTS = 20
MAX_TOKENS = 64
N_LOSSLESS = 50
# Mixed lengths in one batch: requests finish at different steps, and some
# have fewer tokens left than the cap.
MIXED_MAX_TOKENS = [(3, 17, 40, 64, 1)[i % 5] for i in range(N_LOSSLESS)]
# Cost curves on which a pass costs 10 ms a token (compute-bound): the batch gate verifies no draft in most
# rounds (policies/batch_gate.py: no_draft_round) and the tail gate cuts every tail.
STEEP_COSTS = {"draft_step_ms": [[1, 1.0], [64, 1.0]], "verify_ms": [[1, 10.0], [512, 5120.0]]}


def steep_costs(tmp_path) -> str:
    """A cost file (adaptive_spec.costs) of STEEP_COSTS under tmp_path; its path."""
    import json

    path = tmp_path / "steep.json"
    path.write_text(json.dumps(STEEP_COSTS))
    return str(path)


TRAINING_FREE_POLICIES = ["adaedl", "confidence", "copy", "fixed", "heuristic", "svip", "vllm_av"]


def make_llm(**kwargs):
    """The toy target in vLLM, in float32. In bfloat16 vLLM's CPU kernels round a pass over several
    tokens differently from a pass over one, so near-tied greedy tokens can part from no speculation's
    with any speculation, vLLM's own included (on the 2-core Xeon with AMX, batch 1: vLLM K=4 on code
    prompt 0 at token 31, float32 top-2 margin 0.010; the plugin on prompt 13 at token 40, margin
    0.030). In float32 the plugin's output must equal no speculation's token for token."""
    return vllm_run.make_llm(**({"max_num_seqs": 16, "dtype": "float32"} | kwargs))


def spec_config(k: int = K) -> dict:
    return vllm_run.spec_config(k)


@contextlib.contextmanager
def multiprocess_engines():
    """Engines started inside run as users run vLLM by default: the engine core (and its worker) in a
    process of its own. vLLM caches its environment variables once an engine is up;
    `disable_envs_cache` (vLLM's helper for isolating tests) makes it read them again, before and
    after."""
    import vllm.envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        vllm.envs.disable_envs_cache()
        yield
    vllm.envs.disable_envs_cache()


@pytest.fixture(scope="module")
def engine_processes():
    """`multiprocess_engines` for a module's engines."""
    with multiprocess_engines():
        yield


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    return load_prompts("code_heldout", N_PROMPTS)


@pytest.fixture(scope="session")
def ref_llm():
    """The target alone: the reference every speculative output must equal."""
    llm = make_llm()
    yield llm
    close_llm(llm)


@pytest.fixture(scope="session")
def spec_llm():
    """vLLM's own draft-model speculation, plugin installed but not configured
    (with vLLM's per-request spec-decode metrics, which the exact-count test reads)."""
    llm = make_llm(speculative_config=spec_config(), per_request_spec_decode_metrics="summary")
    yield llm
    close_llm(llm)


@pytest.fixture(scope="session")
def adaptive_llm():
    """Draft-model speculation with the plugin switched on."""
    llm = make_llm(speculative_config=spec_config(), additional_config={"adaptive_spec": {"policy": "fixed"}})
    yield llm
    close_llm(llm)


def greedy_params(max_tokens: int = MAX_TOKENS):
    return vllm_run.greedy_params(max_tokens)


def greedy(llm, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return vllm_run.generate_tokens(llm, prompts, max_tokens)


def released_stats(llm, timeout_s: float = 30.0) -> list[dict]:
    """`get_stats` once no request state is left, or at the deadline (the caller asserts).

    vLLM hands finished request ids to the workers in the engine step after the one that
    finished them; a stats call sent right after `generate` returns can reach the worker
    before that step, more often on a busy machine. An engine in this process steps only when
    asked: one step with nothing to run hands them over (what an engine-core process does on
    its own)."""
    import time

    from vllm.v1.engine.core_client import InprocClient

    from vllm_adaptive_spec.integration.runtime import get_stats

    engine = llm.llm_engine
    if isinstance(engine.engine_core, InprocClient) and not engine.has_unfinished_requests():
        engine.step()
    deadline = time.monotonic() + timeout_s
    while True:
        stats = get_stats(llm)
        if all(s["requests"] == {} and s["tracked"] == 0 for s in stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def lossless_stats(speculative_config: dict, adaptive: dict, prompts: list[str], reference: list[list[int]]) -> dict:
    """An engine of its own: greedy output over `prompts` (at MIXED_MAX_TOKENS) must equal `reference`;
    returns its worker's released statistics."""
    llm = make_llm(speculative_config=speculative_config, additional_config={"adaptive_spec": adaptive})
    try:
        got = greedy(llm, prompts, MIXED_MAX_TOKENS[: len(prompts)])
        assert got == reference, first_mismatch(got, reference)
        (snap,) = released_stats(llm)
    finally:
        close_llm(llm)
    return snap


# Request settings that change what the target emits (penalties, banned and allowed tokens, a
# minimum length, stop strings, log-probabilities, structured outputs): drafts are verified against the
# distribution they give, so greedy output with speculation must still equal the target's alone under
# each of them.
def request_settings() -> dict[str, dict]:
    from vllm.sampling_params import StructuredOutputsParams

    return {
        "repetition_penalty": {"repetition_penalty": 1.3},
        "presence_frequency": {"presence_penalty": 1.0, "frequency_penalty": 0.5},
        "bad_words": {"bad_words": ["return", "self"]},
        "allowed_token_ids": {"allowed_token_ids": list(range(3000))},
        "min_tokens": {"min_tokens": 40},
        "stop": {"stop": ["\n\n", "return"]},
        "logprobs": {"logprobs": 2, "prompt_logprobs": 1},
        "structured_regex": {"structured_outputs": StructuredOutputsParams(regex=STRUCTURED_REGEX)},
        "structured_choice": {"structured_outputs": StructuredOutputsParams(choice=["return x", "pass", "yield"])},
        "structured_json": {"structured_outputs": StructuredOutputsParams(json=STRUCTURED_JSON)},
    }


def settings_outputs(llm, prompts: list[str], max_tokens: int = 48) -> dict[str, list]:
    """Greedy tokens (and the number of sampled-token logprob entries) of every prompt under every
    `request_settings` entry, all in one batch."""
    settings = request_settings()
    params = [vllm_run.greedy_params(max_tokens, **kw) for kw in settings.values() for _ in prompts]
    outs = llm.generate(prompts * len(settings), params, use_tqdm=False)
    got = {}
    for i, name in enumerate(settings):
        done = [o.outputs[0] for o in outs[i * len(prompts) : (i + 1) * len(prompts)]]
        got[name] = [(list(c.token_ids), len(c.logprobs or [])) for c in done]
    return got


def first_mismatch(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            j = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return f"prompt {i}: first difference at token {j}: {g[j : j + 5]} vs {w[j : j + 5]}"
    return "lengths differ"


def same_work_as_vllm(plugin_llm, vllm_llm) -> dict:
    """The plugin's loop (policy fixed) against vLLM's own at the same K, on 20 held-out prompts neither
    engine has seen (vLLM's engine needs per-request spec-decode metrics). Asserts the same tokens,
    the same target passes and the same drafts kept, summed over requests (counted as
    test_exact_counts.py counts them: vLLM's accepted counter also counts drafts accepted past
    max_tokens, which the plugin never drafts), and no more drafts proposed. Returns the plugin's counts."""
    from benchmarks.harness.worker import _delta, plugin_totals, request_counts

    prompts = load_prompts("code_heldout", N_LOSSLESS + 20)[N_LOSSLESS:]
    params = greedy_params(MAX_TOKENS)
    outs = vllm_llm.generate(prompts, params, use_tqdm=False)
    vllm = request_counts(outs, speculative=True)
    own0 = plugin_totals(plugin_llm)
    got = [list(o.outputs[0].token_ids) for o in plugin_llm.generate(prompts, params, use_tqdm=False)]
    own = _delta(plugin_totals(plugin_llm), own0, 1)
    assert got == [list(o.outputs[0].token_ids) for o in outs]
    assert (own["n_gen"], own["n_target"], own["n_accepted"]) == (vllm["n_gen"], vllm["n_target"], vllm["n_accepted"])
    assert own["n_draft"] <= vllm["n_draft"]
    return own


@pytest.fixture(scope="session")
def reference_tokens(ref_llm, prompts) -> list[list[int]]:
    return greedy(ref_llm, prompts)


@pytest.fixture(scope="session")
def settings_reference(ref_llm, prompts) -> dict[str, list]:
    return settings_outputs(ref_llm, prompts[:4])


@pytest.fixture(scope="session")
def lossless_prompts() -> list[str]:
    return load_prompts("code_heldout", N_LOSSLESS)


@pytest.fixture(scope="session")
def lossless_reference(ref_llm, lossless_prompts) -> list[list[int]]:
    return greedy(ref_llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
