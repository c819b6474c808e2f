"""``fxlora::lora_grouped_delta``: a grouped GEMM's output plus each row's own LoRA delta, for
the 3-D weight of a segment GEMM adapted as PEFT's ``target_parameters`` adapts it.

A grouped GEMM ``y = grouped_mm(x, W, offsets)`` multiplies rows ``offsets[g - 1] ..
offsets[g]`` of ``x`` by ``W[g]`` (``(groups, in, out)``); rows past the last offset are not
computed. A row of group ``g`` whose token has slot ``s`` gets ``scaling[s] · (x @ A[s, g]ᵀ) @
B[s, g]ᵀ`` more: the pool holds a delta per group, its factors turned to the GEMM's
orientation when the adapter was placed (:func:`fxlora.adapters.experts.parameter_factors`).
``token_slot`` holds each row's slot (-1: none). The reference reads the segments on the host;
the composition (the CUDA implementation, and what Inductor compiles in the op's place) finds
each row's group by a search of the offsets and adds the deltas with ``fxlora::lora_delta``
over ``(slot, group)`` pairs, reading nothing on the host.
"""

from __future__ import annotations

import torch

from fxlora.kernels import sgmv
from fxlora.ops.batch_info import slot_groups
from fxlora.ops.lora_delta import add_pair_deltas
from fxlora.ops.operands import LoraWeights


def lora_grouped_delta_reference(
    x: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor, token_slot: torch.Tensor, lora: list[torch.Tensor]
) -> torch.Tensor:
    lora_a, lora_b, scaling, rank = LoraWeights(*lora)
    out = y.clone()
    start = 0
    for g, end in enumerate(offsets.tolist()):
        rows = torch.arange(start, end, device=x.device)
        for s, r, idx in slot_groups(token_slot[start:end], rank):
            delta = (x[rows[idx]].to(lora_a.dtype) @ lora_a[s, g, :r].T) @ lora_b[s, g, :, :r].T
            out.index_add_(0, rows[idx], (delta * scaling[s].to(delta.dtype)).to(out.dtype))
        start = end
    return out


lora_grouped_delta = torch.library.custom_op("fxlora::lora_grouped_delta", lora_grouped_delta_reference, mutates_args=())


@lora_grouped_delta.register_fake
def _(x, y, offsets, token_slot, lora):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def lora_grouped_delta_composed(
    x: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor, token_slot: torch.Tensor, lora: list[torch.Tensor]
) -> torch.Tensor:
    """The op as ``fxlora::lora_delta`` over each row's ``(slot, group)`` pair: its CUDA
    implementation, and what Inductor compiles in its place."""
    groups = lora[0].shape[1]
    rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
    group = torch.searchsorted(offsets, rows, right=True)  # groups: past the last offset
    slot = torch.where(group < groups, token_slot, -1)
    out = y.clone(memory_format=torch.contiguous_format)
    add_pair_deltas(out, x, LoraWeights(*lora), slot, group.clamp(max=groups - 1).to(slot.dtype))
    return out


if sgmv is not None:
    lora_grouped_delta.register_kernel("cuda")(lora_grouped_delta_composed)
