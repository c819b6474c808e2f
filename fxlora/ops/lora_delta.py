"""``fxlora::lora_delta``: each token's own LoRA delta, added in place onto outputs that some
base computation already wrote.

For every token ``t`` with slot ``s >= 0``:
``y[t] += scaling[s] * (x[t] @ lora_a[s, :rank[s]].T) @ lora_b[s, :, :rank[s]].T``. The op
leaves the base alone, whatever computed ``y`` (``input @ weight.T``, a quantised matmul, a
tensor-subclass weight): tokens without an adapter, and slots of rank 0, keep their values
bit for bit. Several outputs that read one input (the multi-slice layout) take one call.

With ``shrunk``, ``fxlora::lora_shrink`` (issued before the base) has written the shrink, and
the op only expands it.

The reference delta here (PEFT's operations, one slot at a time) is every linear LoRA op's
reference; their CUDA implementations share :mod:`fxlora.ops.delta_launcher`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fxlora.kernels import sgmv
from fxlora.ops.batch_info import slot_groups
from fxlora.ops.delta_launcher import capturing, expand_onto, join, lora_workspace, with_lora_delta
from fxlora.ops.operands import BatchInfo, LoraWeights


def lora_delta_reference(y: torch.Tensor, x: torch.Tensor, weights: LoraWeights, token_slot: torch.Tensor) -> None:
    """Add the LoRA delta into ``y`` (``(T, out)``) for ``x`` (``(T, in)``), one slot at a time,
    with the same operations and order as PEFT. Reads slot ids on the host."""
    lora_a, lora_b, scaling, rank = weights
    for s, r, idx in slot_groups(token_slot, rank):
        xs = x.index_select(0, idx).to(lora_a.dtype)
        delta = (xs @ lora_a[s, :r].T) @ lora_b[s, :, :r].T
        y.index_add_(0, idx, (delta * scaling[s].to(delta.dtype)).to(y.dtype))


def sliced_delta_reference(ys: list[torch.Tensor], x: torch.Tensor, weights: LoraWeights, token_slot: torch.Tensor) -> None:
    """:func:`lora_delta_reference` for each output slice ``ys[i]`` (``(T, width_i)``) of the
    multi-slice layout: rank rows ``i * max_rank ..`` of ``lora_a``, output rows
    ``sum(width_0 .. width_{i-1}) ..`` of ``lora_b``, entries ``s * len(ys) + i`` of ``scaling``
    and ``rank``."""
    lora_a, lora_b, scaling, rank = weights
    n, max_rank, col = len(ys), lora_a.shape[1] // len(ys), 0
    for i, y in enumerate(ys):
        width = y.shape[-1]
        a, b = lora_a[:, i * max_rank : (i + 1) * max_rank], lora_b[:, col : col + width]
        lora_delta_reference(y, x, LoraWeights(a, b, scaling[i::n], rank[i::n]), token_slot)
        col += width


def add_pair_deltas(y, x, lora: LoraWeights | None, pair_slot, pair_group, pairs=None):
    """``y += scaling · (x @ A[s, g]ᵀ) @ B[s, g]ᵀ`` for each row's pair of slot ``s`` and group
    ``g`` (an expert), of a pool holding a delta per group (``A (slots, groups, r, in)``),
    read as ``slots · groups`` adapters: pair ``(s, g)`` is adapter ``s · groups + g``, none
    where ``s < 0``. Nothing is read on the host. Returns the pairs' ``fxlora::batch_info``
    over those ids, ``(pool size, batch_info)``, which a call over the same rows and a pool of
    as many adapters takes back as ``pairs``."""
    if lora is None:
        return pairs
    lora_a, lora_b, scaling, rank = lora
    slots, groups, max_rank, fin = lora_a.shape
    if pairs is None or pairs[0] != slots * groups:
        pool_id = torch.where(pair_slot >= 0, pair_slot * groups + pair_group, -1).to(torch.int32)
        pairs = (slots * groups, torch.ops.fxlora.batch_info(pool_id, x, 1, slots * groups))
    per_pair = [
        lora_a.view(slots * groups, max_rank, fin),
        lora_b.view(slots * groups, lora_b.shape[2], max_rank),
        scaling.repeat_interleave(groups),
        rank.repeat_interleave(groups),
    ]
    torch.ops.fxlora.lora_delta(x, [y], per_pair, list(pairs[1]), lora_workspace(x, per_pair[0]))
    return pairs


@torch.library.custom_op("fxlora::lora_delta", mutates_args=("outputs", "workspace"))
def lora_delta(
    x: torch.Tensor,
    outputs: list[torch.Tensor],
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
    workspace: torch.Tensor,
    shrunk: bool = False,
) -> None:
    """Add the delta of ``x`` (``(..., in)``) in place onto ``outputs``: one ``(..., out)``
    tensor, or one per slice of the multi-slice layout, each with ``x``'s leading shape.
    ``lora``: the factors (:class:`LoraWeights`); ``batch``: the tokens' metadata
    (:class:`BatchInfo`); ``workspace`` (from :func:`fxlora.ops.delta_launcher.lora_workspace`): the CUDA kernel's
    shrink result. ``shrunk``: ``fxlora::lora_shrink`` wrote it already, before the base
    computation, and the CUDA kernel only expands (the reference computes the whole delta
    from ``x`` either way)."""
    ys, written = _rows(x, outputs, unit_stride=False)
    sliced_delta_reference(ys, x.reshape(-1, x.shape[-1]), LoraWeights(*lora), BatchInfo(*batch).token_slot)
    written()


def lora_delta_triton(
    x: torch.Tensor,
    outputs: list[torch.Tensor],
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
    workspace: torch.Tensor,
    shrunk: bool = False,
) -> None:
    """The CUDA implementation: one shrink and one expand over every output, or with
    ``shrunk`` the expand alone, after the side stream ``fxlora::lora_shrink`` may have
    forked onto has joined."""
    ys, written = _rows(x, outputs, unit_stride=True)
    widths = tuple(y.shape[-1] for y in ys) if len(ys) > 1 else None
    weights, info = LoraWeights(*lora), BatchInfo(*batch)
    if shrunk:
        if capturing(x):
            join(x.device)
        expand_onto(ys if widths else ys[0], workspace, weights, info, widths)
    else:
        base = (lambda: ys) if widths else (lambda: ys[0])  # noqa: E731
        with_lora_delta(x, base, weights, info, workspace, False, widths, one_gemm=False)
    written()


def _rows(x: torch.Tensor, outputs: list[torch.Tensor], unit_stride: bool) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Each output as ``(T, width)`` rows that writes reach, and a function to call once they
    are written. An output that cannot be viewed so (or, for the kernels, whose features are
    not contiguous) is worked on in a contiguous copy that the function copies back."""
    if not outputs:
        raise ValueError("fxlora::lora_delta needs at least one output")
    rows, copies = [], []
    for i, y in enumerate(outputs):
        if y.dim() == 0 or y.shape[:-1] != x.shape[:-1]:
            raise ValueError(
                f"fxlora::lora_delta: output {i} has shape {tuple(y.shape)}, but the input's leading shape is "
                f"{tuple(x.shape[:-1])}"
            )
        try:
            r = y.view(-1, y.shape[-1])
        except RuntimeError:
            r = None
        if r is None or (unit_stride and r.stride(-1) != 1):
            r = y.reshape(-1, y.shape[-1]).contiguous().clone()
            copies.append((y, r))
        rows.append(r)

    def written() -> None:
        for y, r in copies:
            y.copy_(r.view(y.shape))

    return rows, written


if sgmv is not None:
    lora_delta.register_kernel("cuda")(lora_delta_triton)


@lora_delta.register_fake
def _(x, outputs, lora, batch, workspace, shrunk=False):
    return None
