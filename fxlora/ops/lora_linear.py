"""``fxlora::lora_linear``: a linear layer plus each token's own LoRA delta.

``y = F.linear(x, weight, bias)``, then for every token ``t`` with slot ``s >= 0``:
``y[t] += scaling[s] * (x[t] @ lora_a[s, :rank[s]].T) @ lora_b[s, :, :rank[s]].T``.
The delta is added in place into the base output. Tokens without an adapter, and slots
that do not touch this module (rank 0), cost nothing.

On CUDA the base GEMM stays ``F.linear`` (cuBLAS) and the delta comes from the Triton SGMV
kernels (:mod:`fxlora.kernels.sgmv`; for a handful of tokens the expand of
:mod:`fxlora.kernels.bgmv`), launched by :func:`fxlora.ops.delta_launcher.with_lora_delta`;
elsewhere from :func:`fxlora.ops.lora_delta.lora_delta_reference`.

``fxlora::lora_linear_fused`` serves several linears that read the same input (q, k and v;
gate and up): each member keeps its own GEMM and output, and its factors are one slice of
the kernels' multi-slice layout, so one shrink and one expand serve them all.

``fxlora::lora_linear_beside`` serves the same members in code captured in CUDA graphs: it
returns their base outputs and, apart, their delta (zero for tokens without an adapter), which
the graph adds onto each output where it is next read (Inductor fuses the add into that
kernel). The shrink and the expand both run on the side stream beside the GEMMs, so the main
stream carries no LoRA kernel; in place, the expand must follow the GEMM there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxlora.kernels import sgmv
from fxlora.ops.delta_launcher import delta_beside, lora_workspace, with_lora_delta
from fxlora.ops.lora_delta import lora_delta_reference, sliced_delta_reference
from fxlora.ops.operands import BatchInfo, LoraWeights


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` over ``x``'s rows as one 2-D GEMM. ``aten.matmul`` folds a 3-D input into
    rows only when its strides say so dimension by dimension, and Inductor may hand the ops
    ``(tokens, 1, hidden)`` with any stride on the size-1 dimension: matmul then runs a bmm
    over the weight expanded once per token (20x the GEMM's time at 128 tokens). ``reshape``
    is a view there, and copies ``x`` once where rows are truly strided."""
    y = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def _each_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Every member's own ``F.linear`` of ``x``."""
    return [_linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


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
    (:class:`BatchInfo`); ``workspace`` (from :func:`fxlora.ops.delta_launcher.lora_workspace`) is scratch the CUDA
    kernel writes the shrink result into."""
    weights, info = LoraWeights(*lora), BatchInfo(*batch)
    y = _linear(x, weight, bias)
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
    """The CUDA implementation: the SGMV kernels of :mod:`fxlora.kernels.sgmv`, with the
    per-token expand of :mod:`fxlora.kernels.bgmv` for few tokens (``bgmv.serves``). With
    ``overlap``, while a CUDA graph is captured, the shrink (which reads only ``x``) runs on a
    side stream beside the base GEMM: the fork and join become parallel branches of the graph,
    so the shrink's time hides behind the GEMM (called eagerly the op stays on one stream, see
    :func:`with_lora_delta`). ``slice_widths``: several output slices sharing one input, each
    with its own factors (the kernels' multi-slice layout)."""
    base = lambda: _linear(x, weight, bias)  # noqa: E731
    weights, info = LoraWeights(*lora), BatchInfo(*batch)
    return with_lora_delta(x, base, weights, info, workspace, overlap, slice_widths, one_gemm=True)


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
    ys = _each_linear(x, weights, biases)
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
    base = lambda: _each_linear(x, weights, biases)  # noqa: E731
    widths = tuple(w.shape[0] for w in weights)
    factors, info = LoraWeights(*lora), BatchInfo(*batch)
    workspace = lora_workspace(x, factors.lora_a)
    return with_lora_delta(x, base, factors, info, workspace, overlap, widths, one_gemm=False)


@torch.library.custom_op("fxlora::lora_linear_beside", mutates_args=())
def lora_linear_beside(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``[F.linear(x, weights[i], biases[i]) ...]``, then, last, the members' LoRA delta
    ``(..., sum of their widths)`` in their dtype: member ``i``'s columns in the multi-slice
    layout's order, zero for tokens without an adapter. ``lora_linear_fused``'s outputs are
    each member's output plus its columns of the delta."""
    ys = _each_linear(x, weights, biases)
    delta = x.new_zeros((*x.shape[:-1], sum(y.shape[-1] for y in ys)), dtype=ys[0].dtype)
    columns = list(delta.view(-1, delta.shape[-1]).split([y.shape[-1] for y in ys], -1))
    sliced_delta_reference(columns, x.reshape(-1, x.shape[-1]), LoraWeights(*lora), BatchInfo(*batch).token_slot)
    return [*ys, delta]


def lora_linear_beside_triton(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    lora: list[torch.Tensor],
    batch: list[torch.Tensor],
    overlap: bool = True,
) -> list[torch.Tensor]:
    """Every member's GEMM; the delta's shrink and expand on the side stream beside them while
    a CUDA graph is captured (``overlap``), joined before the op returns."""
    base = lambda: _each_linear(x, weights, biases)  # noqa: E731
    widths = tuple(w.shape[0] for w in weights)
    factors, info = LoraWeights(*lora), BatchInfo(*batch)
    delta = torch.empty((*x.shape[:-1], sum(widths)), dtype=torch.promote_types(x.dtype, weights[0].dtype), device=x.device)
    ys = delta_beside(x, base, factors, info, lora_workspace(x, factors.lora_a), delta, widths, overlap)
    return [*ys, delta]


if sgmv is not None:
    lora_linear.register_kernel("cuda")(lora_linear_triton)
    lora_linear_fused.register_kernel("cuda")(lora_linear_fused_triton)
    lora_linear_beside.register_kernel("cuda")(lora_linear_beside_triton)


@lora_linear.register_fake
def _(x, weight, bias, lora, batch, workspace):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.promote_types(x.dtype, weight.dtype))


@lora_linear_fused.register_fake
def _(x, weights, biases, lora, batch):
    return [x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.promote_types(x.dtype, w.dtype)) for w in weights]


@lora_linear_beside.register_fake
def _(x, weights, biases, lora, batch):
    dtype = torch.promote_types(x.dtype, weights[0].dtype)
    ys = [x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.promote_types(x.dtype, w.dtype)) for w in weights]
    return [*ys, x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)), dtype=dtype)]
