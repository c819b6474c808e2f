"""``fxlora::lora_linear``: a linear layer plus each token's own LoRA delta.

``y = F.linear(x, weight, bias)``, then for every token ``t`` with slot ``s >= 0``:
``y[t] += scaling[s] * (x[t] @ lora_a[s, :rank[s]].T) @ lora_b[s, :, :rank[s]].T``.
The delta is added in place into the base output. Tokens without an adapter, and slots
that do not touch this module (rank 0), cost nothing.

On CUDA the base GEMM stays ``F.linear`` (cuBLAS) and the delta comes from the Triton SGMV
kernels (:mod:`fxlora.ops.triton.sgmv`; for a handful of tokens the expand of
:mod:`fxlora.ops.triton.bgmv`); elsewhere from :func:`lora_delta_reference`.

``fxlora::lora_linear_fused`` serves several linears that read the same input (q, k and v;
gate and up): each member keeps its own GEMM and output, and its factors are one slice of
the kernels' multi-slice layout, so one shrink and one expand serve them all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fxlora.ops.batch_info import slot_groups
from fxlora.ops.operands import BatchInfo, LoraWeights
from fxlora.ops.triton import bgmv, sgmv


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


def lora_workspace(x: torch.Tensor, lora_a: torch.Tensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Scratch for the CUDA kernel's shrink result, ``(tokens, lora_a.shape[1])`` float32. A
    graph allocates it as its own node, so the ``hoist`` pass can place it in the arena."""
    tokens = x.numel() // x.shape[-1]
    return torch.empty((tokens, lora_a.shape[1]), dtype=torch.float32, device=device or x.device)


@torch.library.custom_op("fxlora::lora_linear", mutates_args=("workspace",))
def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
    workspace: torch.Tensor,
) -> torch.Tensor:
    """``lora``: the factors (:class:`LoraWeights`); ``batch``: the tokens' metadata
    (:class:`BatchInfo`); ``workspace`` (from :func:`lora_workspace`) is scratch the CUDA
    kernel writes the shrink result into."""
    weights, info = LoraWeights(*lora), BatchInfo(*batch)
    y = F.linear(x, weight, bias)
    lora_delta_reference(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), weights, info.token_slot)
    return y


def lora_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
    workspace: torch.Tensor,
    overlap: bool = True,
    slice_widths: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The CUDA implementation: the SGMV kernels of :mod:`fxlora.ops.triton.sgmv`, with the
    per-token expand of :mod:`fxlora.ops.triton.bgmv` for few tokens (``bgmv.serves``). With
    ``overlap`` the shrink (which reads only ``x``) runs on a side stream beside the base GEMM;
    under CUDA-graph capture the fork and join become parallel branches of the graph, so the
    shrink's time hides behind the GEMM. ``slice_widths``: several output slices sharing one
    input, each with its own factors (the kernels' multi-slice layout)."""
    base = lambda: F.linear(x, weight, bias)  # noqa: E731
    weights, info = LoraWeights(*lora), BatchInfo(*batch)
    return _with_lora_delta(x, base, weights, info, workspace, overlap, slice_widths, one_gemm=True)


def _with_lora_delta(
    x: torch.Tensor,
    base: Callable[[], torch.Tensor | list[torch.Tensor]],
    weights: LoraWeights,
    info: BatchInfo,
    workspace: torch.Tensor,
    overlap: bool,
    slice_widths: tuple[int, ...] | None,
    one_gemm: bool,
) -> torch.Tensor | list[torch.Tensor]:
    """``base()`` (the GEMM: one output, or one per slice) with the LoRA delta added in place
    into its output(s); ``one_gemm``: whether ``base`` is one GEMM launch for all slices."""
    lora_a, lora_b, scaling, rank = weights
    x2 = x.reshape(-1, x.shape[-1]).to(lora_a.dtype)
    slices = len(slice_widths or (None,))
    config = sgmv.shrink_config(x2.shape[0], x2.shape[1], lora_a.shape[1], slices if one_gemm else 1, x.device)
    shrink = lambda: sgmv.lora_shrink(x2, lora_a, rank, *info.segments, slices, config, out=workspace)  # noqa: E731
    if bgmv.serves(x2.shape[0], lora_b.shape[-1], x.device):
        expand = lambda y, v: bgmv.lora_expand(y, v, lora_b, scaling, rank, info.token_slot, slice_widths)  # noqa: E731
    else:
        expand = lambda y, v: sgmv.lora_expand(y, v, lora_b, scaling, rank, *info.segments, slice_widths)  # noqa: E731
    if overlap:  # the GEMM is issued first, the shrink forked from the point before it
        main, side = torch.cuda.current_stream(), _side_stream(x.device)
        inputs_ready = torch.cuda.Event()
        inputs_ready.record(main)
        y = base()
        side.wait_event(inputs_ready)
        with torch.cuda.stream(side):
            v = shrink()
        main.wait_stream(side)
        v.record_stream(main)
    else:
        v = shrink()
        y = base()
    rows = lambda t: t.view(-1, t.shape[-1])  # noqa: E731
    expand(rows(y) if isinstance(y, torch.Tensor) else [rows(t) for t in y], v)
    return y


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


@torch.library.custom_op("fxlora::lora_linear_fused", mutates_args=())
def lora_linear_fused(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``[lora_linear(x, weights[i], biases[i], <member i's factors>, batch) ...]``: each
    member's own ``F.linear``, its factors a slice of the multi-slice layout
    (:func:`sliced_delta_reference`). The shrink's scratch is allocated inside: a
    functionalised graph (Inductor's) can hold an op that mutates an input only when it
    returns single tensors, not a list."""
    ys = [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    rows = [y.view(-1, y.shape[-1]) for y in ys]
    sliced_delta_reference(rows, x.reshape(-1, x.shape[-1]), LoraWeights(*lora), BatchInfo(*batch).token_slot)
    return ys


def lora_linear_fused_triton(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
    overlap: bool = True,
) -> list[torch.Tensor]:
    """Every member's GEMM, then one shrink and one expand that update all their outputs
    (``overlap`` as in :func:`lora_linear_triton`)."""
    base = lambda: [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]  # noqa: E731
    widths = tuple(w.shape[0] for w in weights)
    factors, info = LoraWeights(*lora), BatchInfo(*batch)
    workspace = lora_workspace(x, factors.lora_a)
    return _with_lora_delta(x, base, factors, info, workspace, overlap, widths, one_gemm=False)


if sgmv is not None:
    lora_linear.register_kernel("cuda")(lora_linear_triton)
    lora_linear_fused.register_kernel("cuda")(lora_linear_fused_triton)


@lora_linear.register_fake
def _(x, weight, bias, lora, batch, workspace):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.promote_types(x.dtype, weight.dtype))


@lora_linear_fused.register_fake
def _(x, weights, biases, lora, batch):
    return [x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.promote_types(x.dtype, w.dtype)) for w in weights]
