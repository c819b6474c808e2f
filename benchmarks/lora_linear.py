"""Multi-adapter LoRA linear: fxlora's kernels against the base GEMM, a PyTorch gather-bmm,
a PEFT-style per-adapter loop and the bytes-moved floor, side by side in one process.

    python benchmarks/lora_linear.py [--out results.json] [--quick] [--shape NAME ...]

For every shape: tokens x (in -> out slices) x rank x distinct adapters, bf16, the adapters
in a pool of as many slots (and at decode sizes also in a pool of 256 slots). Times are
medians in microseconds, inside CUDA graphs (launch gaps removed) and eagerly. The floor is
the bytes the LoRA delta must move (each used adapter's A and B once, x read once, y read
and written once) at the device-to-device copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from dataclasses import asdict, dataclass

import torch
import triton
import triton.testing

from fxlora.ops import batch_info
from fxlora.ops.lora_linear import lora_linear_triton

DTYPE = torch.bfloat16
COLD_TOKENS, COLD_BYTES = 256, 200 << 20  # H100 L2: 50 MB
SHAPES = {"4096x4096": (4096, (4096,)), "qkv 4096->4096+1024+1024": (4096, (4096, 1024, 1024))}


@dataclass
class Row:
    shape: str
    tokens: int
    rank: int
    adapters: int  # distinct adapters in the batch
    pool: int  # slots of the pool they are loaded in
    base_graph: float
    fxlora_graph: float
    fxlora_serial_graph: float
    gather_bmm_graph: float
    base_eager: float
    fxlora_eager: float
    peft_loop_eager: float
    floor_delta: float
    base_cold_graph: float | None  # weights not in L2 (up to COLD_TOKENS tokens)
    fxlora_cold_graph: float | None

    @property
    def delta_over_base(self) -> float:
        return (self.fxlora_graph - self.base_graph) / self.base_graph

    @property
    def cold_delta_over_base(self) -> float | None:
        if self.base_cold_graph is None:
            return None
        return (self.fxlora_cold_graph - self.base_cold_graph) / self.base_cold_graph

    @property
    def loop_over_fxlora(self) -> float:
        return self.peft_loop_eager / self.fxlora_eager

    @property
    def delta_over_floor(self) -> float:
        return (self.fxlora_graph - self.base_graph) / self.floor_delta


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, reads plus writes."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def paired_graph_us(first, second, rounds: int = 3) -> tuple[float, float]:
    """Graph times of two functions measured alternately, median of ``rounds`` each: a GEMM's
    graph time drifts by a few percent between measurements, as much as a small delta."""
    times = [(graph_us(first), graph_us(second)) for _ in range(rounds)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def eager_us(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def run_case(shape: str, tokens: int, rank: int, adapters: int, bandwidth: float, pool: int | None = None) -> Row:
    """``pool``: the slots the adapters are loaded in (default: as many as ``adapters``); the
    batch's adapters are spread over it."""
    pool = pool or adapters
    d_in, widths = SHAPES[shape]
    d_out, slices = sum(widths), len(widths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(DTYPE)  # noqa: E731

    def operands():  # x, the base weight, A and B
        return (
            rnd(tokens, d_in), rnd(d_out, d_in) / d_in**0.5,
            rnd(pool, slices * rank, d_in) / d_in**0.5, rnd(pool, d_out, rank) / rank**0.5,
        )

    x, w, a, b = operands()
    scaling = torch.ones(pool * slices, device="cuda")
    ranks = torch.full((pool * slices,), rank, dtype=torch.int32, device="cuda")
    used = range(0, adapters * (pool // adapters), pool // adapters)  # the slots the batch reads
    slot_ids = torch.tensor(used, dtype=torch.int32, device="cuda").repeat(-(-tokens // adapters))[:tokens]
    slot_ids = slot_ids[torch.randperm(tokens, device="cuda", generator=gen)]
    meta = batch_info(slot_ids, x, 1, pool)

    def base():
        return torch.nn.functional.linear(x, w)

    workspace = torch.empty(tokens, slices * rank, device="cuda")

    def fxlora(overlap=True, x=x, w=w, a=a, b=b):
        return lora_linear_triton(x, w, None, [a, b, scaling, ranks], meta, workspace, overlap=overlap, slice_widths=widths)

    # Cold: in a model every layer reads its weights from memory, not from L2 as a loop over one
    # layer does. Cycle through copies of the operands that together overflow L2.
    cold_base = cold_fxlora = None
    if tokens <= COLD_TOKENS:
        copies = [operands() for _ in range(-(-COLD_BYTES // (w.numel() * w.element_size())))]
        cold_base = graph_us(lambda: [torch.nn.functional.linear(c[0], c[1]) for c in copies]) / len(copies)
        cold_fxlora = graph_us(lambda: [fxlora(True, *c) for c in copies]) / len(copies)
        del copies

    # block-diagonal B per slice folded into one (out, slices*rank) matrix for the references
    b_full = torch.zeros(pool, d_out, slices * rank, device="cuda", dtype=DTYPE)
    col = 0
    for i, width in enumerate(widths):
        b_full[:, col : col + width, i * rank : (i + 1) * rank] = b[:, col : col + width]
        col += width
    slot_long = slot_ids.long()

    def gather_bmm():
        y = torch.nn.functional.linear(x, w)
        v = torch.bmm(a[slot_long], x.unsqueeze(-1))  # (T, slices*r, 1)
        return y + torch.bmm(b_full[slot_long], v).squeeze(-1)

    def peft_loop():
        y = torch.nn.functional.linear(x, w)
        for s in used:
            idx = (slot_long == s).nonzero().squeeze(1)
            if idx.numel():
                y.index_add_(0, idx, (x[idx] @ a[s].T) @ b_full[s].T)
        return y

    torch.testing.assert_close(fxlora().float(), gather_bmm().float(), rtol=2e-2, atol=2e-2)
    element = x.element_size()
    floor_bytes = adapters * slices * rank * d_in * element + adapters * d_out * rank * element
    floor_bytes += tokens * d_in * element + 2 * tokens * d_out * element
    base_graph, fxlora_graph = paired_graph_us(base, fxlora)
    return Row(
        shape, tokens, rank, adapters, pool,
        base_graph=base_graph, fxlora_graph=fxlora_graph, fxlora_serial_graph=graph_us(lambda: fxlora(False)),
        gather_bmm_graph=graph_us(gather_bmm), base_cold_graph=cold_base, fxlora_cold_graph=cold_fxlora,
        base_eager=eager_us(base), fxlora_eager=eager_us(fxlora), peft_loop_eager=eager_us(peft_loop),
        floor_delta=floor_bytes / bandwidth * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="a few token counts only")
    parser.add_argument("--shape", choices=SHAPES, action="append", help="only these shapes (repeatable)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    tokens_list = [1, 8, 32, 64, 256, 2048] if not args.quick else [1, 32, 2048]
    rows = []
    for shape in args.shape or SHAPES:
        for tokens in tokens_list:
            for rank in (16, 64):
                for adapters in sorted({1, 4, 16, tokens}):
                    if adapters > tokens and adapters != 1:
                        continue
                    rows.append(run_case(shape, tokens, rank, adapters, bandwidth))
                    torch.cuda.empty_cache()
            if 8 <= tokens <= 64:  # a pool far larger than the batch uses
                rows.append(run_case(shape, tokens, 16, min(16, tokens), bandwidth, pool=256))
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_bandwidth_GBps": bandwidth / 1e9,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(json.dumps(env))
    head = (
        f"{'shape':<26}{'T':>5}{'r':>4}{'ad':>5}{'pool':>5} | {'base':>7}{'fxlora':>8}{'serial':>8}{'bmm':>8} graph us | "
        f"{'+delta':>7} {'floor':>6} {'x floor':>7} | {'fx eager':>8}{'loop':>8} {'loop/fx':>7} | {'+delta cold':>11}"
    )
    print(head)
    for r in rows:
        print(
            f"{r.shape:<26}{r.tokens:>5}{r.rank:>4}{r.adapters:>5}{r.pool:>5} | {r.base_graph:>7.1f}{r.fxlora_graph:>8.1f}{r.fxlora_serial_graph:>8.1f}"
            f"{r.gather_bmm_graph:>8.1f}          | {r.delta_over_base:>7.1%} {r.floor_delta:>6.1f} "
            f"{r.delta_over_floor:>7.2f} | {r.fxlora_eager:>8.1f}{r.peft_loop_eager:>8.1f} {r.loop_over_fxlora:>7.1f} | "
            + ("" if r.cold_delta_over_base is None else f"{r.cold_delta_over_base:>11.1%}")
        )


if __name__ == "__main__":
    main()
