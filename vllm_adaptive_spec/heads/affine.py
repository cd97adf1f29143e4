"""Inference-time linear maps for the small stopping heads.

The heads run a few small matmuls per draft step. On CPU, `F.linear` on a few
rows pays a large fixed cost per call (oneDNN), while `addmm` on the weight
stored transposed does not: 1 x 256 @ 256 x 256, one thread, 45 us against
13 us (min over repeats). At batch 1 that fixed cost was most of a head's
time, so the policies run their heads through `Affine` (the same maths; no
autograd: training keeps the modules).

`NormAffine` also takes in the RMSNorm in front of a linear map: on this
build `F.rms_norm` on 2 x 256 costs about 40 us (one thread), while a vector
norm costs 5; the norm's weight and sqrt(in) fold into the stored matrix and
the row scale is applied after the product.
"""

from __future__ import annotations

import torch
from torch import nn


class Affine:
    """x @ W^T + b (+ residual) with W^T stored contiguous: [..., in] -> [..., out]."""

    __slots__ = ("bias", "wt")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.wt = weight.detach().t().contiguous()  # [in, out]
        self.bias = None if bias is None else bias.detach()  # [out]

    @classmethod
    def of(cls, linear: nn.Linear) -> Affine:
        return cls(linear.weight, linear.bias)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: [..., out] added to the result; without a bias it is the product's addend (one call)."""
        flat = x.reshape(-1, x.shape[-1])  # [N, in]
        if residual is not None and self.bias is None:
            y = torch.addmm(residual.reshape(-1, self.wt.shape[1]), flat, self.wt)  # [N, out]
        else:
            y = torch.mm(flat, self.wt) if self.bias is None else torch.addmm(self.bias, flat, self.wt)  # [N, out]
            if residual is not None:
                y = y.add_(residual.reshape(-1, y.shape[1]))
        return y.view(*x.shape[:-1], y.shape[-1])


class NormAffine:
    """RMSNorm(x; w, eps) @ W^T + b: [..., in] -> [..., out], with w and sqrt(in) folded into W^T.

    RMSNorm(x) = x w / sqrt(|x|^2 / n + eps) = (x sqrt(n)) w / sqrt(|x|^2 + n eps), so the product
    x @ (sqrt(n) diag(w) W^T) is scaled per row by 1 / hypot(|x|, sqrt(n eps)) (the same maths;
    float rounding differs in the last bits)."""

    __slots__ = ("bias", "floor", "wt")

    def __init__(self, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None):
        n = weight.shape[1]
        self.wt = (weight.detach().t() * (norm_weight.detach()[:, None] * n**0.5)).contiguous()  # [in, out]
        self.floor = torch.tensor((n * eps) ** 0.5, dtype=weight.dtype, device=weight.device)  # sqrt(n eps)
        self.bias = None if bias is None else bias.detach()  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, in]
        scale = torch.hypot(torch.linalg.vector_norm(flat, dim=-1, keepdim=True), self.floor)  # [N, 1]
        y = torch.mm(flat, self.wt)  # [N, out]
        y = y.div_(scale) if self.bias is None else torch.addcdiv(self.bias, y, scale)
        return y.view(*x.shape[:-1], y.shape[-1])
