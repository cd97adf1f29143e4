"""The copy rule's context, as a real engine feeds it: every request's prompt and output, in order.

A regression test: the harness times every plugin configuration with `adaptive_spec.time_policy`,
whose wrapper did not pass the token feed on, so `copy` ran with an empty index (a rule of q alone)
while every lossless test still passed. Here the engine runs in this process with the wrapper on,
and what `CopyPolicy.observe_tokens` received for each request must be exactly a prefix of its
prompt + output: all of it but the tokens of the request's last step (no round follows them).

The same engine checks that the batch gate (on, the default) decides only rounds of two or more rows
with copy (`CopyPolicy.gate_min_rows`): a lone request's rounds are the rule's alone, through the
timing wrapper too.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import close_llm, make_llm, spec_config
from vllm_adaptive_spec.policies.batch_gate import BatchGate
from vllm_adaptive_spec.policies.copy import CopyPolicy

pytestmark = pytest.mark.e2e


def test_copy_reads_each_requests_prompt_and_output_through_the_timing_wrapper(monkeypatch, lossless_prompts):
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
        pytest.skip("reads the policy's calls in this process")
    fed: dict[str, list[int]] = {}
    observe = CopyPolicy.observe_tokens

    def recording(self, req_ids, new):
        for req_id, tokens in zip(req_ids, new):
            fed.setdefault(req_id, []).extend(tokens)
        observe(self, req_ids, new)

    monkeypatch.setattr(CopyPolicy, "observe_tokens", recording)
    gated: list[int] = []  # rows of each round the gate started
    start = BatchGate.start_round

    def counting(self, req_ids, cap, compact=False):
        gated.append(len(req_ids))
        start(self, req_ids, cap, compact)

    monkeypatch.setattr(BatchGate, "start_round", counting)
    cfg = {"policy": "copy", "threshold": 1.0, "time_policy": True}  # the gate at its default (on)
    llm = make_llm(speculative_config=spec_config(), additional_config={"adaptive_spec": cfg})
    try:
        from vllm import SamplingParams

        outs = llm.generate(lossless_prompts[:6], SamplingParams(temperature=0.0, max_tokens=40))
        batched, fed_batch = list(gated), {r: list(tokens) for r, tokens in fed.items()}
        llm.generate(lossless_prompts[6:7], SamplingParams(temperature=0.0, max_tokens=40))
    finally:
        close_llm(llm)
    fed = fed_batch
    assert len(fed) == len(outs)
    by_prompt = {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    for tokens in fed.values():
        whole = next(w for p, w in by_prompt.items() if tokens[: len(p)] == list(p))
        assert tokens == whole[: len(tokens)]  # in order, nothing twice, nothing made up
        assert len(whole) - len(tokens) <= spec_config()["num_speculative_tokens"] + 1  # only the last step's
    assert batched and min(batched) >= 2  # the gate ran on the batch's rounds, never on one row
    assert gated == batched  # the lone request's rounds: the rule's alone
