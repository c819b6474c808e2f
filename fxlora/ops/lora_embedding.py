"""``fxlora::lora_embedding``: an embedding lookup plus each token's own LoRA delta.

``y = F.embedding(ids, weight)``, then for every token ``t`` with slot ``s >= 0``:
``y[t] += scaling[s] * lora_a[s, :r, ids[t]] @ lora_b[s, :, :r].T`` with ``r = rank[s]``,
which is PEFT's ``F.embedding(ids, A.T) @ B.T * scaling``.

On CUDA the shrink is a gather of ``A``'s columns and the expand is the Triton SGMV
expand kernel, adding in place; elsewhere the reference runs (both
:mod:`fxlora.ops.lora_embedding_delta`'s, which serves an embedding whose lookup keeps its
traced form).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxlora.kernels import sgmv
from fxlora.ops.lora_embedding_delta import embedding_delta_reference, embedding_delta_triton
from fxlora.ops.operands import BatchInfo, LoraWeights


@torch.library.custom_op("fxlora::lora_embedding", mutates_args=())
def lora_embedding(
    ids: torch.Tensor, weight: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor]
) -> torch.Tensor:
    """``lora``: the factors (:class:`LoraWeights`, ``A`` as PEFT stores it, ``(S, R, vocab)``);
    ``batch``: the tokens' metadata (:class:`BatchInfo`)."""
    y = F.embedding(ids, weight)
    embedding_delta_reference(y.view(-1, y.shape[-1]), ids.reshape(-1), LoraWeights(*lora), BatchInfo(*batch).token_slot)
    return y


def _lora_embedding_triton(
    ids: torch.Tensor, weight: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor]
) -> torch.Tensor:
    y = F.embedding(ids, weight)
    embedding_delta_triton(y.view(-1, y.shape[-1]), ids.reshape(-1), LoraWeights(*lora), BatchInfo(*batch))
    return y


if sgmv is not None:
    lora_embedding.register_kernel("cuda")(_lora_embedding_triton)


@lora_embedding.register_fake
def _(ids, weight, lora, batch):
    return weight.new_empty((*ids.shape, weight.shape[1]))
