"""PEARL's parallel draft (parallel_draft.py, policies/pearl.py) without vLLM: the dense draft
computes the draft checkpoint's function, its cache rolls back by prefix, the thread runs on
its own CPU, and the timeline's shares are what the sums say."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from benchmarks.paths import DRAFTERS
from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.parallel_draft import DenseDraft, DraftProcess, DraftThread, Timeline, fractions, free_cpus
from vllm_adaptive_spec.policies.pearl import PearlPolicy

DRAFT = DRAFTERS["draft_model"]


@pytest.fixture(scope="module")
def hf_draft():
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 6000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def test_dense_draft_computes_the_checkpoint_function(hf_draft):
    """All at once, token by token, and after rolling back a divergent suffix: HF's logits."""
    ids = _ids(40)
    ref = hf_draft(torch.tensor([ids])).logits[0]  # [T, V]
    dd = DenseDraft.load(DRAFT, 128)
    assert torch.allclose(dd.sync(ids), ref[-1], atol=1e-4)
    step = DenseDraft.load(DRAFT, 128)
    step.sync(ids[:10])
    for j in range(10, 40):
        assert torch.allclose(step.forward(ids[j : j + 1], j), ref[j], atol=1e-4), j
        step.tokens.append(ids[j])
    other = ids[:30] + [5, 6, 7]
    want = hf_draft(torch.tensor([other])).logits[0, -1]
    assert torch.allclose(step.sync(other), want, atol=1e-4)


@torch.no_grad()
def test_continue_greedy_is_the_checkpoint_greedy_continuation(hf_draft):
    ids = _ids(25, seed=1)
    seq = list(ids)
    for _ in range(4):
        seq.append(int(hf_draft(torch.tensor([seq])).logits[0, -1].argmax()))
    dd = DenseDraft.load(DRAFT, 128)
    assert dd.continue_greedy(ids, 4) == seq[25:]
    assert dd.tokens == seq[:28]  # the cache holds the first n - 1 drafts too


def test_continue_greedy_stops_when_asked_between_tokens():
    """At least one token; then it stops at the first check that says so; the cache holds all but the last."""
    ids = _ids(20, seed=6)
    full = DenseDraft.load(DRAFT, 64).continue_greedy(ids, 5)
    dd = DenseDraft.load(DRAFT, 64)
    checks = iter([False, True])
    assert dd.continue_greedy(ids, 5, stop=lambda: next(checks)) == full[:2]
    assert dd.tokens == ids + full[:1]
    assert dd.continue_greedy(ids, 5, stop=lambda: True) == full[:1]


def test_sync_recomputes_only_what_the_cache_lacks():
    """All drafts accepted: the next round's sequence extends the cache, one token to run (the last
    draft); a rejection: the cache rolls back to the accepted prefix and runs from there."""
    dd = DenseDraft.load(DRAFT, 128)
    ran: list[tuple[int, int]] = []  # (first position, tokens) per forward
    forward = dd.forward
    dd.forward = lambda ids, start: ran.append((start, len(ids))) or forward(ids, start)
    ids = _ids(30, seed=2)
    ahead = dd.continue_greedy(ids, 4)  # prompt (30), then 3 one-token steps
    assert ran == [(0, 30), (30, 1), (31, 1), (32, 1)]
    ran.clear()
    dd.sync(ids + ahead)  # e_1..e_3 are cached; e_4 runs
    assert ran == [(33, 1)]
    ran.clear()
    dd.sync(ids + ahead[:1] + [7])  # e_2 rejected, 7 in its place
    assert ran == [(31, 1)]
    ran.clear()
    dd.sync(ids[:12])  # a shorter sequence: its last token still runs (its logits are the answer)
    assert ran == [(11, 1)]


def test_dense_draft_refuses_positions_past_its_cache():
    dd = DenseDraft.load(DRAFT, 16)
    with pytest.raises(ValueError, match="max_len 16"):
        dd.sync(_ids(17))


def _warm_capture(fn, device):
    """An eager stand-in for heads.cuda_graph.capture: runs fn twice (capture's warm-up), then replays it."""
    fn(), fn()
    return fn


def _graphed(max_len: int, capture=_warm_capture) -> DenseDraft:
    dd = DenseDraft.load(DRAFT, max_len)
    dd.use_graphs(capture)
    return dd


