"""transformers' greedy generate on the target gives the tokens vLLM gives."""

from __future__ import annotations

import pytest
import torch

from benchmarks.paths import TARGET
from tests.conftest import MAX_TOKENS, first_mismatch

pytestmark = pytest.mark.e2e


def test_transformers_greedy_matches_vllm(prompts, reference_tokens):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = Qwen3ForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    got_all = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids  # [1, P], starts with BOS
        assert ids[0, 0].item() == tok.bos_token_id
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        got_all.append(out[0, ids.shape[1] :].tolist())
    assert got_all == reference_tokens, first_mismatch(got_all, reference_tokens)
