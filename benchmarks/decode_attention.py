"""``fxlora::decode_attention``'s kernel against what a model would otherwise run at a decode
step, and against its bytes floor, in bf16.

    python benchmarks/decode_attention.py [--out F.json] [--sweep] [--quick]

Llama-1B's attention shape (32 query heads, 8 KV heads of 64); one query token per row over a
static cache of ``cache`` columns of which the first ``context`` are visible. Systems: the
kernel; SDPA over keys and values expanded to the query heads (transformers' ``repeat_kv``
then ``scaled_dot_product_attention``, the expansion included); SDPA with ``enable_gqa``. The
floor is the visible keys and values at the device-to-device copy bandwidth. Graph times
(``triton.testing.do_bench_cudagraph``), medians in µs. ``--sweep`` also times the kernel's
block size and pipeline depth around the defaults.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.testing
from decode import copy_bandwidth, environment

from fxlora.kernels import decode_attention as kernel

HEADS, KV_HEADS, DIM = 32, 8, 64
CASES = [(1, 512, 528), (32, 512, 528), (128, 512, 528), (32, 2048, 4096), (128, 2048, 4096)]


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_attention.json")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--quick", action="store_true", help="context 512 only")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    defaults = {"BLOCK_N": kernel.BLOCK_N, "STAGES": kernel.STAGES}
    configs = [defaults]
    if args.sweep:
        configs += [{"BLOCK_N": n, "STAGES": s} for n, s in itertools.product((32, 64, 128), (1, 2, 3, 4))]
    rows = []
    for batch, context, cache in [c for c in CASES if c[1] == 512] if args.quick else CASES:
        gen = torch.Generator("cuda").manual_seed(0)
        q = torch.randn(batch, HEADS, 1, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, KV_HEADS, cache, DIM, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        masked = torch.finfo(torch.bfloat16).min
        mask = torch.full((batch, 1, 1, cache), masked, dtype=torch.bfloat16, device="cuda")
        mask[..., :context] = 0
        scale = DIM**-0.5
        group = HEADS // KV_HEADS
        row = {"batch": batch, "context": context, "cache": cache,
               "floor": 2 * batch * KV_HEADS * context * DIM * 2 / bandwidth * 1e6}  # fmt: skip
        # each lambda is captured and replayed within its iteration: B023 does not apply
        row["sdpa_expanded"] = graph_us(lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=scale))  # noqa: B023  # fmt: skip
        row["sdpa_gqa"] = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True))  # noqa: B023
        for config in configs:
            for name, value in config.items():
                setattr(kernel, name, value)
            name = "kernel" if config is defaults else "kernel BLOCK_N={BLOCK_N} STAGES={STAGES}".format(**config)
            row[name] = graph_us(lambda: kernel.decode_attention(q, k, v, mask, scale, masked))  # noqa: B023
        for name, value in defaults.items():
            setattr(kernel, name, value)
        rows.append(row)
        timed = {key: val for key, val in row.items() if key not in ("batch", "context", "cache")}
        print(f"batch {batch:>3} context {context:>4}/{cache:<4} " + "  ".join(
            f"{key} {val:.1f}" + (f" ({val / row['floor']:.2f}x)" if key != "floor" else "") for key, val in timed.items()))  # fmt: skip
    meta = {
        **environment(),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "defaults": defaults,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
