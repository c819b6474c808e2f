"""Sweep every causal LM architecture transformers ships through fxlora, against PEFT.

Each architecture is built in float32 with random weights from the tiny config its
transformers tester uses (``scripts/data/tester_configs.json``, written by
``scripts/extract_tester_configs.py``: no test suite and no model hub needed). Three PEFT LoRA
adapters with random factors are made for it: ``a``, ``all-linear`` at rank 8 with
``target_parameters`` on every 3-D parameter the model has (experts' fused weights, shared
experts, ...; without them where PEFT itself cannot build or run them, noted in the result); ``b``, ``all-linear`` with rsLoRA at rank 4; ``c``, the attention's query / value
projections at rank 2. ``fxlora.compile`` serves a mixed batch of five rows
(``a, None, b, c, a``), and each row is compared with PEFT running that row's adapter (the
unmodified model for ``None``) by :func:`fxlora.testing.check_rows`: relative error per row
within 1e-5 in float32.

Every architecture runs in a subprocess of its own with a time limit. Results, one per
architecture: ``pass``; ``mismatch`` (the largest row error); ``error`` (the exception, and a
cause where it can be told); ``not-buildable`` (transformers or PEFT themselves cannot build or
run the model or an adapter, checked before fxlora is involved; or, for rows that differ, the
model under plain ``torch.compile`` already differs from its eager forward).

    python scripts/sweep_models.py [--only llama,gpt2] [--jobs N] [--out results.json] [--markdown]
    python scripts/sweep_models.py --compare newest.json floor.json     # the docs' table
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

log = logging.getLogger("sweep_models")


def torch_no_grad(fn: Any) -> Any:
    """``torch.no_grad()`` around ``fn``, importing torch only when it is called."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper

CONFIGS = Path(__file__).parent / "data" / "tester_configs.json"
ROWS = ["a", None, "b", "c", "a"]
SEQ_LEN = 6
MARK = "SWEEP-RESULT "
# leaf names of query / value projections, across families
ATTENTION_SUBSET = re.compile(
    r"^(q|v|q_proj|v_proj|query|value|q_lin|v_lin|wq|wv|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
    r"qkv_proj|qkv|Wqkv|c_attn|query_key_value|in_proj|linear_q|linear_v|to_q|to_v)$"
)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def classify(e: BaseException) -> str:
    """A short cause for an exception raised while fxlora compiled or ran the model."""
    text = str(e)
    name = type(e).__name__
    if name == "AdapterError":
        return "experts adapter refused" if "expert" in text or "gate_up_proj" in text else "adapter refused"
    if "did not run" in text:
        return "LoRA did not run"
    if name in ("BackendCompilerFailed",) or "fxlora" in text and "backend" in text.lower():
        return "fxlora pass failure"
    if type(e).__module__.startswith("torch._dynamo") or name in ("Unsupported", "TorchRuntimeError", "UserError"):
        return "Dynamo failure"
    return "error"


def _linear_names(model: Any) -> list[str]:
    import torch
    from transformers.pytorch_utils import Conv1D

    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def adapter_configs(model: Any) -> dict[str, Any]:
    """The three LoraConfigs of the sweep for ``model``."""
    from peft import LoraConfig

    subset = sorted({n.rsplit(".", 1)[-1] for n in _linear_names(model) if ATTENTION_SUBSET.match(n.rsplit(".", 1)[-1])})
    if not subset:  # no recognisable query / value: the first linear of an attention module
        attention = [n for n in _linear_names(model) if re.search(r"attn|attention", n, re.I)]
        subset = [attention[0].rsplit(".", 1)[-1]] if attention else []
    # every 3-D parameter the model has, by its module's last name and its own
    parameters = sorted({f"{fqn.rsplit('.', 1)[-1]}.{name}" for fqn, module in model.named_modules()
                         for name, p in module.named_parameters(recurse=False) if p.dim() == 3 and fqn})  # fmt: skip
    configs = {
        "a": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", target_parameters=parameters or None),
        "b": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True),
    }
    if subset:
        configs["c"] = LoraConfig(r=2, lora_alpha=4, target_modules=subset)
    return configs


