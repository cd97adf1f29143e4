"""SpecDec++ head files and the stop rule, on tiny hand-made heads and drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.test_policies import stops
from vllm_adaptive_spec import ConfigError, parse_additional_config
from vllm_adaptive_spec.heads.fileformat import META_KEY, draft_identity, model_fingerprint
from vllm_adaptive_spec.heads.specdecpp import (
    SpecDecHead,
    SpecDecHeadConfig,
    check_specdecpp,
    frozen_logits,
    load_specdecpp,
    save_specdecpp,
    stop_lengths,
    stop_rule,
)
from vllm_adaptive_spec.policies.specdecpp import SpecDecPPPolicy

H = 8
FIELD = "adaptive_spec.head"


def make_draft(root: Path, seed: int = 0, hidden: int = H) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": hidden, "model_type": "qwen3"}, indent=2))
    gen = torch.Generator().manual_seed(seed)
    save_file({"embed.weight": torch.randn(16, hidden, generator=gen).bfloat16()}, str(root / "model.safetensors"))
    return root


def make_head_file(path: Path, draft: Path, threshold: float = 0.4, depth: int = 3) -> SpecDecHead:
    torch.manual_seed(0)
    head = SpecDecHead(SpecDecHeadConfig(H, depth))
    save_specdecpp(path, head, {"draft": draft_identity(draft), "recommended_threshold": threshold, "commit": "abc"})
    return head


@pytest.fixture
def draft(tmp_path) -> Path:
    return make_draft(tmp_path / "draft")


@pytest.fixture
def head_file(tmp_path, draft) -> Path:
    path = tmp_path / "head.safetensors"
    make_head_file(path, draft)
    return path


@pytest.mark.parametrize("batch", [1, 5])
def test_frozen_logits_equal_the_module(batch):
    # the policies run the head through heads.affine (addmm on stored W^T): the same maths
    torch.manual_seed(1)
    head = SpecDecHead(SpecDecHeadConfig(H, depth=3))
    for p in head.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(batch, H)
    with torch.no_grad():
        torch.testing.assert_close(frozen_logits(head)(x), head(x), rtol=1e-5, atol=1e-6)


def test_affine_keeps_leading_dims():
    from vllm_adaptive_spec.heads.affine import Affine

    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(Affine.of(lin)(x), lin(x))
        torch.testing.assert_close(Affine(lin.weight)(x), x @ lin.weight.T)


@pytest.mark.parametrize("bias", [True, False])
def test_norm_affine_equals_rms_norm_then_linear(bias):
    """NormAffine folds the RMSNorm's weight into the matrix and scales rows after the product."""
    from vllm_adaptive_spec.heads.affine import NormAffine

    torch.manual_seed(0)
    lin, w = torch.nn.Linear(16, 5, bias=bias), torch.rand(16) + 0.5
    x = torch.randn(3, 2, 16) * 3
    x[0, 0] = 0.0  # an all-zero row: the eps floor, as in RMSNorm
    with torch.no_grad():
        want = lin(torch.nn.functional.rms_norm(x, (16,), w, 1e-6))
        torch.testing.assert_close(NormAffine(w, 1e-6, lin.weight, lin.bias)(x), want, rtol=1e-5, atol=1e-6)


def test_blocks_have_their_own_weights():
    head = SpecDecHead(SpecDecHeadConfig(H, depth=3))
    weights = [b.weight for b in head.blocks]
    assert len({id(w) for w in weights}) == 3
    assert len({w.data_ptr() for w in weights}) == 3
    assert sum(p.numel() for p in head.parameters()) == 3 * (H * H + H) + H + 1
    assert head(torch.randn(5, H)).shape == (5,)


def test_round_trip(head_file, draft):
    torch.manual_seed(0)
    want = SpecDecHead(SpecDecHeadConfig(H, 3))
    got, meta = load_specdecpp(head_file)
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    assert meta["kind"] == "specdecpp" and meta["hidden_size"] == H and meta["depth"] == 3
    assert meta["recommended_threshold"] == 0.4 and meta["commit"] == "abc"
    assert meta["draft"] == {"name": "draft", "fingerprint": model_fingerprint(draft)}
    assert check_specdecpp(head_file, draft)["depth"] == 3
    x = torch.randn(4, H)
    assert torch.equal(got(x), want(x))


