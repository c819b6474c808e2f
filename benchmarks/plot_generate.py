"""Plot ``benchmarks/generate.py --out`` JSON files: decode tokens/s per batch size, each
system side by side, one panel per file, the ratio to transformers over each fxlora bar.
Needs matplotlib.

    python benchmarks/plot_generate.py docs/img/generate.png results.json [more.json ...]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODELS = {"llama": "Llama-shaped 1B", "qwen3_moe": "Qwen3-MoE-shaped (64 experts, top-8)"}


def series(rows: dict) -> dict[str, str]:
    """Row prefix -> label, in plotting order: fxlora's variants, then the baselines."""
    labels = {"nolora": "fxlora nolora"}
    for name in sorted({k.split("/")[0] for k in rows if k.startswith("lora")}):
        count = name.removeprefix("lora")
        labels[name] = f"fxlora lora, {count or 16} adapters"
    labels |= {"base": "transformers compiled (base)", "peft": "PEFT eager"}
    return {k: v for k, v in labels.items() if any(r.startswith(f"{k}/") for r in rows)}


def panel(ax, data: dict) -> None:
    rows = {}
    for result in data["systems"].values():
        rows.update(result.get("rows", {}))
    meta = data["meta"]
    labels = series(rows)
    batches = sorted({int(k.split("/")[1]) for k in rows})
    width = 0.8 / len(labels)
    for i, (key, label) in enumerate(labels.items()):
        xs = [b + (i - (len(labels) - 1) / 2) * width for b in range(len(batches))]
        values = [rows.get(f"{key}/{b}", {}).get("decode_tok_s", 0) for b in batches]
        bars = ax.bar(xs, values, width, label=label)
        if key not in ("base", "peft"):
            for bar, b, v in zip(bars, batches, values):
                base = rows.get(f"base/{b}", {}).get("decode_tok_s")
                if base and v:
                    ax.annotate(f"{v / base:.2f}×", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                                va="bottom", fontsize=6)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("batch")
    quant = " FP8" if meta.get("quant", "none") != "none" else ""
    ax.set_title(f"{MODELS[meta['model']]}{quant}\n{meta['gpu']}, {meta['date']}", fontsize=9)
    ax.legend(fontsize=6, loc="upper left")


def main(image: str, *paths: str) -> None:
    fig, axes = plt.subplots(1, len(paths), figsize=(5 * len(paths), 4), squeeze=False)
    for ax, path in zip(axes[0], paths):
        with open(path) as f:
            panel(ax, json.load(f))
    axes[0][0].set_ylabel("decode tokens/s (log)")
    fig.suptitle("Whole generate calls: prompt 128, 128 new tokens, greedy (ratio: to transformers)", fontsize=10)
    fig.tight_layout()
    fig.savefig(image, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
