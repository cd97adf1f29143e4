"""The CPU sampling fix: our expand_batch_to_tokens against a by-hand expansion."""

from __future__ import annotations

import torch

from vllm_adaptive_spec.integration.fixes import expand_batch_to_tokens


def test_expand_matches_by_hand():
    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]


def test_expand_keeps_dtype_and_handles_empty_rows():
    x = torch.tensor([3, 7, 9], dtype=torch.int32)
    cu = torch.tensor([1, 1, 3])
    out = expand_batch_to_tokens(x, cu, 3)
    assert out.dtype == torch.int32 and out.tolist() == [3, 9, 9]
