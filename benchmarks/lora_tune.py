"""Sweep the LoRA kernels' launch parameters on a few shape classes and print the best.

    python benchmarks/lora_tune.py [sgmv] [bgmv] [switch] [in_context] [in_context_8b] [expand_in_context] [segmented_expand_in_context]
                                   [delta_beside] [experts]

Times each kernel alone inside a CUDA graph (median, microseconds), so the entries of the
launch table (``fxlora/kernels/launch_table.py``) for this device can be chosen from
measurements. ``switch`` times the whole op as ``lora_linear`` runs it on CUDA with
either family's expand, to place the token count where one hands over to the other;
``in_context`` the shrink's parameters inside that op, where it shares SMs with the GEMM
(``in_context_8b`` at the 8B model's linears, batch 32 and 128, one GEMM a slice as its projections run);
``expand_in_context`` the expands of both families right after the GEMM, at decode shapes;
``segmented_expand_in_context`` the segmented expand's parameters there, at the 8B model's
shapes, each layer's factors read from HBM as a model's are; ``delta_beside`` the whole linear
with the expand in place after the GEMM against the delta made wholly on the side stream into
a buffer of its own (zeroed first, or stored whole by the expand, as ``lora_linear_beside``
makes it) that the output's consumer adds (one pointwise kernel either way), at those shapes.
``experts`` the segmented kernels at an MoE block's token–expert pairs (the Qwen3-MoE-shaped
model's, 16 slots of 64 experts read as 1,024 adapters: a segment per pair or two), the
table's choice against decode-style parameters.
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton.testing

from fxlora.kernels import bgmv, sgmv
from fxlora.ops import batch_info

SGMV_CASES = [  # (tokens, K, slice widths, rank, adapters)
    (256, 4096, (4096,), 16, 16),
    (256, 4096, (4096,), 64, 16),
    (2048, 4096, (4096,), 16, 1),
    (2048, 4096, (4096,), 16, 16),
    (2048, 4096, (4096,), 64, 16),
    (2048, 4096, (4096, 1024, 1024), 16, 16),
    (2048, 4096, (4096, 1024, 1024), 64, 16),
]
BGMV_CASES = [
    (1, 4096, (4096,), 16, 1),
    (4, 4096, (4096,), 64, 4),
    (8, 4096, (4096,), 16, 4),
    (8, 4096, (4096, 1024, 1024), 16, 8),
]


def us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def case(tokens, k, widths, rank, adapters):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    slices = len(widths)
    x, y = rnd(tokens, k), rnd(tokens, sum(widths))
    a, b = rnd(adapters, slices * rank, k), rnd(adapters, sum(widths), rank)
    scaling = torch.ones(adapters * slices, device="cuda")
    ranks = torch.full((adapters * slices,), rank, dtype=torch.int32, device="cuda")
    slot_ids = (torch.arange(tokens, device="cuda") % adapters).int()
    slot_ids = slot_ids[torch.randperm(tokens, device="cuda", generator=gen)]
    meta = batch_info(slot_ids, x, 1, adapters)
    v = torch.randn(tokens, slices * rank, device="cuda")
    return x, y, a, b, scaling, ranks, meta, v


def best(label, runs, per: int = 1) -> None:
    """``per``: calls of the op inside each timed function (times are divided by it)."""
    times = []
    for cfg, fn in runs:
        try:
            fn()
            times.append((us(fn) / per, cfg))
        except Exception as e:  # out of resources for this config
            print("  skip", cfg, type(e).__name__)
    times.sort(key=lambda p: p[0])
    print(f"  {label} best:", ", ".join(f"{t:.1f}us {c}" for t, c in times[:4]), flush=True)


def tune_sgmv() -> None:
    for c in SGMV_CASES:
        sgmv_case(*c)


def tune_bgmv() -> None:
    for c in BGMV_CASES:
        bgmv_case(*c)


def sgmv_case(tokens, k, widths, rank, adapters) -> None:
    x, y, a, b, scaling, ranks, (_, order, start, length, seg_slot), v = case(tokens, k, widths, rank, adapters)
    slices, ranks_cols = len(widths), a.shape[1]
    print(f"sgmv T={tokens} K={k} widths={widths} r={rank} adapters={adapters}")
    print(
        "  default",
        sgmv.shrink_config(tokens, k, ranks_cols, device=x.device),
        sgmv.expand_config(tokens, rank, adapters, slices, max(widths), device=x.device),
    )
    shrink = [
        (cfg, lambda cfg=cfg: sgmv.lora_shrink(x, a, ranks, order, start, length, seg_slot, slices, config=cfg))
        for bm, bk, split, warps, br in itertools.product((16, 32, 64), (64, 128), (1, 2, 4, 8, 16), (2, 4, 8), (64, 256))
        if bm <= max(16, tokens) and split * bk <= k and br <= max(64, ranks_cols)
        for cfg in [sgmv.ShrinkConfig(bm, bk, split, warps, br)]
    ]
    best("shrink", shrink)
    expand = [
        (cfg, lambda cfg=cfg: sgmv.lora_expand(y, v, b, scaling, ranks, order, start, length, seg_slot, widths, config=cfg))
        for bm, bn, (tiles, stages), warps in itertools.product(
            (16, 32, 64, 128), (64, 128, 256), ((1, 2), (4, 2), (4, 3), (8, 2), (16, 2)), (4, 8)
        )
        if bm <= max(16, tokens)
        for cfg in [sgmv.ExpandConfig(bm, bn, warps, tiles, stages)]
    ]
    best("expand", expand)


def bgmv_case(tokens, k, widths, rank, adapters) -> None:
    _, y, _, b, scaling, ranks, (slot, *_), v = case(tokens, k, widths, rank, adapters)
    print(f"bgmv T={tokens} widths={widths} r={rank} adapters={adapters}  default {bgmv.expand_config(tokens, y.device)}")
    expand = [
        (cfg, lambda cfg=cfg: bgmv.lora_expand(y, v, b, scaling, ranks, slot, widths, config=cfg))
        for bn, warps in itertools.product((32, 64, 128, 256, 512), (1, 2, 4, 8))
        for cfg in [bgmv.ExpandConfig(bn, warps)]
    ]
    best("expand", expand)


def switch() -> None:
    """The whole op (shrink beside the GEMM, then the expand) with either family's expand,
    around the token counts where one should hand over to the other."""
    for tokens, adapters, rank in itertools.product((1, 4, 8, 16, 32), (1, 4, 16), (16, 64)):
        if adapters <= tokens:
            switch_case(tokens, adapters, rank)


def in_context() -> None:
    """Shrink launch parameters (split, step, warps, stages, rank rows per program) timed inside
    the whole op, where the shrink shares SMs with the base GEMM (the isolated best crowds the
    GEMM's SMs), with the weights read from HBM as in a model: the op runs over copies of its
    operands that together overflow L2."""
    for tokens, rank, adapters, widths in [
        (1, 16, 1, (4096,)), (8, 16, 4, (4096,)), (8, 16, 8, (4096,)), (8, 64, 4, (4096,)), (32, 16, 1, (4096,)),
        (32, 16, 4, (4096,)), (32, 16, 16, (4096,)), (64, 16, 16, (4096,)), (32, 64, 4, (4096,)),
        (32, 64, 16, (4096,)), (64, 64, 4, (4096,)), (32, 16, 16, (4096, 1024, 1024)),
        (64, 16, 4, (4096, 1024, 1024)), (64, 16, 16, (4096, 1024, 1024)),
    ]:
        in_context_case(tokens, rank, adapters, widths)


def _op_parts(tokens, adapters, rank, widths=(4096,), k=4096):
    x, _, a, b, scaling, ranks, (slot, order, start, length, seg_slot), _ = case(tokens, k, widths, rank, adapters)
    w = torch.randn(sum(widths), k, device="cuda").bfloat16()
    ws = torch.empty(tokens, len(widths) * rank, device="cuda")
    side = torch.cuda.Stream()

    def op(shrink, expand, x=x, w=w, split=None):  # the stream order of lora_linear_triton
        """``split``: the slices' widths, for one GEMM a slice (the base's outputs a list)."""
        main, inputs_ready = torch.cuda.current_stream(), torch.cuda.Event()
        inputs_ready.record(main)
        y = torch.nn.functional.linear(x, w) if split is None else [torch.nn.functional.linear(x, p) for p in w.split(split)]
        side.wait_event(inputs_ready)
        with torch.cuda.stream(side):
            shrink()
        main.wait_stream(side)
        expand(y)

    return x, w, a, b, scaling, ranks, (slot, order, start, length, seg_slot), ws, op


def in_context_8b() -> None:
    """``in_context`` at the 8B model's linears (qkv, o, gate/up, down; 16 adapters of rank 16)
    at batch 32 and 128, over a narrower grid: at most 2 stages and 32 rank rows a program, at
    batch 32 at most 2 warps, and rows last there as the table's decode rows have them."""
    for tokens, warps in ((32, (1, 2)), (128, (1, 2, 4))):
        for widths, k in [((4096, 1024, 1024), 4096), ((4096,), 4096), ((14336, 14336), 4096), ((4096,), 14336)]:
            in_context_case(
                tokens, 16, 16, widths, k, one_gemm=False, warps=warps, stages=(1, 2), rank_rows=(16, 32), rows_last=tokens <= 64
            )


