"""The SpecDec++ policy with the bundled toy head inside vLLM: lossless greedy
output, adaptive draft lengths, and start-up refusal of a head trained for
another draft."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks.paths import REPO, load_prompts
from tests.conftest import close_llm, first_mismatch, greedy, make_llm, released_stats, spec_config

pytestmark = pytest.mark.e2e

HEAD = REPO / "heads" / "toy" / "specdecpp.safetensors"
CAP = 8
N_PROMPTS = 20
MIXED_MAX_TOKENS = [(3, 17, 40, 64, 1)[i % 5] for i in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def specdecpp_llm():
    llm = make_llm(
        speculative_config=spec_config(CAP),
        # time_policy: the timing wrapper sits in the draft loop of this lossless test too.
        additional_config={"adaptive_spec": {"policy": "specdecpp", "head": str(HEAD), "time_policy": True}},
    )
    yield llm
    close_llm(llm)


def test_bundled_head_is_lossless_and_adaptive(ref_llm, specdecpp_llm):

    prompts = load_prompts("code_heldout", N_PROMPTS)
    want = greedy(ref_llm, prompts, MIXED_MAX_TOKENS)
    got = greedy(specdecpp_llm, prompts, MIXED_MAX_TOKENS)
    assert got == want, first_mismatch(got, want)
    for i in range(3):  # batch of one
        assert greedy(specdecpp_llm, prompts[i : i + 1], 48) == greedy(ref_llm, prompts[i : i + 1], 48)
    (snap,) = released_stats(specdecpp_llm)
    assert snap["policy"] == "specdecpp"
    lengths = snap["drafted_len_hist"]
    assert len(lengths) > 1 and max(int(k) for k in lengths) <= CAP, lengths
    assert snap["requests"] == {} and snap["tracked"] == 0, snap
    timing = snap["timing"]
    assert timing["rounds"] > 0 and timing["decides"] >= timing["rounds"], timing
    assert 0 < timing["policy_s"] < timing["propose_s"] and timing["policy_share"] > 0, timing


def test_head_for_another_draft_fails_at_startup(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_adaptive_spec import ConfigError
    from vllm_adaptive_spec.heads.fileformat import META_KEY

    with safe_open(str(HEAD), framework="pt") as fh:
        meta = json.loads(fh.metadata()[META_KEY])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    meta["draft"] = {"name": "some-other-draft", "fingerprint": "ab12" + "0" * 60}
    other = tmp_path / "other.safetensors"
    save_file(tensors, str(other), {META_KEY: json.dumps(meta)})
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        make_llm(
            speculative_config=spec_config(CAP),
            additional_config={"adaptive_spec": {"policy": "specdecpp", "head": str(other)}},
        )
    msg = str(err.value)
    assert msg.startswith("adaptive_spec.head: ") and "was trained for draft 'some-other-draft'" in msg, msg
    assert "the running draft is" in msg
    assert time.monotonic() - start < 60
