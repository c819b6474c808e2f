"""Plot a ``benchmarks/decode.py --out`` JSON file: step time per batch size and adapter
count, each variant side by side, the bytes floor as a line. Needs matplotlib.

    python benchmarks/plot_decode.py results.json docs/img/decode.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [("hand_graph", "HF model, hand-made CUDA graph"), ("nolora", "fxlora nolora"), ("lora", "fxlora lora")]


def main(path: str, image: str) -> None:
    with open(path) as f:
        data = json.load(f)
    rows, meta = data["rows"], data["meta"]
    peft = "PEFT eager" if meta.get("model", "llama") == "llama" else "PEFT eager (one adapter)"
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.8), sharey=False)
    for ax, batch in zip(axes, batches):
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["adapters"])
        xs = range(len(mine))
        width = 0.2
        for i, (key, label) in enumerate(SERIES):
            values = [(r[key] or 0) / 1000 for r in mine]
            ax.bar([x + (i - 1.5) * width for x in xs], values, width, label=label)
        ax.bar([x + 1.5 * width for x in xs], [r["peft_eager"] / 1000 for r in mine], width, label=peft)
        ax.hlines([r["floor"] / 1000 for r in mine], [x - 2 * width for x in xs], [x + 2 * width for x in xs],
                  colors="black", linestyles="dashed", label="bytes floor")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [str(r["adapters"]) for r in mine])
        ax.set_xlabel("distinct adapters")
        ax.set_title(f"batch {batch}")
    axes[0].set_ylabel("decode step, ms (log)")
    axes[-1].legend(fontsize=7, loc="upper left")
    title = {"llama": "Llama-shaped 1B", "qwen3_moe": "Qwen3-MoE-shaped (64 experts, top-8)"}[meta.get("model", "llama")]
    fig.suptitle(f"{title}, bf16, context 512 — {meta['gpu']}, torch {meta['torch']}, {meta['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(image, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