@torch.no_grad()
def test_graphed_decode_drafts_what_the_eager_draft_drafts():
    """The GPU path (one static-shape step a token, chained on the device), here with an eager stand-in
    for the capture: the same drafts and cache contents as the eager path, job after job: a prompt (one
    forward), accepted drafts, a rejection, a shorter sequence, and positions past the first graph's 256."""
    eager, graphed = DenseDraft.load(DRAFT, 600), _graphed(600)
    ids = _ids(40, seed=7)
    jobs = [(ids, 6)]
    first = eager.continue_greedy(ids, 6)
    assert graphed.continue_greedy(ids, 6) == first and graphed.tokens == eager.tokens
    seq = ids + first[:3] + [11]  # three accepted, then a token of the target's own
    jobs = [(seq, 5), (ids[:20], 4), (_ids(250, seed=8), 12)]  # the last crosses 256 positions
    for tokens, n in jobs:
        want = eager.continue_greedy(tokens, n)
        assert graphed.continue_greedy(tokens, n) == want and graphed.tokens == eager.tokens
    assert sorted(graphed._graphs) == [256, 512]


def test_graphed_decode_stops_when_asked_and_falls_back_when_a_capture_fails():
    ids = _ids(20, seed=6)
    full = DenseDraft.load(DRAFT, 64).continue_greedy(ids, 5)
    checks = iter([False, True])
    dd = _graphed(64)
    assert dd.continue_greedy(ids, 5, stop=lambda: next(checks)) == full[:2] and dd.tokens == ids + full[:1]

    def failing(fn, device):
        raise RuntimeError("no graphs here")

    dd = _graphed(64, failing)
    assert dd.continue_greedy(ids, 5) == full and dd._capture is None  # eager from then on


def test_a_graph_captured_at_the_caches_last_position_warms_up_on_scratch_slots():
    """Capture runs the step twice before recording it; there it writes past max_len (scratch), never
    over a cached token nor outside the cache (on a GPU an out-of-range write is a device assert)."""
    ids = _ids(64, seed=9)
    dd = _graphed(64)
    assert dd.continue_greedy(ids, 1) == DenseDraft.load(DRAFT, 64).continue_greedy(ids, 1)
    assert dd._capture is not None and list(dd._graphs) == [64]
    with pytest.raises(ValueError, match="max_len 64"):
        _graphed(64).continue_greedy(_ids(60), 8)


def test_draft_thread_runs_jobs_on_its_own_thread_and_cpu():
    cpus = {max(os.sched_getaffinity(0))}
    draft = DenseDraft.load(DRAFT, 128)
    seen = []
    greedy = draft.continue_greedy
    draft.continue_greedy = lambda seq, n, stop: (
        seen.append((threading.get_ident(), os.sched_getaffinity(0))) or greedy(seq, n, stop)
    )
    thread = DraftThread(draft, cpus, torch.device("cpu"))
    try:
        assert thread.collect() is None and thread.timeline.skipped == 1  # nothing submitted
        ids = np.asarray(_ids(20, seed=3))
        thread.submit(ids, 4)
        assert thread.pending
        time.sleep(0.5)  # time to draft all 4 before the engine asks
        assert thread.collect() == DenseDraft.load(DRAFT, 128).continue_greedy(ids.tolist(), 4)
        assert not thread.pending and seen[0][0] != threading.get_ident()
        assert seen[0][1] == cpus == thread.thread_cpus
        thread.submit(ids[:10], 2)
        thread.submit(ids[:12], 40)  # the first job, never collected, is collected and dropped
        got = thread.collect()  # asked at once: stops between two tokens, at least one
        assert 1 <= len(got) < 40 and got == DenseDraft.load(DRAFT, 128).continue_greedy(ids[:12].tolist(), len(got))
        thread.submit(ids[:12], 6, until_asked=False)
        assert thread.collect(step=False) == DenseDraft.load(DRAFT, 128).continue_greedy(ids[:12].tolist(), 6)
        assert thread.timeline.steps == 3
    finally:
        thread.close()


