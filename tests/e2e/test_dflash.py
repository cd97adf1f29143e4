"""The bundled DFlash drafter through plain vLLM (`method: dflash`, no adaptive_spec).

vLLM loads `heads/toy/dflash` (training/dflash.py wrote it); greedy output must
equal the target's without speculation, every tensor vLLM holds must be the
file's (its loader leaves missing ones at their initial values without a word),
the block must run non-causally as it was trained, and vLLM must draft what the
PyTorch module drafts: the accepted count of each round, replayed offline on
the HF target's features, equals vLLM's.
"""

from __future__ import annotations

import pytest

from benchmarks import vllm_run
from benchmarks.paths import DFLASH_HEAD, TARGET
from tests.conftest import close_llm, first_mismatch, greedy, make_llm

pytestmark = pytest.mark.e2e

K = 8  # the block the drafter was trained for


@pytest.fixture(scope="module")
def dflash_llm():
    llm = make_llm(speculative_config=vllm_run.spec_config(K, "dflash"), per_request_spec_decode_metrics="detailed")
    yield llm
    close_llm(llm)


def test_greedy_output_equals_no_speculation(dflash_llm, prompts, reference_tokens):
    got = greedy(dflash_llm, prompts)
    assert got == reference_tokens, first_mismatch(got, reference_tokens)
    m = vllm_run.spec_metrics(dflash_llm)
    assert m.accepted > m.drafts, "the drafter gets blocks accepted (mean acceptance length above 2)"


def _weights_computed_with(model) -> dict:
    """name -> tensor of every parameter; where vLLM's CPU backend packed a linear layer's weight for
    its own GEMM kernel and left the parameter empty (`dispatch_cpu_unquantized_gemm`, which does so on
    CPUs with AVX-512 BF16), the weight that kernel computes with instead: the layer's product with the
    identity, I @ W^T (exact: one non-zero term per output)."""
    import torch

    out = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or weight.numel() or not hasattr(module, "cpu_linear"):
            continue
        eye = torch.eye(
            getattr(module, "input_size_per_partition", module.input_size), dtype=weight.dtype, device=weight.device
        )
        out[f"{name}.weight"] = module.cpu_linear(eye, weight, None).t().cpu().contiguous()  # [N, K]
    return out


def _draft_state(worker) -> dict:
    """In the worker: the drafter's tensors (as its kernels use them), whether embedding and LM head
    are the target's, causality."""
    runner = worker.model_runner
    draft = runner.drafter.model
    target = runner.model
    skip = ("embed_tokens", "lm_head", "mask_embedding")
    return {
        "tensors": {
            n: t for n, t in _weights_computed_with(draft).items() if not n.removeprefix("model.").startswith(skip)
        },
        "shared_embedding": draft.model.embed_tokens is target.model.embed_tokens,
        "shared_lm_head": draft.lm_head is target.lm_head,
        "causal": draft.get_draft_attn_causal(),
        "mask_token_id": draft.model.mask_token_id,
        "separate_mask_embedding": draft.model.has_separate_mask_embedding,
    }


def test_every_tensor_vllm_holds_is_the_files(dflash_llm):
    import torch
    from safetensors.torch import load_file

    (state,) = dflash_llm.collective_rpc(_draft_state)
    assert state["shared_embedding"] and state["shared_lm_head"]
    assert state["causal"] == [False, False]
    assert state["mask_token_id"] == 0 and not state["separate_mask_embedding"]
    saved = load_file(str(DFLASH_HEAD / "model.safetensors"))
    stacked = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    used = set()
    for name, tensor in state["tensors"].items():
        name = name.removeprefix("model.")
        parts = [name.replace(fused, piece) for fused, pieces in stacked.items() if fused in name for piece in pieces]
        parts = parts or [name]
        want = torch.cat([saved[p] for p in parts]).to(tensor.dtype)
        torch.testing.assert_close(tensor, want, rtol=0, atol=0, msg=name)
        used |= set(parts)
    assert used == set(saved), sorted(used ^ set(saved))


@pytest.fixture(scope="module")
def dflash_f32_llm():
    """float32, as the PyTorch module the rounds are compared with (bfloat16 flips near-tied drafts)."""
    spec = vllm_run.spec_config(K, "dflash")
    llm = make_llm(speculative_config=spec, per_request_spec_decode_metrics="detailed", dtype="float32")
    yield llm
    close_llm(llm)


def test_vllm_drafts_what_the_module_drafts(dflash_f32_llm):
    """At every round vLLM ran (its anchors follow from its own accepted counts), the PyTorch module's
    block at the same anchor, on the HF target's features, gets the same number of drafts accepted
    (every round but each request's last, where vLLM counts drafts accepted past max_tokens). Both in
    float32; CPU kernels and transformers still differ at about 1e-5, which can flip a near-tied draft."""
    from benchmarks.paths import load_prompts
    from vllm_adaptive_spec.heads.dflash import load_hf_dir
    from vllm_adaptive_spec.training import data
    from vllm_adaptive_spec.training.dflash import accepted_per_anchor
    from vllm_adaptive_spec.training.eagle3 import target_features

    prompts = load_prompts("code_heldout", 36)[20:]  # not the ones above
    outs = dflash_f32_llm.generate(prompts, vllm_run.greedy_params(64), use_tqdm=False)
    target = data.load_causal_lm(TARGET)
    drafter, cfg = load_hf_dir(DFLASH_HEAD, target.get_input_embeddings().weight, target.lm_head.weight)
    same = total = 0
    for o in outs:
        resp = data.Response(list(o.prompt_token_ids), list(o.outputs[0].token_ids), "greedy")
        acc = accepted_per_anchor(drafter, target_features(target, resp, cfg.hf_layer_ids))
        anchor = 0
        for theirs in list(o.outputs[0].spec_decode_metrics.per_step_accepted)[:-1]:
            same, total = same + (acc[anchor] == theirs), total + 1
            anchor += theirs + 1
    assert total > 100 and same >= 0.97 * total, (same, total)
