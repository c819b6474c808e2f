"""``fxlora::lora_embedding``: an embedding lookup plus each token's own LoRA delta.

``y = F.embedding(ids, weight)``, then for every token ``t`` with slot ``s >= 0``:
``y[t] += scaling[s] * lora_a[s, :r, ids[t]] @ lora_b[s, :, :r].T`` with ``r = rank[s]``,
which is PEFT's ``F.embedding(ids, A.T) @ B.T * scaling``.

On CUDA the shrink is a gather of ``A``'s columns and the expand is the Triton SGMV
expand kernel, adding in place; elsewhere :func:`lora_embedding_delta_reference` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxlora.kernels import sgmv
from fxlora.ops.batch_info import slot_groups
from fxlora.ops.operands import BatchInfo, LoraWeights


def lora_embedding_delta_reference(
    y: torch.Tensor, ids: torch.Tensor, weights: LoraWeights, token_slot: torch.Tensor
) -> None:
    """Add the delta into ``y`` (``(T, dim)``) for flat ``ids`` (``(T,)``), one slot at a time."""
    lora_a, lora_b, scaling, rank = weights
    for s, r, idx in slot_groups(token_slot, rank):
        after_a = F.embedding(ids.index_select(0, idx), lora_a[s, :r].T)
        delta = after_a @ lora_b[s, :, :r].T
        y.index_add_(0, idx, (delta * scaling[s].to(delta.dtype)).to(y.dtype))


@torch.library.custom_op("fxlora::lora_embedding", mutates_args=())
def lora_embedding(
    ids: torch.Tensor, weight: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor]
) -> torch.Tensor:
    """``lora``: the factors (:class:`LoraWeights`, ``A`` as PEFT stores it, ``(S, R, vocab)``);
    ``batch``: the tokens' metadata (:class:`BatchInfo`)."""
    weights, info = LoraWeights(*lora), BatchInfo(*batch)
    y = F.embedding(ids, weight)
    lora_embedding_delta_reference(y.view(-1, y.shape[-1]), ids.reshape(-1), weights, info.token_slot)
    return y


def _lora_embedding_triton(
    ids: torch.Tensor, weight: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor]
) -> torch.Tensor:
    (lora_a, lora_b, scaling, rank), info = LoraWeights(*lora), BatchInfo(*batch)
    y = F.embedding(ids, weight)
    flat = ids.reshape(-1)
    # row t of v is A[slot_t, :, ids_t]; tokens without an adapter read slot 0 and are
    # skipped by the expand, which only visits the slots' segments
    v = lora_a[info.token_slot.clamp(min=0).long(), :, flat].float()
    sgmv.lora_expand(y.view(-1, y.shape[-1]), v, lora_b, scaling, rank, *info.segments)
    return y


if sgmv is not None:
    lora_embedding.register_kernel("cuda")(_lora_embedding_triton)


@lora_embedding.register_fake
def _(ids, weight, lora, batch):
    return weight.new_empty((*ids.shape, weight.shape[1]))
