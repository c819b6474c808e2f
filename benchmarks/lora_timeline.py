"""Where one LoRA linear's time goes: each part alone in a CUDA graph, then the kernels of the
whole op as a graph replay runs them (``torch.profiler``), with their start and duration.

    python benchmarks/lora_timeline.py [--tokens 32] [--rank 16] [--adapters 16] [--widths 4096 ...]

The parts: the base GEMM, zeroing the shrink's workspace, the shrink, the expand (the per-token
one where ``bgmv.serves``, as ``lora_linear`` picks), and the op with the shrink
beside the GEMM (``overlap``) or after it (``serial``). Then what a kernel adds right after
the GEMM: an empty one, one that only reads and writes back ``y`` (the floor of any update
of ``y`` in place), and the expand. bf16, K = 4096; weights stay in L2 (the loop reads one
layer), so the GEMM is faster than in a model.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from torch.profiler import ProfilerActivity, profile

from fxlora.kernels import bgmv, sgmv
from fxlora.ops import batch_info
from fxlora.ops.lora_linear import lora_linear_triton


@triton.jit
def _empty_kernel(y_ptr):
    """Does nothing: what launching any kernel after the GEMM costs."""


@triton.jit
def _in_place_kernel(y_ptr, rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Reads one tile of ``y`` and writes it back, as an in-place update does, with no work."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    p = y_ptr + r[:, None] * cols + c[None, :]
    tl.store(p, tl.load(p, mask=mask), mask=mask)


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--widths", type=int, nargs="+", default=[4096], help="output slices sharing the input")
    parser.add_argument("--calls", type=int, default=3, help="ops captured in the profiled graph")
    args = parser.parse_args()
    tokens, rank, adapters, widths = args.tokens, args.rank, args.adapters, tuple(args.widths)
    slices, k = len(widths), 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    x, w = rnd(tokens, k), rnd(sum(widths), k) / k**0.5
    a, b = rnd(adapters, slices * rank, k) / k**0.5, rnd(adapters, sum(widths), rank) / rank**0.5
    scaling = torch.ones(adapters * slices, device="cuda")
    ranks = torch.full((adapters * slices,), rank, dtype=torch.int32, device="cuda")
    slot_ids = (torch.arange(tokens, device="cuda") % adapters).int()
    slot_ids = slot_ids[torch.randperm(tokens, device="cuda", generator=gen)]
    token_slot, order, start, length, seg_slot = meta = batch_info(slot_ids, x, 1, adapters)
    ws = torch.empty(tokens, slices * rank, device="cuda")
    sliced = widths if slices > 1 else None
    y = F.linear(x, w)
    shrink_config = sgmv.shrink_config(tokens, k, slices * rank, slices, x.device)  # as the op picks it: one GEMM

    def op(overlap=True):
        return lora_linear_triton(x, w, None, [a, b, scaling, ranks], meta, ws, overlap=overlap, slice_widths=sliced)

    def expand(y=y):
        if bgmv.serves(tokens, rank, x.device):
            bgmv.lora_expand(y, ws, b, scaling, ranks, token_slot, sliced)
        else:
            sgmv.lora_expand(y, ws, b, scaling, ranks, order, start, length, seg_slot, sliced)

    parts = {
        "gemm": lambda: F.linear(x, w),
        "zero": ws.zero_,
        "shrink": lambda: sgmv.lora_shrink(x, a, ranks, order, start, length, seg_slot, slices, shrink_config, out=ws),
        "expand": expand,
        "overlap": op,
        "serial": lambda: op(False),
    }
    print(
        f"tokens={tokens} rank={rank} adapters={adapters} widths={widths}, graph us: "
        + "  ".join(f"{name} {graph_us(fn):.1f}" for name, fn in parts.items())
    )
    tiles = (triton.cdiv(tokens, 16), triton.cdiv(y.shape[1], 128))
    after = {
        "nothing": lambda y: None,
        "empty kernel": lambda y: _empty_kernel[tiles](y),
        "y read and written back": lambda y: _in_place_kernel[tiles](y, *y.shape, BLOCK_M=16, BLOCK_N=128),
        "expand": expand,
    }
    rounds = [{name: graph_us(lambda k=k: k(F.linear(x, w))) for name, k in after.items()} for _ in range(3)]
    gemm_then = {name: statistics.median(r[name] for r in rounds) for name in after}  # alternating: the GEMM drifts
    print(
        "added right after the GEMM, graph us: "
        + "  ".join(f"{name} {t - gemm_then['nothing']:+.2f}" for name, t in gemm_then.items() if name != "nothing")
    )

    # warm up on a side stream, as graph capture wants, then capture a few calls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.calls):
            op()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    if not kernels:
        print("the profiler recorded no kernels of the graph replay")
        return
    t0 = kernels[0].time_range.start
    print("  start us  duration us  kernel")
    for e in kernels:
        print(f"  {e.time_range.start - t0:8.2f}  {e.time_range.elapsed_us():11.2f}  {e.name[:80]}")


if __name__ == "__main__":
    main()
