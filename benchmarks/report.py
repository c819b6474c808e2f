"""Turn a ``benchmarks/lora_linear.py --out`` JSON file into the Markdown table of
``docs/benchmarks.md``.

    python benchmarks/report.py results.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    env = data["env"]
    print(
        f"GPU {env['gpu']}, torch {env['torch']}, triton {env['triton']}, Python {env['python']}; "
        f"measured copy bandwidth {env['copy_bandwidth_GBps']:.0f} GB/s (read + write).\n"
    )
    print(
        "| shape | tokens | rank | adapters | base µs | fxlora µs | fxlora serial µs | gather-bmm µs "
        "| LoRA delta / base | delta floor µs | delta / floor | fxlora eager µs | PEFT loop eager µs | loop / fxlora |"
    )
    print("|" + "---|" * 14)
    for r in data["rows"]:
        delta = r["fxlora_graph"] - r["base_graph"]
        print(
            f"| {r['shape']} | {r['tokens']} | {r['rank']} | {r['adapters']} | {r['base_graph']:.1f} "
            f"| {r['fxlora_graph']:.1f} | {r['fxlora_serial_graph']:.1f} | {r['gather_bmm_graph']:.1f} "
            f"| {delta / r['base_graph']:.0%} | {r['floor_delta']:.1f} | {delta / r['floor_delta']:.2f} "
            f"| {r['fxlora_eager']:.1f} | {r['peft_loop_eager']:.1f} | {r['peft_loop_eager'] / r['fxlora_eager']:.1f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
