"""A tiny random Llama, three PEFT adapters, one mixed batch, served by fxlora and checked against PEFT.

Prints, per row, the adapter it used and its error against PEFT with that adapter, greedy
generation for the same mixed batch against PEFT's ``generate`` per adapter, wall-clock
times of the same batch through fxlora and through PEFT one adapter at a time, and what
fxlora compiled (``cm.explain()``). Runs on the CPU in well under a minute; the times are an
illustration on a toy model, not a benchmark (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
from peft import LoraConfig

import fxlora
from fxlora.testing import make_adapter, peft_model_with, reference_generate, reference_logits, row_errors, tiny_model

ADAPTERS = {
    "sql": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "chat": LoraConfig(r=16, lora_alpha=8, use_rslora=True, target_modules="all-linear"),
    "style": LoraConfig(r=4, lora_alpha=4, target_modules=["o_proj", "down_proj", "embed_tokens", "lm_head"]),
}
NEW_TOKENS = 8  # greedy tokens generated per row


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m fxlora.demo``."""
    cli = argparse.ArgumentParser(
        prog="python -m fxlora.demo",
        description=__doc__.replace("``", ""),
        epilog="Docs: https://github.com/fxlora/fxlora/blob/main/docs/usage.md",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cli.add_argument(
        "--rows",
        type=_at_least(2),
        default=6,
        help="rows in the batch; they take the adapters sql, chat, style and none in turn, and row 1 is left-padded",
    )
    cli.add_argument("--length", type=_at_least(1), default=16, help="prompt tokens per row")
    cli.add_argument("--repeats", type=_at_least(1), default=5, help="timed runs per method, after one warm-up run")
    return cli


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    warnings.filterwarnings("ignore", module="(transformers|peft)")  # deprecation chatter of the libraries
    # fxlora's warnings (on the CPU: decode steps run without CUDA graphs) go to stdout, in order with the table
    notes = logging.getLogger("fxlora")
    notes.addHandler(logging.StreamHandler(sys.stdout))
    notes.propagate = False
    torch.manual_seed(0)
    model = tiny_model("llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=256)

    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        adapters = {n: make_adapter(model, c, seed=i, directory=f"{tmp}/{n}") for i, (n, c) in enumerate(ADAPTERS.items())}
        start = time.perf_counter()
        cm = fxlora.compile(
            model,
            adapters=adapters,
            max_loras=4,
            max_rank=16,
            max_batch_size=max(8, args.rows),
            max_len=max(512, args.length + NEW_TOKENS),
        )
        names = [(list(adapters) + [None])[i % 4] for i in range(args.rows)]
        ids = torch.randint(3, 256, (args.rows, args.length))
        mask = torch.ones_like(ids)
        mask[1, : args.length // 2] = 0  # one left-padded row
        inputs = dict(input_ids=ids, attention_mask=mask)
        out = cm(**inputs, adapter_names=names).logits
        compile_s = time.perf_counter() - start

        peft_model = peft_model_with(model, adapters)
        ref = reference_logits(model, peft_model, names, **inputs)
        errors = row_errors(out, ref, mask)

        print(f"fxlora demo: tiny Llama, {len(adapters)} PEFT adapters, batch {args.rows} x {args.length}")
        print(f"compile + first call: {compile_s:.1f} s")
        cm.prepare()  # the generation runtime, built before the tables so that any warning it gives comes first
        print()
        print(f"{'row':>3}  {'adapter':<8} {'rel. error vs PEFT':>19}")
        for i, (name, err) in enumerate(zip(names, errors)):
            print(f"{i:>3}  {str(name):<8} {err:>19.2e}")

        new = NEW_TOKENS
        generated = cm.generate(ids, mask, adapter_names=names, max_new_tokens=new, eos_token_id=())[:, -new:]
        wanted = reference_generate(model, peft_model, names, ids, mask, new, None, 0)
        same = generated.eq(wanted).all(1).tolist()
        print(f"\ngenerate, {new} greedy tokens per row: {sum(same)}/{len(same)} rows equal PEFT's generate")
        for i, (name, row) in enumerate(zip(names, generated.tolist())):
            print(f"{i:>3}  {str(name):<8} {row}")

        # the same prompts as a stream of requests, each its own length limit: they join and leave the batch
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        lengths = [new - i % 3 for i in range(len(prompts))]
        results = cm.generate_batch(prompts, names, max_new_tokens=lengths, eos_token_id=(), progress_bar=False)
        streamed = all(r.generated_tokens == w[:n].tolist() for r, w, n in zip(results, wanted, lengths))
        print(f"generate_batch (continuous batching, {len(prompts)} requests of {min(lengths)}-{max(lengths)} tokens): "
              f"{'every request equals' if streamed else 'requests differ from'} PEFT's generate")  # fmt: skip

        timings = {
            "fxlora, mixed batch": _time(lambda: cm(**inputs, adapter_names=names), args.repeats),
            "PEFT, one adapter at a time": _time(lambda: reference_logits(model, peft_model, names, **inputs), args.repeats),
            "base model, no adapters": _time(lambda: model(**inputs), args.repeats),
        }
        print(f"\n{'CPU wall time per batch (toy model)':<36} {'ms':>8}")
        for label, ms in timings.items():
            print(f"{label:<36} {ms:>8.2f}")
        print("\n" + cm.explain())
        worst = max(errors)
        if worst > fxlora.testing.RTOL[torch.float32]:
            raise SystemExit(f"error {worst:.2e} exceeds the float32 tolerance")
        if not all(same) or not streamed:
            raise SystemExit("generated tokens differ from PEFT's")


if __name__ == "__main__":
    main()
