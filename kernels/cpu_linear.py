"""Linear layers with weights pre-packed for oneDNN: the CPU path's matmuls, in float32 and (where the CPU has
bf16 instructions) bfloat16. F.linear is the reference twin.

The weights are reordered into oneDNN's blocked layout for batches of PACK_BATCH rows (decode batches). On this
project's 2-core machines that made a decode step of 16 sequences of the default model 10% faster in float32 than
`to_mkldnn` weights, and 7% faster in bfloat16 than F.linear, with the same float32 results; the linears alone
were no slower from 1 to 2,048 rows (benchmarks/RESULTS.md, 2026-12-07)."""
from __future__ import annotations

import torch
from torch import nn


PACK_BATCH = 16  # the rows oneDNN's reordered weights are laid out for (any number of rows works)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's layout for _linear_pointwise: reordered for PACK_BATCH rows where torch offers it."""
    weight = weight.detach().contiguous()
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH)
    return weight.to_mkldnn()


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", pack_weight(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2d, self.weight, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module`, and every tensor-parallel linear at world size 1 (`packable`: the
    same math), by a PackedLinear; returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) or getattr(child, "packable", False):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count
