"""``fxlora::lora_delta``: each token's own LoRA delta, added in place onto outputs that some
base computation already wrote.

For every token ``t`` with slot ``s >= 0``:
``y[t] += scaling[s] * (x[t] @ lora_a[s, :rank[s]].T) @ lora_b[s, :, :rank[s]].T``. The op
leaves the base alone, whatever computed ``y`` (``input @ weight.T``, a quantised matmul, a
tensor-subclass weight): tokens without an adapter, and slots of rank 0, keep their values
bit for bit. Several outputs that read one input (the multi-slice layout) take one call.

With ``shrunk``, ``fxlora::lora_shrink`` (issued before the base) has written the shrink, and
the op only expands it.

This file also holds what every linear LoRA op shares: the reference delta (PEFT's
operations, one slot at a time), the shrink's workspace, :func:`with_lora_delta`, which
launches the Triton SGMV / BGMV kernels around a base computation on CUDA, its shrink and
expand halves, and the side stream a shrink forks onto under CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

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


def with_lora_delta(
    x: torch.Tensor,
    base: Callable[[], torch.Tensor | list[torch.Tensor]],
    weights: LoraWeights,
    info: BatchInfo,
    workspace: torch.Tensor,
    overlap: bool,
    slice_widths: tuple[int, ...] | None,
    one_gemm: bool,
) -> torch.Tensor | list[torch.Tensor]:
    """``base()`` (one output, or one per slice) with the LoRA delta added in place into its
    output(s) by the Triton kernels; ``one_gemm``: whether ``base`` is one GEMM launch for all
    slices. With ``overlap``, while a CUDA graph is captured, the shrink (which reads only
    ``x``) runs on a side stream beside ``base``, which is issued first. Outside a capture the
    fork and join cost the host more than the overlap saves on the GPU (an op called eagerly,
    as in a prefill, is bound by its host time up to thousands of tokens)."""
    x2 = kernel_rows(x, weights)
    slices = len(slice_widths or (None,))
    shrink = lambda: shrink_into(workspace, x2, weights, info, slices, slices if one_gemm else 1)  # noqa: E731
    if overlap and capturing(x):  # the GEMM first, the shrink forked
        inputs_ready = fork(x.device)
        y = base()
        with on_side_stream(x.device, inputs_ready):
            v = shrink()
        join(x.device)  # everything after, on main, follows the shrink
    else:
        v = shrink()
        y = base()
    rows = lambda t: t.view(-1, t.shape[-1])  # noqa: E731
    expand_onto(rows(y) if isinstance(y, torch.Tensor) else [rows(t) for t in y], v, weights, info, slice_widths)
    return y


def kernel_rows(x: torch.Tensor, weights: LoraWeights) -> torch.Tensor:
    """``x`` as the shrink reads it: ``(T, in)`` rows in the factors' dtype."""
    return x.reshape(-1, x.shape[-1]).to(weights.lora_a.dtype)


def shrink_into(
    workspace: torch.Tensor, x2: torch.Tensor, weights: LoraWeights, info: BatchInfo, slices: int, gemm_slices: int
) -> torch.Tensor:
    """The SGMV shrink of rows ``x2`` into ``workspace``; ``gemm_slices`` as
    :func:`fxlora.ops.triton.launch_table.shrink_config` takes it."""
    config = sgmv.shrink_config(x2.shape[0], x2.shape[1], weights.lora_a.shape[1], gemm_slices, x2.device)
    return sgmv.lora_shrink(x2, weights.lora_a, weights.rank, *info.segments, slices, config, out=workspace)


def expand_onto(
    ys: torch.Tensor | list[torch.Tensor], v: torch.Tensor, weights: LoraWeights, info: BatchInfo, slice_widths: tuple[int, ...] | None
) -> None:
    """The expand of the shrink's result ``v`` onto rows ``ys``: per token (BGMV) for a
    handful of tokens, else by segments (SGMV)."""
    _, lora_b, scaling, rank = weights
    if bgmv.serves(v.shape[0], lora_b.shape[-1], v.device):
        bgmv.lora_expand(ys, v, lora_b, scaling, rank, info.token_slot, slice_widths)
    else:
        sgmv.lora_expand(ys, v, lora_b, scaling, rank, *info.segments, slice_widths)


def capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s kernels are being captured into a CUDA graph (where a fork onto the
    side stream becomes a parallel branch of the graph)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def fork(device: torch.device) -> torch.cuda.Event:
    """An event on ``device``'s current stream that the side stream's next work waits for."""
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    return ready


@contextlib.contextmanager
def on_side_stream(device: torch.device, ready: torch.cuda.Event) -> Iterator[None]:
    """Issue the block's kernels on ``device``'s side stream, after ``ready``."""
    side = _side_stream(device)
    side.wait_event(ready)
    with torch.cuda.stream(side):
        yield


def join(device: torch.device) -> None:
    """The current stream's later work follows everything issued to the side stream."""
    torch.cuda.current_stream(device).wait_stream(_side_stream(device))


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


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
    (:class:`BatchInfo`); ``workspace`` (from :func:`lora_workspace`): the CUDA kernel's
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
