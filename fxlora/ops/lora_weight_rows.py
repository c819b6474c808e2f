"""``fxlora::lora_weight_rows``: each row's own adapted copy of a 3-D parameter, for a parameter
the model uses by its values (a product or sum with activations), not in a matmul.

PEFT's ``target_parameters`` adds ``ΔW[e] = scaling · B[e] @ A[e]`` to the parameter ``W (E, d1,
d2)`` while its module runs (:func:`fxlora.ops.operands.weight_deltas`). With a different
adapter per row, the op returns ``W + ΔW[slot of row]`` for every row, ``(rows, E, d1, d2)``:
``W`` itself for rows without an adapter, bit for bit. RWKV's time-mix parameters
``(1, 1, hidden)`` are the case: where the model broadcasts ``W`` over the batch, each row's
copy broadcasts over that row. All ATen, with no read of device values on the host: it runs as
is on every device and inside CUDA graphs.
"""

from __future__ import annotations

import torch

from fxlora.ops.operands import BatchInfo, LoraWeights, weight_deltas


@torch.library.custom_op("fxlora::lora_weight_rows", mutates_args=())
def lora_weight_rows(weight: torch.Tensor, lora: list[torch.Tensor], batch: list[torch.Tensor], transposed: bool) -> torch.Tensor:
    """``weight (E, d1, d2)`` as the model read it; ``lora``: its factors
    (:class:`LoraWeights`); ``batch``: the metadata of the batch's rows, one token each
    (:class:`BatchInfo`); ``transposed``: the module's ``is_transposed``."""
    return weight + weight_deltas(LoraWeights(*lora), transposed, BatchInfo(*batch).token_slot).to(weight.dtype)


@lora_weight_rows.register_fake
def _(weight, lora, batch, transposed):
    return weight.new_empty((batch[0].shape[0], *weight.shape))