def test_fingerprint_sees_weights_and_config_but_not_formatting(tmp_path, draft):
    fp = model_fingerprint(draft)
    assert fp == model_fingerprint(make_draft(tmp_path / "same"))
    assert fp != model_fingerprint(make_draft(tmp_path / "other", seed=1))
    assert fp != model_fingerprint(make_draft(tmp_path / "wider", hidden=H + 1))
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(cfg))  # same content, other formatting
    assert model_fingerprint(draft) == fp
    (draft / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": 1e-5}))
    assert model_fingerprint(draft) != fp


def test_head_for_another_draft_is_refused(tmp_path, head_file):
    other = make_draft(tmp_path / "other-draft", seed=1)
    with pytest.raises(ConfigError, match=r"adaptive_spec.head: .* was trained for draft 'draft' \(fingerprint"):
        check_specdecpp(head_file, other)


def _rewrite(path: Path, tensors: dict, meta: dict | None) -> None:
    save_file(tensors, str(path), None if meta is None else {META_KEY: json.dumps(meta)})


def _damaged(kind: str, head_file: Path, tmp_path: Path) -> Path:
    from safetensors import safe_open

    with safe_open(str(head_file), framework="pt") as fh:
        meta = json.loads(fh.metadata()[META_KEY])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    bad = tmp_path / f"{kind}.safetensors"
    if kind == "missing":
        return tmp_path / "nothing-here.safetensors"
    if kind == "truncated":
        bad.write_bytes(head_file.read_bytes()[:-100])
    elif kind == "not-safetensors":
        bad.write_bytes(b"\x00garbage" * 40)
    elif kind == "no-metadata":
        _rewrite(bad, tensors, None)
    elif kind == "corrupt-metadata":
        save_file(tensors, str(bad), {META_KEY: "{not json"})
    elif kind == "wrong-dtype":
        _rewrite(bad, tensors | {"out.weight": tensors["out.weight"].half()}, meta)
    elif kind == "wrong-shape":
        _rewrite(bad, tensors | {"blocks.1.weight": torch.zeros(H, H + 1)}, meta)
    elif kind == "missing-tensor":
        _rewrite(bad, {k: v for k, v in tensors.items() if k != "blocks.2.bias"}, meta)
    elif kind == "wrong-kind":
        _rewrite(bad, tensors, meta | {"kind": "pacer"})
    elif kind == "bad-threshold":
        _rewrite(bad, tensors, meta | {"recommended_threshold": 2.0})
    elif kind == "nan-weights":
        _rewrite(bad, tensors | {"out.bias": torch.tensor([float("nan")])}, meta)
    return bad


@pytest.mark.parametrize(
    "kind",
    [
        "missing",
        "truncated",
        "not-safetensors",
        "no-metadata",
        "corrupt-metadata",
        "wrong-dtype",
        "wrong-shape",
        "missing-tensor",
        "wrong-kind",
        "bad-threshold",
        "nan-weights",
    ],
)
def test_bad_files_fail_with_one_config_error(kind, head_file, draft, tmp_path):
    bad = _damaged(kind, head_file, tmp_path)
    with pytest.raises(ConfigError) as err:
        check_specdecpp(bad, draft)
    msg = str(err.value)
    assert msg.startswith(f"{FIELD}: "), msg
    assert str(bad) in msg and "\n" not in msg


def test_config_requires_an_existing_head_and_defaults_the_threshold(head_file):
    with pytest.raises(ConfigError, match="adaptive_spec.head: required for policy 'specdecpp'"):
        parse_additional_config({"adaptive_spec": {"policy": "specdecpp"}})
    with pytest.raises(ConfigError, match="adaptive_spec.head: 'no/such.safetensors' is not an existing file"):
        parse_additional_config({"adaptive_spec": {"policy": "specdecpp", "head": "no/such.safetensors"}})
    with pytest.raises(ConfigError, match="adaptive_spec.head: expected a non-empty path string, got 3"):
        parse_additional_config({"adaptive_spec": {"policy": "specdecpp", "head": 3}})
    with pytest.raises(ConfigError, match=r"adaptive_spec.threshold: 1.5 is out of range \[0.0, 1.0\]"):
        parse_additional_config({"adaptive_spec": {"policy": "specdecpp", "head": str(head_file), "threshold": 1.5}})
    cfg = parse_additional_config({"adaptive_spec": {"policy": "specdecpp", "head": str(head_file)}})
    assert cfg.build_policy().threshold == 0.4  # the head's recommended value
    cfg = parse_additional_config({"adaptive_spec": {"policy": "specdecpp", "head": str(head_file), "threshold": 0.7}})
    assert cfg.build_policy().threshold == 0.7


def test_stop_rule_on_hand_made_probabilities():
    running = torch.ones(3)
    # rows: p = 0.9, 0.9, 0.5 (risk 0.1, 0.19, 0.595); always 0.99; 0.9 then NaN
    p_steps = torch.tensor([[0.9, 0.99, 0.9], [0.9, 0.99, float("nan")], [0.5, 0.99, 0.9]])  # [t, B]
    stops = []
    for p in p_steps:
        running, go = stop_rule(running, p, threshold=0.3)
        stops.append((~go).tolist())
    assert stops == [[False, False, False], [False, False, True], [True, False, True]]
    assert running[0].item() == pytest.approx(0.405)
    p = torch.tensor([[0.9, 0.9, 0.5, 1.0], [0.9, 0.9, 0.9, 0.9], [0.99, 0.99, 0.99, 0.99], [float("nan")] * 4])
    # risk after tokens: [0.1, 0.19, 0.595] -> stop after token 2 (length 3); [0.1, 0.19, 0.271] -> cap
    assert stop_lengths(p, 0.3).tolist() == [3, 4, 4, 1]
    assert stop_lengths(p[:, :1], 0.3).tolist() == [1, 1, 1, 1]


class _Fixed(SpecDecHead):
    """A head that returns prescribed logits, one per row, in call order."""

    def __init__(self, probs: list[list[float]]):
        super().__init__(SpecDecHeadConfig(H, 1))
        self.logits = [torch.logit(torch.tensor(p)) for p in probs]

    def forward(self, hidden):
        return self.logits.pop(0).to(hidden.device)

    def inference(self):
        return self.forward


def test_policy_judges_the_previous_token_and_stops(head_file):
    policy = SpecDecPPPolicy(str(head_file), threshold=0.3)
    policy.head = _Fixed([[0.9, 0.9, 0.9], [0.9, 0.5, 0.9], [0.9, 0.9, 0.9]])  # p_0, p_1, p_2 per row
    assert policy.round_limits(["a", "b", "c"], cap=8) == [8, 8, 8]
    logp = torch.log_softmax(torch.zeros(3, 5), -1)
    logp[2] = float("nan")
    tokens = torch.zeros(3, dtype=torch.long)
    hidden = torch.randn(3, H)
    d = policy.decide(logp, tokens, 0, hidden)  # nothing to judge yet; the NaN row stops
    assert d.keep.tolist() == [True, True, False] and stops(d) == [False, False, True]
    d = policy.decide(logp[:2].clone().repeat(2, 1)[:3], tokens, 1, hidden)  # p_0 = 0.9: risk 0.1
    assert d.keep.tolist() == [True, True, True] and not d.stop.any()
    d = policy.decide(logp[:2].clone().repeat(2, 1)[:3], tokens, 2, hidden)  # row b: 1 - 0.9*0.5 = 0.55 > 0.3
    assert d.keep.tolist() == [True, False, True] and stops(d) == [False, True, False]
    d = policy.decide(logp[:2].clone().repeat(2, 1)[:3], tokens, 3, hidden)  # 1 - 0.729 = 0.271 <= 0.3
    assert d.keep.tolist() == [True, False, True]
    # a new round starts from a product of 1
    policy.head = _Fixed([[0.9, 0.9, 0.9]])
    policy.round_limits(["a", "b", "c"], cap=8)
    d = policy.decide(logp[:2].clone().repeat(2, 1)[:3], tokens, 1, hidden)
    assert not d.stop.any()


def test_policy_stops_on_nan_hidden_state(head_file):
    policy = SpecDecPPPolicy(str(head_file), threshold=1.0)  # only NaN can stop a row
    policy.round_limits(["a", "b"], cap=4)
    logp = torch.log_softmax(torch.zeros(2, 5), -1)
    hidden = torch.zeros(2, H)
    hidden[1] = float("nan")
    d = policy.decide(logp, torch.zeros(2, dtype=torch.long), 1, hidden)
    assert d.keep.tolist() == [True, False] and stops(d) == [False, True]


def test_policy_builds_its_forward_once_per_device_as_set(head_file):
    """Regression: the policy compared its weights' device ("cuda:0") with the device the proposer set
    ("cuda") and rebuilt its forward every round. Here a set "cpu:0" against the tensors' "cpu"."""
    policy = SpecDecPPPolicy(str(head_file))
    policy.device = torch.device("cpu", 0)
    policy.round_limits(["a"], cap=4)
    built = policy._prob
    policy.round_limits(["a", "b"], cap=4)
    assert policy._prob is built
