"""compact_drafts: when the draft batch shrinks, what its forwards are cut to, and what the gate charges."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.policies.batch_gate import BatchGate
from vllm_adaptive_spec.policies.step import rows_to_compute


def test_the_batch_shrinks_once_at_most_half_of_it_still_drafts():
    assert rows_to_compute(16, 16) == 16
    assert rows_to_compute(16, 9) == 16  # more than half: not worth new metadata
    assert rows_to_compute(16, 8) == 8
    assert rows_to_compute(8, 1) == 1
    assert rows_to_compute(1, 1) == 1
    assert rows_to_compute(16, 0) == 16  # nothing drafts: the loop ends, nothing to compute


def test_config_field():
    assert AdaptiveSpecConfig.from_dict({"policy": "svip"}).compact_drafts is None  # the device decides
    assert AdaptiveSpecConfig.from_dict({"policy": "pearl"}).compact_drafts is None
    assert AdaptiveSpecConfig.from_dict({"policy": "svip", "compact_drafts": True}).compact_drafts is True
    with pytest.raises(ConfigError, match=r"^adaptive_spec.compact_drafts: expected true or false, got 1$"):
        AdaptiveSpecConfig.from_dict({"policy": "svip", "compact_drafts": 1})
    with pytest.raises(ConfigError, match=r"^adaptive_spec.compact_drafts: true does not combine with policy"):
        AdaptiveSpecConfig.from_dict({"policy": "pearl", "compact_drafts": True})


def test_the_gate_charges_the_rows_a_compacted_step_computes():
    """16 rows, D(n) = 0.25 n ms, V(x) = 2 + 0.1 x ms, p = q_max (slope 1, intercepts 0). After step 0 all
    16 kept a draft; 8 rows (q 0.99) still draft, 8 (q 0.1) stopped. G = 16 + 8 x 0.99 + 8 x 0.1 = 24.72,
    C = D(16) + V(32) = 4 + 5.2 = 9.2: 2.687 tokens/ms. Step 1 adds dG = 8 x 0.99 x 0.99 = 7.84 for
    dV = V(40) - V(32) = 0.8 and a draft step of D(16) = 4 (7.84 / 4.8 = 1.63: it does not pay) or, with
    the batch compacted to the 8 rows, D(8) = 2 (7.84 / 2.8 = 2.80: it pays)."""
    costs = {"draft_step_ms": [[1, 0.25], [64, 16.0]], "verify_ms": [[1, 2.1], [101, 12.1]]}
    n = 16
    top = [math.log(0.99)] * 8 + [math.log(0.1)] * 8
    drafting = [True] * 8 + [False] * 8
    verdicts = {}
    for compact in (False, True):
        gate = BatchGate(costs)
        gate.start_round([f"r{i}" for i in range(n)], cap=4, compact=compact)
        gate.estimator.slope, gate.estimator.intercepts = 1.0, torch.zeros(5, dtype=torch.float64)
        verdicts[compact] = gate.after_step(top, [True] * n, drafting, [1] * n, t=0)
        assert gate._gain == pytest.approx(24.72)
    assert verdicts == {False: False, True: True}


def test_rows_cut_the_forward_and_write_back_into_the_batch():
    from vllm_adaptive_spec.integration.proposer import _Rows

    rows = _Rows(4, torch.device("cpu"))
    assert rows.shrink([True, True, True, False]) is None and rows.n == 4  # 3 of 4: stays whole
    keep = rows.shrink([True, False, True, False])
    assert [k.tolist() for k in keep] == [[0, 2]] * 2 and rows.rows == [0, 2] and rows.saved == 2
    tokens = torch.tensor([10, 11, 12, 13])
    assert rows.gather(tokens).tolist() == [10, 12]
    out = rows.expand("logits", torch.tensor([[1.0], [3.0]]))
    assert out.tolist() == [[1.0], [0.0], [3.0], [0.0]]
    keep = rows.shrink([False, False, True, False])  # places among the 2 rows computed last
    assert [k.tolist() for k in keep] == [[1]] * 2 and rows.rows == [2] and rows.saved == 2 + 3
    assert rows.index.tolist() == [2]
    out = rows.expand("logits", torch.tensor([[5.0]]))
    assert out.tolist() == [[1.0], [0.0], [5.0], [0.0]]  # row 0 keeps its last values, read by nothing


def test_decode_metadata_cut_to_the_rows_still_drafting():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_adaptive_spec.integration.proposer import _compact_metadata

    arange = torch.arange(8, dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=arange[:5],
        query_start_loc_cpu=arange[:5].clone(),
        seq_lens=torch.tensor([7, 8, 9, 10], dtype=torch.int32),
        num_reqs=4,
        num_actual_tokens=4,
        max_query_len=1,
        max_seq_len=10,
        block_table_tensor=torch.arange(12, dtype=torch.int32).view(4, 3),
        slot_mapping=torch.tensor([70, 81, 92, 103]),
        seq_lens_cpu_upper_bound=torch.tensor([7, 8, 9, 10]),
        req_idx=np.array([5, 6, 7, 8]),
    )
    keep = torch.tensor([1, 3])
    cut = _compact_metadata(cad, keep, keep, arange, np.arange(8, dtype=np.int32))
    assert (cut.num_reqs, cut.num_actual_tokens, cut.max_query_len, cut.max_seq_len) == (2, 2, 1, 10)
    assert cut.query_start_loc.tolist() == [0, 1, 2] and cut.query_start_loc_cpu.tolist() == [0, 1, 2]
    assert cut.seq_lens.tolist() == [8, 10] and cut.slot_mapping.tolist() == [81, 103]
    assert cut.block_table_tensor.tolist() == [[3, 4, 5], [9, 10, 11]]
    assert cut.seq_lens_cpu_upper_bound.tolist() == [8, 10] and cut.req_idx.tolist() == [6, 8]
    assert cad.seq_lens.tolist() == [7, 8, 9, 10]  # the round's full metadata is left as it was