def run_one(model_type: str, entry: dict[str, Any], workdir: str) -> dict[str, Any]:
    """Build, adapt, compile and check one architecture (in this process)."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from fxlora.adapters import experts
    from fxlora.testing import check_rows, make_adapter, oracle_noise, peft_model_with, row_errors
    from fxlora.testing.models import fill_zero_weights

    result: dict[str, Any] = {"model_type": model_type}
    if entry.get("config") is None:
        return {**result, "status": "not-buildable", "cause": "no valid tester config", "error": entry.get("error", "")}
    # 1. transformers builds and runs the model
    try:
        torch.manual_seed(0)
        config = CONFIG_MAPPING[model_type](**entry["config"])
        model = getattr(transformers, entry["causal_lm_class"])(config).float().eval()
        fill_zero_weights(model, 0.5)
        vocab = config.get_text_config().vocab_size
        ids = torch.randint(3, min(vocab, 99), (len(ROWS), SEQ_LEN), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            try:
                model(input_ids=ids)
            except RuntimeError:
                if not any(experts.is_experts(m) for m in model.modules()):
                    raise
                # the default experts kernels refuse some shapes (grouped_mm: 16-byte strides)
                model.set_experts_implementation("eager")
                model(input_ids=ids)
    except Exception as e:  # noqa: BLE001
        return {**result, "status": "not-buildable", "cause": "transformers cannot build or run it", "error": _first_line(e)}
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["experts"] = any(experts.is_experts(m) for m in model.modules())
    if result["experts"]:
        result["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    # 2. PEFT builds the adapters and runs each; where PEFT cannot wrap the 3-D parameters
    # (its ParamWrapper hides attributes some models read), adapter a goes without them
    configs = adapter_configs(model)
    while True:
        try:
            adapters = {n: make_adapter(model, c, seed=i + 1, directory=os.path.join(workdir, n), scale=0.5)
                        for i, (n, c) in enumerate(configs.items())}  # fmt: skip
            names = [n if n is None or n in adapters else "a" for n in ROWS]
            result["adapters"] = {n: {"target_modules": _jsonable(c.target_modules),
                                      "target_parameters": _jsonable(c.target_parameters)} for n, c in configs.items()}  # fmt: skip
            # one PeftModel per adapter: PEFT holds several only if they target the same parameters
            peft_models = {n: peft_model_with(model, {n: a}) for n, a in adapters.items()}
            base = copy.deepcopy(model)  # fxlora.compile may switch the model's experts implementation
            reference = functools.partial(per_adapter_reference, base, peft_models)
            ref = reference(names, input_ids=ids)
            break
        except Exception as e:  # noqa: BLE001
            if not configs["a"].target_parameters:
                return {**result, "status": "not-buildable", "cause": "PEFT cannot build or run an adapter", "error": _first_line(e)}
            result["target_parameters_dropped"] = f"{configs['a'].target_parameters}: {_first_line(e)}"
            configs["a"] = dataclasses.replace(configs["a"], target_parameters=None)
    # 3. fxlora
    import fxlora

    try:
        cm = fxlora.compile(model, adapters=adapters, max_loras=4, max_rank=16)
        with torch.no_grad():
            out = cm(input_ids=ids, adapter_names=names).logits
    except Exception as e:  # noqa: BLE001
        log.debug("%s", traceback.format_exc())
        return {**result, "status": "error", "cause": classify(e), "error": _first_line(e)}
    errors = row_errors(out, ref)
    result["row_errors"] = errors
    result["max_rel_error"] = max(errors)

    def exact(rows: list[str | None], **inputs: Any) -> torch.Tensor:  # the same oracle in float64
        model64 = copy.deepcopy(base).double()
        pms = {n: peft_model_with(model64, {n: adapters[n]}) for n in set(rows) - {None}}
        return per_adapter_reference(model64, pms, rows, **inputs)

    try:
        check_rows(out, ref, names, noise=lambda: oracle_noise(reference, exact, names, input_ids=ids))
    except AssertionError as e:
        gap = compiled_gap(base, ids)
        if gap > 1e-5:  # no graph of fxlora's can match a model that Dynamo alone changes
            return {**result, "status": "not-buildable", "cause": "transformers' compiled forward differs from its eager one",
                    "error": f"torch.compile(model, backend='eager') differs from model() by {gap:.2g} (relative)"}  # fmt: skip
        return {**result, "status": "mismatch", "cause": "rows differ from PEFT", "error": str(e)[:300]}
    return {**result, "status": "pass"}


@torch_no_grad
def compiled_gap(model: Any, ids: Any) -> float:
    """The relative error of the model under plain ``torch.compile`` (Dynamo, no compiler)
    against its eager forward: a model whose code takes another path when traced (a branch on
    ``is_torchdynamo_compiling``) differs already without fxlora."""
    import torch

    model = copy.deepcopy(model)
    want = model(input_ids=ids).logits
    torch._dynamo.reset()
    got = torch.compile(model, backend="eager")(input_ids=ids).logits
    return ((got - want).abs().max() / want.abs().max()).item()


@torch_no_grad
def per_adapter_reference(
    model: Any, peft_models: dict[str, Any], names: list[str | None], *, whole_batch: bool = False, **inputs: Any
) -> Any:
    """Every row's logits from the PeftModel of its adapter (``model`` for ``None``), run on the
    rows sharing it, or with ``whole_batch`` on all rows."""
    from fxlora.testing.oracle import _per_adapter_logits

    return _per_adapter_logits(lambda n: model if n is None else peft_models[n], names, whole_batch, inputs)


def _jsonable(value: Any) -> Any:
    return sorted(value) if isinstance(value, (set, frozenset, list, tuple)) else value


def worker(model_type: str) -> None:
    """Subprocess entry: run one architecture, print its result as one marked JSON line."""
    entry = json.loads(CONFIGS.read_text())["models"][model_type]
    with tempfile.TemporaryDirectory(prefix="fxlora-sweep-") as workdir:
        try:
            result = run_one(model_type, entry, workdir)
        except Exception as e:  # noqa: BLE001 - anything the steps above did not expect
            result = {"model_type": model_type, "status": "error", "cause": "sweep failure", "error": _first_line(e)}
    print(MARK + json.dumps(result), flush=True)


def spawn(model_type: str, timeout: float, threads: int) -> dict[str, Any]:
    """Run ``worker(model_type)`` in a fresh interpreter (no Dynamo state shared)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", model_type], capture_output=True, text=True,
                              timeout=timeout, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "status": "error", "cause": "timeout", "error": f"over {timeout:.0f} s",
                "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    seconds = round(time.monotonic() - start, 1)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK) :]), "seconds": seconds}
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    return {"model_type": model_type, "status": "error", "cause": f"crashed (exit {proc.returncode})",
            "error": tail[:300], "seconds": seconds}  # fmt: skip


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| architecture | result | cause | detail |", "| --- | --- | --- | --- |"]
    for r in results:
        status = r["status"] if r["status"] != "mismatch" else f"mismatch ({r['max_rel_error']:.2g})"
        detail = r.get("error", "").replace("|", "\\|").replace("\n", " ")[:140]
        lines.append(f"| {r['model_type']} | {status} | {r.get('cause', '') if r['status'] != 'pass' else ''} | {detail} |")
    return "\n".join(lines)