def test_draft_process_drafts_what_the_dense_draft_drafts():
    """Its own process and CPU; each job sends only what changed (accepted, rejected, a new request);
    a failed job fails its collect, and the next one works."""
    cpus = {max(os.sched_getaffinity(0))}
    proc = DraftProcess(DRAFT, 64, torch.bfloat16, cpus)
    local = DenseDraft.load(DRAFT, 64, dtype=torch.bfloat16)
    try:
        assert proc.thread_cpus == cpus
        seq = _ids(20, seed=4)
        for _ in range(3):
            proc.submit(np.asarray(seq), 4)
            time.sleep(0.5)  # time to draft all 4 before the engine asks
            got = proc.collect()
            assert got == local.continue_greedy(seq, 4)
            seq = seq + got[:3]  # every draft accepted: the next sequence extends what the process holds
        seq = seq[:-2] + [11]  # a rejection
        proc.submit(np.asarray(seq), 40)
        got = proc.collect()  # asked at once: it stops between two tokens, after at least one
        assert 1 <= len(got) < 40 and got == local.continue_greedy(seq, len(got))
        proc.submit(np.asarray(seq), 5, until_asked=False)  # asked at once, but all 5 wanted
        assert proc.collect(step=False) == local.continue_greedy(seq, 5)
        proc.submit(np.asarray(_ids(70)), 2)  # past max_len
        with pytest.raises(RuntimeError, match="max_len 64"):
            proc.collect()
        other = _ids(15, seed=5)
        proc.submit(np.asarray(other), 3)
        time.sleep(0.5)
        assert proc.collect() == local.continue_greedy(other, 3)
        assert proc.timeline.steps == 5
    finally:
        proc.close()


def test_draft_process_reports_a_bad_checkpoint_at_start(tmp_path):
    with pytest.raises(RuntimeError, match="draft process: ValueError: .*no config.json"):
        DraftProcess(tmp_path, 64, torch.float32, None)


def test_timeline_shares_by_hand():
    """Two steps of the same request, 10 ms apart; the draft computed 6 ms in each; the engine
    waited 1 ms on it in the second: draft idle 40% of a step, target waiting 5% (1 ms over 2 steps)."""
    t = Timeline()
    t.record(started=0.000, finished=0.006, asked=0.006, joined=0.006, same_request=False)
    t.record(started=0.007, finished=0.013, asked=0.015, joined=0.016, same_request=True)
    t.record(started=0.020, finished=0.021, asked=0.021, joined=0.021, same_request=False)  # a new request
    d = t.as_dict()
    assert (d["steps"], d["timed_steps"]) == (3, 1)
    assert d["step_ms"] == pytest.approx(10.0)
    assert d["draft_busy_ms"] == pytest.approx(13 / 3)
    assert d["target_wait_ms"] == pytest.approx(1 / 3)
    assert fractions(d)["draft_idle_frac"] == pytest.approx(1 - 13 / 30)
    assert d["target_wait_frac"] == pytest.approx(1 / 30)


def test_free_cpus():
    assert free_cpus({0}, ncpu=2) == {1}
    assert free_cpus({0, 1}, ncpu=2) == set()


def test_pearl_config_errors():
    assert AdaptiveSpecConfig.from_dict({"policy": "pearl"}).batch_aware is False
    assert AdaptiveSpecConfig.from_dict({"policy": "pearl", "draft_cpu": 1}).build_policy().draft_cpu == 1
    assert AdaptiveSpecConfig.from_dict({"policy": "pearl"}).build_policy().pre_draft == 1  # 0: PEARL as published
    for raw, needle in [
        ({"policy": "pearl", "batch_aware": True}, "adaptive_spec.batch_aware: true does not combine"),
        ({"policy": "pearl", "time_policy": True}, "adaptive_spec.time_policy: true does not combine"),
        ({"policy": "pearl", "draft_cpu": -1}, "adaptive_spec.draft_cpu"),
        ({"policy": "pearl", "pre_draft": 17}, "adaptive_spec.pre_draft: 17 is out of range"),
        ({"policy": "pearl", "draft_worker": "gpu"}, "adaptive_spec.draft_worker: 'gpu' is not one of"),
        ({"policy": "pearl", "threshold": 0.5}, "adaptive_spec.threshold: unknown field"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            AdaptiveSpecConfig.from_dict(raw)


def test_pearl_checks_the_draft_it_must_load(tmp_path):
    PearlPolicy.check_engine({}, str(DRAFT))
    with pytest.raises(ConfigError, match="speculative_config.model=.*no config.json"):
        PearlPolicy.check_engine({}, str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        PearlPolicy.check_engine({}, str(tmp_path))
    with pytest.raises(ConfigError, match="adaptive_spec.draft_cpu: 4095 is not a CPU"):
        PearlPolicy.check_engine({"draft_cpu": 4095}, str(DRAFT))
