"""Inference-time linear maps for the small stopping heads.

The heads run a few small matmuls per draft step. On CPU, `F.linear` on a few
rows pays a large fixed cost per call (oneDNN), while `addmm` on the weight
stored transposed does not: 1 x 256 @ 256 x 256, one thread, 45 us against
13 us (min over repeats). At batch 1 that fixed cost was most of a head's
time, so the policies run their heads through `Affine` (the same maths; no
autograd: training keeps the modules).
"""

from __future__ import annotations

import torch
from torch import nn


class Affine:
    """x @ W^T + b with W^T stored contiguous: [..., in] -> [..., out]."""

    __slots__ = ("bias", "wt")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.wt = weight.detach().t().contiguous()  # [in, out]
        self.bias = None if bias is None else bias.detach()  # [out]

    @classmethod
    def of(cls, linear: nn.Linear) -> Affine:
        return cls(linear.weight, linear.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, in]
        y = torch.mm(flat, self.wt) if self.bias is None else torch.addmm(self.bias, flat, self.wt)  # [N, out]
        return y.view(*x.shape[:-1], y.shape[-1])
