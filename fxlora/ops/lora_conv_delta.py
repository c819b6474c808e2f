"""``fxlora::lora_conv_delta``: a 1-D convolution's output plus each row's own LoRA delta, for
a convolution weight adapted as PEFT's ``target_parameters`` adapts a 3-D parameter.

PEFT reads the weight ``W (channels, d1, d2)`` as one small matrix per output channel and adds
``ΔW[c] = scaling · B[c] @ A[c]`` (transposed where the module says ``is_transposed``) to it
before the convolution. A convolution is linear in its weight, so a row with slot ``s`` gets
``conv1d(x_row, W) + conv1d(x_row, ΔW_s)`` with the same stride, padding, dilation and groups:
the op adds the second term onto ``y`` (the traced convolution's output). Each row's ``ΔW`` is
built from its slot's factors (``(rows, channels, d1, d2)``: the kernels are small), and all
rows run as one grouped convolution; rows without an adapter take zeros and keep their values. All ATen, with no read of device values on the host: it runs as is on
every device and inside CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxlora.ops.operands import BatchInfo, LoraWeights, weight_deltas


@torch.library.custom_op("fxlora::lora_conv_delta", mutates_args=())
def lora_conv_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    transposed: bool,
) -> torch.Tensor:
    """``y + delta``: ``x (rows, in_channels, length)`` the convolution's input, ``y`` its output
    ``(rows, channels, length')``; ``lora``: the weight's factors (:class:`LoraWeights`, an
    output channel as PEFT's expert); ``batch``: the metadata of ``x``'s rows, one token each
    (:class:`BatchInfo`); the rest the convolution's own arguments."""
    rows = x.shape[0]
    per_row = weight_deltas(LoraWeights(*lora), transposed, BatchInfo(*batch).token_slot).to(x.dtype)
    out = F.conv1d(
        x.reshape(1, -1, x.shape[-1]), per_row.flatten(0, 1), None, stride, padding, dilation, groups * rows
    )
    return y + out.view(y.shape).to(y.dtype)


@lora_conv_delta.register_fake
def _(x, y, lora, batch, stride, padding, dilation, groups, transposed):
    return torch.empty_like(y, memory_format=torch.contiguous_format)
