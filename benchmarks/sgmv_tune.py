"""Sweep the SGMV kernels' launch parameters on a few shape classes and print the best.

    python benchmarks/sgmv_tune.py

Times each kernel alone inside a CUDA graph (median, microseconds), so the table in
``shrink_config`` / ``expand_config`` in ``fxlora/kernels/sgmv.py`` can be chosen from measurements.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

from fxlora.kernels import batch_info, sgmv

CASES = [  # (tokens, K, N, rank, adapters)
    (1, 4096, 4096, 16, 1),
    (32, 4096, 4096, 16, 16),
    (32, 4096, 4096, 64, 16),
    (256, 4096, 4096, 16, 16),
    (2048, 4096, 4096, 16, 1),
    (2048, 4096, 4096, 16, 16),
    (2048, 4096, 4096, 64, 16),
]


def us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def main() -> None:
    for tokens, k, n, rank, adapters in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
        y = torch.randn(tokens, n, device="cuda", generator=gen).bfloat16()
        a = torch.randn(adapters, rank, k, device="cuda", generator=gen).bfloat16()
        b = torch.randn(adapters, n, rank, device="cuda", generator=gen).bfloat16()
        scaling = torch.ones(adapters, device="cuda")
        ranks = torch.full((adapters,), rank, dtype=torch.int32, device="cuda")
        slot_ids = (torch.arange(tokens, device="cuda") % adapters).int()
        _, order, start, length = batch_info(slot_ids, x, 1, adapters)
        shrink = []
        for bm, bk, split, warps in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8, 16, 32), (2, 4, 8)):
            if bm > max(16, tokens) or split * bk > k:
                continue
            cfg = sgmv.ShrinkConfig(bm, bk, split, warps)
            try:
                t = us(lambda: sgmv.lora_shrink(x, a, ranks, order, start, length, config=cfg))  # noqa: B023 (called at once)
            except Exception as e:  # out of resources for this config
                print("skip", cfg, type(e).__name__)
                continue
            shrink.append((t, cfg))
        shrink.sort(key=lambda p: p[0])
        expand = []
        v = torch.randn(tokens, rank, device="cuda")
        for bm, bn, warps in itertools.product((16, 32, 64), (32, 64, 128, 256), (2, 4, 8)):
            if bm > max(16, tokens):
                continue
            cfg = sgmv.ExpandConfig(bm, bn, warps)
            try:
                t = us(lambda: sgmv.lora_expand(y, v, b, scaling, ranks, order, start, length, config=cfg))  # noqa: B023
            except Exception as e:
                print("skip", cfg, type(e).__name__)
                continue
            expand.append((t, cfg))
        expand.sort(key=lambda p: p[0])
        default = (sgmv.shrink_config(tokens, k), sgmv.expand_config(tokens, rank))
        print(f"T={tokens} K={k} N={n} r={rank} adapters={adapters}  default {default}")
        print("  shrink best:", ", ".join(f"{t:.1f}us {c}" for t, c in shrink[:3]))
        print("  expand best:", ", ".join(f"{t:.1f}us {c}" for t, c in expand[:3]))


if __name__ == "__main__":
    main()
