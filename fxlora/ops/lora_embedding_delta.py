"""``fxlora::lora_embedding_delta``: an embedding's output plus each token's own LoRA delta,
for an embedding whose lookup keeps its traced form (a DTensor weight under tensor
parallelism, a tensor-subclass weight).

``out = y.clone()``, then for every token ``t`` with slot ``s >= 0``:
``out[t] += scaling[s] * lora_a[s, :r, ids[t]] @ lora_b[s, :, :r].T`` with ``r = rank[s]``,
which is PEFT's ``F.embedding(ids, A.T) @ B.T * scaling`` added onto its base layer's output.
The factors are whole (every row of the vocabulary), whatever part of the weight this process
holds: ``y`` is the lookup's whole result.

On CUDA the shrink is a gather of ``A``'s columns and the expand is the Triton SGMV
expand kernel, adding in place; elsewhere :func:`embedding_delta_reference` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxlora.kernels import sgmv
from fxlora.ops.batch_info import slot_groups
from fxlora.ops.operands import BatchInfo, LoraWeights


def embedding_delta_reference(y: torch.Tensor, ids: torch.Tensor, weights: LoraWeights, token_slot: torch.Tensor) -> None:
    """Add the delta into ``y`` (``(T, dim)``) for flat ``ids`` (``(T,)``), one slot at a time."""
    lora_a, lora_b, scaling, rank = weights
    for s, r, idx in slot_groups(token_slot, rank):
        after_a = F.embedding(ids.index_select(0, idx), lora_a[s, :r].T)
        delta = after_a @ lora_b[s, :, :r].T
        y.index_add_(0, idx, (delta * scaling[s].to(delta.dtype)).to(y.dtype))


def embedding_delta_triton(y: torch.Tensor, ids: torch.Tensor, weights: LoraWeights, info: BatchInfo) -> None:
    """The same on CUDA: row ``t`` of the shrunk input is ``A[slot_t, :, ids_t]``; tokens
    without an adapter read slot 0 and are skipped by the expand, which only visits the
    slots' segments."""
    lora_a, lora_b, scaling, rank = weights
    v = lora_a[info.token_slot.clamp(min=0).long(), :, ids].float()
    sgmv.lora_expand(y, v, lora_b, scaling, rank, *info.segments)


@torch.library.custom_op("fxlora::lora_embedding_delta", mutates_args=())
def lora_embedding_delta(ids: torch.Tensor, y: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor]) -> torch.Tensor:
    """``y``: the lookup's output ``(*ids.shape, dim)``; ``lora``: the factors
    (:class:`LoraWeights`, ``A`` as PEFT stores it, ``(S, R, vocab)``); ``batch``: the tokens'
    metadata (:class:`BatchInfo`)."""
    out = y.clone(memory_format=torch.contiguous_format)
    embedding_delta_reference(out.view(-1, out.shape[-1]), ids.reshape(-1), LoraWeights(*lora), BatchInfo(*batch).token_slot)
    return out


def _lora_embedding_delta_triton(ids: torch.Tensor, y: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor]) -> torch.Tensor:
    out = y.clone(memory_format=torch.contiguous_format)
    embedding_delta_triton(out.view(-1, out.shape[-1]), ids.reshape(-1), LoraWeights(*lora), BatchInfo(*batch))
    return out


if sgmv is not None:
    lora_embedding_delta.register_kernel("cuda")(_lora_embedding_delta_triton)


@lora_embedding_delta.register_fake
def _(ids, y, lora, batch):
    return torch.empty_like(y, memory_format=torch.contiguous_format)
