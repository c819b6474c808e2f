"""The operand bundles of the LoRA ops: a target's pool factors and its tokens' batch metadata.

A LoRA op's schema takes the factors as one ``Tensor[]`` (``lora_a, lora_b, scaling, rank``)
and the batch metadata as another (the five outputs of ``fxlora::batch_info``), as vLLM's
``LoRAKernelMeta`` carries its kernels' metadata. Each implementation names them on entry
with these tuples; the Triton launchers take the tensors unpacked from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class LoraWeights(NamedTuple):
    """One target's (or fused group's) pool factors: ``lora_a (S, R, in)``, ``lora_b (S, out, R)``
    (experts: an expert dimension after ``S``), ``scaling[S]`` float32 and ``rank[S]`` int32;
    in the multi-slice layout ``scaling`` and ``rank`` hold one entry per (slot, slice)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: torch.Tensor
    rank: torch.Tensor


def optional_weights(bundle: Sequence[torch.Tensor]) -> LoraWeights | None:
    """The factors of a projection that may have no LoRA: an empty bundle means none."""
    return LoraWeights(*bundle) if bundle else None


def weight_deltas(weights: LoraWeights, transposed: bool, row_slot: torch.Tensor) -> torch.Tensor:
    """Each row's delta of a 3-D parameter ``(E, d1, d2)`` as PEFT's ``target_parameters`` adds
    it, ``(rows, E, d1, d2)``: ``scaling[s] · B[s, e] @ A[s, e]`` over the slot's ``rank[s]``
    (transposed where the module says ``is_transposed``) for the row's slot ``s``, zeros for a
    row without one (``row_slot`` -1). All ATen, no read on the host."""
    slot = row_slot.long().clamp(min=0)
    lora_a, lora_b, scaling, rank = (t.index_select(0, slot) for t in weights)  # (rows, E, R, in), (rows, E, out, R)
    kept = (torch.arange(lora_a.shape[2], device=rank.device)[None, :] < rank[:, None]) & (row_slot >= 0)[:, None]
    delta = lora_b @ (lora_a * kept.to(lora_a.dtype)[:, None, :, None])
    delta = delta * scaling.to(delta.dtype)[:, None, None, None]
    return delta.transpose(-1, -2) if transposed else delta


class BatchInfo(NamedTuple):
    """``fxlora::batch_info``'s outputs (:mod:`fxlora.ops.batch_info` says what each holds)."""

    token_slot: torch.Tensor
    sorted_tokens: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor

    @property
    def segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the SGMV launchers read: ``(sorted_tokens, seg_start, seg_len, seg_slot)``."""
        return self.sorted_tokens, self.seg_start, self.seg_len, self.seg_slot
