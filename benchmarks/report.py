"""Turn a ``benchmarks/lora_linear.py --out`` or ``benchmarks/decode.py --out`` JSON file
into the Markdown table of ``docs/benchmarks.md``.

    python benchmarks/report.py results.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    if "meta" in data:
        decode(data)
        return
    env = data["env"]
    print(
        f"GPU {env['gpu']}, torch {env['torch']}, triton {env['triton']}, Python {env['python']}; "
        f"measured copy bandwidth {env['copy_bandwidth_GBps']:.0f} GB/s (read + write).\n"
    )
    print(
        "| shape | tokens | rank | adapters | base µs | fxlora µs | fxlora serial µs | gather-bmm µs "
        "| LoRA delta / base | delta floor µs | delta / floor | fxlora eager µs | PEFT loop eager µs | loop / fxlora "
        "| cold base µs | cold fxlora µs | cold delta / base |"
    )
    print("|" + "---|" * 17)
    for r in data["rows"]:
        delta = r["fxlora_graph"] - r["base_graph"]
        cold = ["–"] * 3
        if r.get("base_cold_graph") is not None:
            cold_delta = (r["fxlora_cold_graph"] - r["base_cold_graph"]) / r["base_cold_graph"]
            cold = [f"{r['base_cold_graph']:.1f}", f"{r['fxlora_cold_graph']:.1f}", f"{cold_delta:.0%}"]
        pool = r.get("pool", r["adapters"])
        adapters = f"{r['adapters']}" if pool == r["adapters"] else f"{r['adapters']} of {pool}"
        print(
            f"| {r['shape']} | {r['tokens']} | {r['rank']} | {adapters} | {r['base_graph']:.1f} "
            f"| {r['fxlora_graph']:.1f} | {r['fxlora_serial_graph']:.1f} | {r['gather_bmm_graph']:.1f} "
            f"| {delta / r['base_graph']:.0%} | {r['floor_delta']:.1f} | {delta / r['floor_delta']:.2f} "
            f"| {r['fxlora_eager']:.1f} | {r['peft_loop_eager']:.1f} | {r['peft_loop_eager'] / r['fxlora_eager']:.1f} "
            f"| {' | '.join(cold)} |"
        )


def decode(data: dict) -> None:
    m = data["meta"]
    print(
        f"GPU {m['gpu']}, torch {m['torch']}, triton {m['triton']}, transformers {m['transformers']}, "
        f"Python {m['python']}; copy bandwidth {m['copy_bandwidth_GBps']:.0f} GB/s. `fxlora.compile` + `prepare()` "
        f"of {m['graphs']} graphs: {m['setup_seconds']:.1f} s; graph pool {m['graph_pool_MiB']:.0f} MiB, "
        f"KV cache {m['kv_cache_MiB']:.0f} MiB.\n"
    )
    peft = "PEFT eager" if m.get("model", "llama") == "llama" else "PEFT eager (one adapter)"
    print(
        f"| batch | adapters | hand graph | nolora | lora | {peft} | floor | nolora / hand | lora / nolora "
        "| PEFT / fxlora | hand / floor |"
    )
    print("|" + "---|" * 11)

    def opt(v, fmt):
        return "–" if v is None else format(v, fmt)

    for r in data["rows"]:
        print(
            f"| {r['batch']} | {r['adapters']} | {r['hand_graph']:.0f} | {r['nolora']:.0f} | {opt(r['lora'], '.0f')} "
            f"| {r['peft_eager']:.0f} | {r['floor']:.0f} | {r['nolora/hand']:.3f} | {opt(r['lora/nolora'], '.3f')} "
            f"| {r['peft/fxlora']:.1f} | {r['hand/floor']:.2f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
