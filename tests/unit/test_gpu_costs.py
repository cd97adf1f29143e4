"""benchmarks.gpu_costs, gpu_pearl and gpu_model: the GPU scripts' parts, checked on CPU at toy sizes."""

from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import gpu_costs as gc

CPU = torch.device("cpu")


def test_grouped_attention_equals_attention_over_repeated_kv_heads():
    q, k, v = torch.randn(2, 8, 3, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    mask = gc.causal_tail(3, 4, CPU)  # [3, 7]: the context and the new tokens up to each one
    assert mask.tolist()[0] == [True] * 5 + [False] * 2
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
    assert torch.allclose(gc.grouped_attention(q, k, v, mask), want, atol=1e-6)


def test_draft_step_matches_the_eagle3_head_decode():
    """The benchmark's static-cache step computes what heads.eagle3's decode computes."""
    s = gc.TINY
    head = gc.eagle3_head(s, torch.float32, CPU)
    b = 2
    ctx_tok, tokens = torch.randint(0, s.draft_vocab, (b, s.context)), torch.randint(0, s.draft_vocab, (b, 1))
    ctx_hidden, hidden = torch.randn(b, s.context, s.hidden), torch.randn(b, 1, s.hidden)
    pos = torch.arange(s.context).expand(b, -1)
    _, _, cache = head.decode(ctx_tok, ctx_hidden, pos)
    normed, prenorm, _ = head.decode(tokens, hidden, torch.full((b, 1), s.context), cache)
    static = (torch.cat([cache.k, torch.zeros_like(cache.k[:, :, :1])], 2), torch.cat([cache.v, cache.v[:, :, :1]], 2))
    logits, got_normed, got_prenorm = gc.draft_step(head, static, tokens, hidden, gc.causal_tail(1, s.context, CPU))
    assert torch.allclose(got_prenorm, prenorm, atol=1e-5)
    assert torch.allclose(got_normed, normed[:, 0], atol=1e-5)
    assert torch.allclose(logits, head.logits(normed)[:, 0], atol=1e-5)


def test_every_timed_policy_runs_a_round_of_both_loops(tmp_path):
    s = gc.TINY
    heads = gc.heads_dir(s, tmp_path)
    loops = gc.Loops(gc.eagle3_head(s, torch.bfloat16, CPU), s, 3, 4, torch.bfloat16, CPU)
    assert [len(r) for r in loops.vllm_round()] == [4, 4, 4]
    for name in ("fixed", "svip", "confidence", "specdecpp", "pacer"):
        drafts = loops.plugin_round(gc.make_policy(name, heads, CPU))
        assert [len(r) for r in drafts] == [4, 4, 4], name


def test_preparing_ahead_drafts_what_vllms_loop_drafts(tmp_path):
    """The next step's inputs prepared before the wait for the decisions (the plugin's order on CUDA)
    or after it: the same drafts as vLLM's loop from the same state, round after round."""
    s = gc.TINY
    head = gc.eagle3_head(s, torch.bfloat16, CPU)
    fixed = gc.make_policy("fixed", gc.heads_dir(s, tmp_path), CPU)
    runs = {}
    for name, round_fn in {
        "vllm": lambda loops: loops.vllm_round(),
        "ahead": lambda loops: loops.plugin_round(fixed, ahead=True),
        "after": lambda loops: loops.plugin_round(fixed, ahead=False),
    }.items():
        torch.manual_seed(0)
        loops = gc.Loops(head, s, 3, 4, torch.bfloat16, CPU)
        runs[name] = [round_fn(loops) for _ in range(3)]
    assert runs["ahead"] == runs["vllm"] == runs["after"]


# -- benchmarks.gpu_model: pricing exact counts with a GPU's measured costs --


def test_fits_of_the_verification_curve():
    from benchmarks.gpu_model import interp, line, nondecreasing

    assert nondecreasing([[1, 3.0], [2, 1.0], [3, 5.0]]) == [[1, 2.0], [2, 2.0], [3, 5.0]]
    assert nondecreasing([[2, 4.0], [1, 1.0]]) == [[1, 1.0], [2, 4.0]]
    (x0, y0), (x1, y1) = line([[1, 1.0], [2, 2.0], [3, 3.0]])
    assert (x0, x1) == (1, 3) and abs(y0 - 1.0) < 1e-12 and abs(y1 - 3.0) < 1e-12
    assert interp([[1, 1.0], [3, 3.0]], 2) == 2.0 and interp([[1, 1.0], [3, 3.0]], 9) == 3.0


def test_per_request_price_by_hand(tmp_path):
    """A row of 100 tokens in 40 passes, 70 drafts verified, 80 drawn: with a flat 10 ms pass, 0.5 ms
    vLLM draft step and the plugin's svip loop 0.6 ms, the time is 40 x 10 + 80 x 0.6 = 448 ms,
    against 100 x 10 = 1000 ms without speculation."""
    import json

    from benchmarks.gpu_model import GpuCosts, per_request

    run = {
        "device": "test",
        "draft_step_ms": {"1": 0.45},
        "verify_ms": [[1, t, 10.0] for t in (1, 2, 3)],
        "loop_ms_per_step": {"1": {"vLLM loop": 0.5, "plugin: svip": 0.6}},
    }
    (tmp_path / "gpu_costs.json").write_text(json.dumps(run))
    (tmp_path / "costs.json").write_text(json.dumps({"verify_ms": [[1, 10.0], [3, 10.0]]}))
    g = GpuCosts(tmp_path)  # loops from the same run
    row = {"n_gen": 100, "n_target": 40, "n_draft": 70, "drawn_per_token": 0.8}
    assert abs(per_request(row, g, "svip") - 1000 / 448) < 1e-9
    assert abs(per_request(row, g, None) - 1000 / 440) < 1e-9  # vLLM's loop: 80 x 0.5


def test_pearl_benchmark_draft_runs_on_the_worker_thread():
    """benchmarks.gpu_pearl's random Qwen3 loads into parallel_draft's DenseDraft and drafts on DraftThread."""
    import numpy as np

    from benchmarks.gpu_pearl import TINY_DRAFT, random_qwen3
    from vllm_adaptive_spec.parallel_draft import DenseDraft, DraftThread

    draft = DenseDraft(TINY_DRAFT, random_qwen3(TINY_DRAFT, CPU, torch.float32), 64, CPU, torch.float32)
    thread = DraftThread(draft, None, CPU)
    try:
        thread.submit(np.arange(10), 4, until_asked=False)
        assert len(thread.collect()) == 4
    finally:
        thread.close()


def test_the_gpu_scripts_never_import_vllm():
    """They run on GPU machines that have PyTorch but not vLLM."""
    import subprocess
    import sys

    code = (
        "import sys, benchmarks.gpu_costs, benchmarks.gpu_pearl, benchmarks.gpu_model; "
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_per_step_price_by_hand(tmp_path):
    """10 engine steps of 4 requests verifying 120 tokens in all, 30 draft forwards of the batch, the
    svip loop at 0.6 ms against vLLM's 0.5, a flat 10 ms pass: 10 x 10 + 30 x 0.6 = 118 ms, against
    40 steps x 10 ms without speculation. Only EAGLE-3 reports are priced."""
    import json

    import pytest

    from benchmarks.gpu_model import GpuCosts, per_step, price

    loop = {"vLLM loop": 0.5, "plugin: svip": 0.6}
    run = {"device": "test", "draft_step_ms": {}, "verify_ms": [[1, t, 10.0] for t in (1, 2)]}
    (tmp_path / "gpu_costs.json").write_text(json.dumps(run | {"loop_ms_per_step": {"1": loop, "4": loop}}))
    (tmp_path / "costs.json").write_text(json.dumps({"verify_ms": [[1, 10.0], [100, 10.0]]}))
    g = GpuCosts(tmp_path)
    cfg = {"kind": "plugin", "timed": False, "adaptive": {"policy": "svip"}}
    row = {"steps": 10, "n_target": 40, "n_draft": 80, "draft_forwards_per_step": {"3": 10}, "cfg": cfg}
    ref = {"steps": 40, "n_target": 40}
    assert abs(per_step(row, ref, g, "svip") - 400 / 118) < 1e-9
    with pytest.raises(ValueError, match="EAGLE-3 runs only"):
        price({"rows": [{"method": "draft_model"}]}, g)