def in_context_case(
    tokens, rank, adapters, widths, k=4096, one_gemm=True, warps=(1, 2, 4), stages=(1, 2, 3), rank_rows=(16, 32, 64), rows_last=False
) -> None:
    """``one_gemm``: the base one GEMM for all slices (else one a slice, as the model's separate
    projections run)."""
    x, w, a, b, scaling, ranks, (slot, order, start, length, seg_slot), ws, op = _op_parts(tokens, adapters, rank, widths, k)
    slices = len(widths)
    copies = [(x.clone(), w.clone(), a.clone()) for _ in range(-(-(200 << 20) // w.nbytes))]
    sliced = widths if slices > 1 else None
    split = None if one_gemm or slices == 1 else widths
    if bgmv.serves(tokens, rank, x.device):
        expand = lambda y: bgmv.lora_expand(y, ws, b, scaling, ranks, slot, sliced)  # noqa: E731
    else:
        expand = lambda y: sgmv.lora_expand(y, ws, b, scaling, ranks, order, start, length, seg_slot, sliced)  # noqa: E731

    def cold(cfg):
        def run():
            for cx, cw, ca in copies:
                shrink = lambda: sgmv.lora_shrink(cx, ca, ranks, order, start, length, seg_slot, slices, cfg, out=ws)  # noqa: E731,B023
                op(shrink, expand, cx, cw, split)

        return run

    runs = [
        (cfg, cold(cfg))
        # split 1 stores its sums: no zeroed workspace, whose fill the other splits' times include
        for split_k, bk, warps, stages, br in itertools.product((1, 2, 4, 8, 16, 32), (128, 256), warps, stages, rank_rows)
        if split_k * bk <= k and br <= max(16, triton.next_power_of_2(slices * rank))  # rank rows per program
        for cfg in [sgmv.ShrinkConfig(16, bk, split_k, warps, block_r=br, num_stages=stages, rows_last=rows_last)]
    ]
    base = us(lambda: [torch.nn.functional.linear(cx, cw) for cx, cw, _ in copies]) / len(copies)
    table = sgmv.shrink_config(tokens, k, slices * rank, slices if one_gemm else 1, x.device)
    print(
        f"T={tokens} r={rank} adapters={adapters} widths={widths} K={k} base {base:.1f}us (per op, weights from HBM), "
        f"table's choice {us(cold(table)) / len(copies):.1f}us {table}"
    )
    best("shrink in context", runs, per=len(copies))


def expand_in_context() -> None:
    """Expand launch parameters timed right after the base GEMM whose output they update, the
    weights read from HBM (copies that overflow L2): the segmented expand as the table picks it
    against the per-token one's column widths and warps, at decode shapes."""
    for widths, tokens, adapters in itertools.product(((4096,), (4096, 1024, 1024)), (8, 32, 64), (4, 16)):
        expand_in_context_case(tokens, adapters, widths)


def expand_in_context_case(tokens, adapters, widths) -> None:
    x, w, _, b, scaling, ranks, (slot, order, start, length, seg_slot), _, _ = _op_parts(tokens, adapters, 16, widths)
    v = torch.randn(tokens, len(widths) * 16, device="cuda")
    copies = [(x.clone(), w.clone()) for _ in range(-(-(200 << 20) // w.nbytes))]
    sliced = widths if len(widths) > 1 else None

    def after_gemm(expand):
        return lambda: [expand(torch.nn.functional.linear(cx, cw)) for cx, cw in copies]

    base = us(lambda: [torch.nn.functional.linear(cx, cw) for cx, cw in copies]) / len(copies)
    segmented = after_gemm(lambda y: sgmv.lora_expand(y, v, b, scaling, ranks, order, start, length, seg_slot, sliced))
    print(
        f"T={tokens} adapters={adapters} widths={widths} base {base:.1f}us, with the segmented expand "
        f"{us(segmented) / len(copies):.1f}us; per-token default {bgmv.expand_config(tokens, x.device)}"
    )
    runs = [
        (cfg, after_gemm(lambda y, cfg=cfg: bgmv.lora_expand(y, v, b, scaling, ranks, slot, sliced, cfg)))
        for bn, warps in itertools.product((64, 128, 256, 512), (2, 4, 8))
        for cfg in [bgmv.ExpandConfig(bn, warps)]
    ]
    best("GEMM + per-token expand", runs, per=len(copies))


def segmented_expand_in_context() -> None:
    """The segmented expand's launch parameters right after the GEMM it updates, weights and
    factors read from HBM (one copy of each per op, as each layer of a model has its own): the
    8B model's q/k/v, gate/up and o (K = 4096), 16 adapters, at the decode sizes it serves."""
    for widths, tokens in itertools.product(((14336, 14336), (4096, 1024, 1024), (4096,)), (128, 32)):
        segmented_expand_in_context_case(tokens, 16, widths)


def segmented_expand_in_context_case(tokens, adapters, widths) -> None:
    x, _, _, b, scaling, ranks, (slot, order, start, length, seg_slot), _, _ = _op_parts(tokens, adapters, 16, widths)
    v = torch.randn(tokens, len(widths) * 16, device="cuda")
    w = torch.randn(sum(widths), 4096, device="cuda").bfloat16()
    copies = [(x.clone(), w.clone(), b.clone()) for _ in range(-(-(400 << 20) // (w.nbytes + b.nbytes)))]
    sliced = widths if len(widths) > 1 else None

    def after_gemm(cfg):
        def run():
            for cx, cw, cb in copies:
                y = torch.nn.functional.linear(cx, cw)
                sgmv.lora_expand(y, v, cb, scaling, ranks, order, start, length, seg_slot, sliced, cfg)

        return run

    base = us(lambda: [torch.nn.functional.linear(cx, cw) for cx, cw, _ in copies]) / len(copies)
    table = sgmv.expand_config(tokens, 16, min(tokens, adapters), len(widths), max(widths), device=x.device)
    print(
        f"T={tokens} adapters={adapters} widths={widths} base {base:.1f}us, "
        f"+ table's segmented expand {us(after_gemm(table)) / len(copies) - base:.1f}us {table}", flush=True,
    )
    runs = [
        (cfg, after_gemm(cfg))
        for bn, tiles, warps in itertools.product((64, 128, 256), (1, 2, 4, 8), (4,))
        for cfg in [sgmv.ExpandConfig(16, bn, warps, tiles=tiles, stages=2, rows_last=table.rows_last)]
    ]
    best("GEMM + segmented expand", runs, per=len(copies))


def delta_beside() -> None:
    """Where the expand runs. In place: the GEMM on the main stream, the shrink beside it on
    the side stream, then the expand in place on the main stream, then the output's consumer
    (a pointwise kernel). Beside: the shrink and an expand into a buffer of the delta, both on
    the side stream while the GEMM runs, then the consumer adding the delta (the pointwise
    kernel an Inductor graph fuses the add into); the buffer zeroed before an expand that adds
    onto it, or not, the expand storing every element (``store=True``, as
    ``lora_linear_beside`` runs it). Per linear, weights and factors read from HBM, the 8B
    model's shapes, 16 adapters of rank 16, decode and prefill token counts."""
    for widths, tokens in itertools.product(((14336, 14336), (4096, 1024, 1024), (4096,)), (1, 32, 128, 2048)):
        delta_beside_case(tokens, 16, widths)


def delta_beside_case(tokens, adapters, widths) -> None:
    x, _, a, b, scaling, ranks, (slot, order, start, length, seg_slot), ws, _ = _op_parts(tokens, adapters, 16, widths)
    slices, sliced = len(widths), widths if len(widths) > 1 else None
    w = torch.randn(sum(widths), 4096, device="cuda").bfloat16()
    copies = [(x.clone(), w.clone(), a.clone(), b.clone()) for _ in range(-(-(400 << 20) // (w.nbytes + a.nbytes + b.nbytes)))]
    side = torch.cuda.Stream()
    per_token = bgmv.serves(tokens, 16, x.device)

    def expand(y, cb, store=False):
        if per_token:
            bgmv.lora_expand(y, ws, cb, scaling, ranks, slot, sliced, store=store)
        else:
            sgmv.lora_expand(y, ws, cb, scaling, ranks, order, start, length, seg_slot, sliced, store=store)

    out, delta = (torch.empty(tokens, sum(widths), device="cuda").bfloat16() for _ in range(2))

    def linear(mode: str):
        def run():
            for cx, cw, ca, cb in copies:
                main, ready = torch.cuda.current_stream(), torch.cuda.Event()
                ready.record(main)
                y = torch.nn.functional.linear(cx, cw)
                side.wait_event(ready)
                with torch.cuda.stream(side):
                    sgmv.lora_shrink(cx, ca, ranks, order, start, length, seg_slot, slices, out=ws)
                    if mode == "zeroed":
                        expand(delta.zero_(), cb)
                    elif mode == "stored":
                        expand(delta, cb, store=True)
                main.wait_stream(side)
                if mode == "in place":
                    expand(y, cb)
                    torch.mul(y, 1.0, out=out)  # the consumer
                else:
                    torch.add(y, delta, out=out)  # the consumer, the add fused in

        return run

    base = us(lambda: [torch.mul(torch.nn.functional.linear(cx, cw), 1.0, out=out) for cx, cw, _, _ in copies]) / len(copies)
    cells = [f"{mode} {us(linear(mode)) / len(copies) - base:.1f}" for mode in ("in place", "zeroed", "stored")]
    print(f"T={tokens} widths={widths}: GEMM + consumer {base:.1f}us; LoRA adds (us): " + ", ".join(cells), flush=True)


EXPERTS_CASES = [  # (token-expert pairs, K, output width, rank, slots x experts): gate_up and down, batch 32 and 128
    (256, 2048, 1536, 16, 1024), (256, 768, 2048, 16, 1024), (1024, 2048, 1536, 16, 1024), (1024, 768, 2048, 16, 1024),
]


EXPERTS_SHRINKS = [
    sgmv.ShrinkConfig(16, 128, 8, 2), sgmv.ShrinkConfig(16, 128, 4, 2), sgmv.ShrinkConfig(16, 256, 8, 2),
    sgmv.ShrinkConfig(16, 128, 16, 1, block_r=32, num_stages=2, rows_last=True),
    sgmv.ShrinkConfig(16, 256, 16, 2, block_r=32, num_stages=1, rows_last=True),
    sgmv.ShrinkConfig(16, 64, 8, 1), sgmv.ShrinkConfig(32, 128, 8, 2), sgmv.ShrinkConfig(16, 128, 2, 4),
]  # fmt: skip
EXPERTS_EXPANDS = [
    sgmv.ExpandConfig(16, 128, 4), sgmv.ExpandConfig(16, 128, 4, tiles=4), sgmv.ExpandConfig(16, 256, 4),
    sgmv.ExpandConfig(16, 64, 4), sgmv.ExpandConfig(16, 128, 2), sgmv.ExpandConfig(16, 128, 4, rows_last=True),
    sgmv.ExpandConfig(16, 128, 4, tiles=2), sgmv.ExpandConfig(16, 256, 4, tiles=4, stages=2),
]  # fmt: skip


def experts() -> None:
    for c in EXPERTS_CASES:
        experts_case(*c)


def experts_case(tokens, k, width, rank, adapters) -> None:
    from dataclasses import replace

    x, y, a, b, scaling, ranks, (_, order, start, length, seg_slot), v = case(tokens, k, (width,), rank, adapters)
    table_shrink = sgmv.shrink_config(tokens, k, rank, device=x.device)
    table_expand = sgmv.expand_config(tokens, rank, min(adapters, tokens), 1, width, device=x.device)

    def shrink(cfg):
        return lambda: sgmv.lora_shrink(x, a, ranks, order, start, length, seg_slot, config=cfg)

    def expand(cfg):
        return lambda: sgmv.lora_expand(y, v, b, scaling, ranks, order, start, length, seg_slot, (width,), config=cfg)

    print(f"experts T={tokens} K={k} N={width} r={rank} adapters={adapters}: the table's shrink "
          f"{us(shrink(table_shrink)):.1f}us {table_shrink}, expand {us(expand(table_expand)):.1f}us {table_expand}")  # fmt: skip
    shrinks = [replace(c, split_k=max(1, min(c.split_k, k // c.block_k))) for c in EXPERTS_SHRINKS]
    best("shrink", [(cfg, shrink(cfg)) for cfg in shrinks])
    best("expand", [(cfg, expand(cfg)) for cfg in EXPERTS_EXPANDS])


def switch_case(tokens, adapters, rank) -> None:
    x, w, a, b, scaling, ranks, (slot, order, start, length, seg_slot), ws, op = _op_parts(tokens, adapters, rank)
    shrink = lambda: sgmv.lora_shrink(x, a, ranks, order, start, length, seg_slot, out=ws)  # noqa: E731
    expands = {
        "bgmv": lambda y: bgmv.lora_expand(y, ws, b, scaling, ranks, slot),
        "sgmv": lambda y: sgmv.lora_expand(y, ws, b, scaling, ranks, order, start, length, seg_slot),
    }
    cells = [f"base {us(lambda: torch.nn.functional.linear(x, w)):.1f}"]
    cells += [f"{name} {us(lambda: op(shrink, expand)):.1f}" for name, expand in expands.items()]  # noqa: B023
    print(f"T={tokens:>4} adapters={adapters:>2} r={rank}: " + "  ".join(cells) + " us", flush=True)


if __name__ == "__main__":
    tunes = {
        "sgmv": tune_sgmv, "bgmv": tune_bgmv, "switch": switch, "in_context": in_context,
        "in_context_8b": in_context_8b, "expand_in_context": expand_in_context, "segmented_expand_in_context": segmented_expand_in_context,
        "delta_beside": delta_beside, "experts": experts,
    }  # fmt: skip
    for part in sys.argv[1:] or ["sgmv", "bgmv", "switch"]:
        tunes[part]()