def comparison(runs: list[dict[str, Any]]) -> str:
    """One row per architecture, a result and cause column per run (each a ``--out`` file)."""
    head = "| architecture | " + " | ".join(f"{r['transformers_version']} | cause" for r in runs) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(runs))]
    by_run = [{x["model_type"]: x for x in r["results"]} for r in runs]
    for model_type in sorted(set().union(*by_run)):
        cells = []
        for results in by_run:
            r = results.get(model_type)
            if r is None:
                cells += ["", ""]
                continue
            status = r["status"] if r["status"] != "mismatch" else f"mismatch ({r['max_rel_error']:.2g})"
            cells += [status, r.get("cause", "") if r["status"] != "pass" else ""]
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="architectures run at once")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", action="store_true", help="print a table of the results")
    parser.add_argument("--compare", type=Path, nargs="+", metavar="JSON", help="print the table of these --out files side by side")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare:
        print(comparison([json.loads(p.read_text()) for p in args.compare]))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.worker:
        logging.getLogger().setLevel(logging.WARNING)
        worker(args.worker)
        return
    data = json.loads(CONFIGS.read_text())
    model_types = sorted(data["models"])
    if args.only:
        wanted = [m.strip() for m in args.only.split(",") if m.strip()]
        unknown = set(wanted) - set(model_types)
        if unknown:
            parser.error(f"unknown model types: {', '.join(sorted(unknown))}")
        model_types = wanted
    import transformers

    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    results: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(spawn, m, args.timeout, threads): m for m in model_types}
        for i, future in enumerate(as_completed(futures), 1):
            r = future.result()
            results[r["model_type"]] = r
            extra = f" {r.get('cause', '')}: {r.get('error', '')}" if r["status"] != "pass" else ""
            log.info("[%d/%d] %s %s (%.0f s)%s", i, len(model_types), r["model_type"], r["status"],
                     r.get("seconds", 0), extra[:200])  # fmt: skip
    ordered = [results[m] for m in model_types]
    counts: dict[str, int] = {}
    for r in ordered:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    log.info("transformers %s: %s", transformers.__version__, ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.out:
        summary = {"transformers_version": transformers.__version__, "configs_from": data["transformers_version"],
                   "counts": counts, "results": ordered}  # fmt: skip
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    if args.markdown:
        print(markdown(ordered))


if __name__ == "__main__":
    main()
