"""The CUDA dispatch every linear LoRA op shares: the LoRA delta's two kernels launched around
a base computation.

:func:`with_lora_delta` runs a base (one GEMM, or one per output slice) and adds each token's
delta onto its output(s): the SGMV shrink (:mod:`fxlora.kernels.sgmv`) into a float32
workspace (:func:`lora_workspace`), then the expand, per token for a handful of tokens
(:mod:`fxlora.kernels.bgmv`), else by segments. While a CUDA graph is captured the shrink,
which reads only the input, may fork onto a side stream beside the base and join before the
expand. ``fxlora::lora_linear``, ``lora_linear_fused``, ``lora_delta`` and ``lora_shrink``
register their CUDA implementations over these; :func:`delta_beside` writes the delta into a
tensor of its own, wholly beside the base (``lora_linear_beside``). This module defines no op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fxlora.kernels import bgmv, sgmv
from fxlora.ops.operands import BatchInfo, LoraWeights


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
    y, v = beside_base(x, base, shrink, overlap)
    rows = lambda t: t.view(-1, t.shape[-1])  # noqa: E731
    expand_onto(rows(y) if isinstance(y, torch.Tensor) else [rows(t) for t in y], v, weights, info, slice_widths)
    return y


def delta_beside(
    x: torch.Tensor,
    base: Callable[[], list[torch.Tensor]],
    weights: LoraWeights,
    info: BatchInfo,
    workspace: torch.Tensor,
    delta: torch.Tensor,
    widths: tuple[int, ...],
    overlap: bool,
) -> list[torch.Tensor]:
    """``base()`` (one output per slice), and the delta of every slice written into ``delta``
    (``(..., sum(widths))``, zero for tokens without an adapter) instead of added onto them:
    the expand stores every element of it, so ``delta`` may hold anything before. With
    ``overlap``, while a CUDA graph is captured, the delta (shrink and expand) runs on the
    side stream beside ``base`` and joins before this returns. ``delta`` and ``workspace`` are
    allocated before the fork, so no work of the main stream still reads their memory when the
    side stream writes it."""
    x2 = kernel_rows(x, weights)
    rows = delta.view(-1, delta.shape[-1])

    def make() -> None:
        v = shrink_into(workspace, x2, weights, info, len(widths), 1)
        expand_onto(rows, v, weights, info, widths if len(widths) > 1 else None, store=True)

    ys, _ = beside_base(x, base, make, overlap)
    return ys


def beside_base(x: torch.Tensor, base: Callable[[], Any], work: Callable[[], Any], overlap: bool) -> tuple[Any, Any]:
    """``(base(), work())``. With ``overlap``, while a CUDA graph is captured, ``base`` is
    issued first and ``work`` (which reads only what was ready before ``base``) forks onto the
    side stream beside it, joined before this returns: everything after follows both.
    Eagerly both run on the current stream, ``work`` first."""
    if overlap and capturing(x):
        inputs_ready = fork(x.device)
        out = base()
        with on_side_stream(x.device, inputs_ready):
            done = work()
        join(x.device)
        return out, done
    done = work()
    return base(), done


def kernel_rows(x: torch.Tensor, weights: LoraWeights) -> torch.Tensor:
    """``x`` as the shrink reads it: ``(T, in)`` rows in the factors' dtype."""
    return x.reshape(-1, x.shape[-1]).to(weights.lora_a.dtype)


def shrink_into(
    workspace: torch.Tensor, x2: torch.Tensor, weights: LoraWeights, info: BatchInfo, slices: int, gemm_slices: int
) -> torch.Tensor:
    """The SGMV shrink of rows ``x2`` into ``workspace``; ``gemm_slices`` as
    :func:`fxlora.kernels.launch_table.shrink_config` takes it."""
    tokens, segments = x2.shape[0], min(info.segments[2].numel(), x2.shape[0])  # the entries the launch may read
    config = sgmv.shrink_config(tokens, x2.shape[1], weights.lora_a.shape[1], gemm_slices, x2.device, segments)
    return sgmv.lora_shrink(x2, weights.lora_a, weights.rank, *info.segments, slices, config, out=workspace)


def expand_onto(
    ys: torch.Tensor | list[torch.Tensor],
    v: torch.Tensor,
    weights: LoraWeights,
    info: BatchInfo,
    slice_widths: tuple[int, ...] | None,
    store: bool = False,
) -> None:
    """The expand of the shrink's result ``v`` onto rows ``ys`` (``store``: into them, zeros
    where there is no delta): per token (BGMV) for a handful of tokens, else by segments
    (SGMV)."""
    _, lora_b, scaling, rank = weights
    if bgmv.serves(v.shape[0], lora_b.shape[-1], v.device):
        bgmv.lora_expand(ys, v, lora_b, scaling, rank, info.token_slot, slice_widths, store=store)
    else:
        sgmv.lora_expand(ys, v, lora_b, scaling, rank, *info.segments, slice_widths, store=store)


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


