"""Extract the tiny configs of transformers' model testers into scripts/data/tester_configs.json.

Run once per transformers release against a checkout of transformers' ``tests/`` folder:

    python scripts/extract_tester_configs.py --tests-dir path/to/transformers/tests

For every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` it records the keyword
arguments the model's tester passes to its config class, as ``CausalLMModelTester.get_config``
does: every tester attribute whose name is a parameter of the config's ``__init__`` (or an
``attribute_map`` alias of one, as the older testers pass ``n_embd=self.hidden_size``),
plus ``pad_token_id``. The tester attributes are read from source, never imported: the
keyword defaults of ``CausalLMModelTester.__init__`` (``causal_lm_tester.py``), overridden by
those of the model's own ``*ModelTester.__init__`` where its test file is present
(``models/<module>/test_modeling_<module>.py``). Composite configs (a text model with a
vision or audio tower) get the same values in each sub-config. Each entry names its source.

The sweep (``scripts/sweep_models.py``) rebuilds each config from this file alone.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("extract_tester_configs")

OUT = Path(__file__).parent / "data" / "tester_configs.json"


def init_defaults(path: Path, class_suffix: str) -> dict[str, Any] | None:
    """Literal keyword defaults of ``__init__`` of the first class whose name ends with
    ``class_suffix`` in ``path``, plus ``head_dim`` as the base tester derives it."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name.endswith(class_suffix)):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args.args[len(item.args.args) - len(item.args.defaults) :]
                out = {}
                for arg, default in zip(args, item.args.defaults):
                    try:
                        out[arg.arg] = ast.literal_eval(default)
                    except ValueError:  # a computed default: the config's own default stands
                        log.debug("%s: %s has a computed default", path, arg.arg)
                for arg, default in zip(item.args.kwonlyargs, item.args.kw_defaults):
                    if default is not None:
                        try:
                            out[arg.arg] = ast.literal_eval(default)
                        except ValueError:
                            pass
                return out
        return {}
    return None


def config_kwargs(config_class: type, attrs: dict[str, Any]) -> dict[str, Any]:
    """The tester's ``get_config`` keyword arguments for ``config_class``."""
    params = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    aliases = getattr(config_class, "attribute_map", {}) or {}
    kwargs = {k: v for k, v in attrs.items() if k in params}
    for alias, name in aliases.items():
        if alias in attrs and name in params and name not in kwargs:
            kwargs[name] = attrs[alias]
    kwargs["pad_token_id"] = attrs.get("pad_token_id", 0)
    return kwargs


def sub_config_kwargs(config_class: type, attrs: dict[str, Any]) -> dict[str, Any]:
    """``config_kwargs`` for a composite config: its own fields, and each sub-config's."""
    kwargs = config_kwargs(config_class, attrs)
    sub_configs = getattr(config_class, "sub_configs", {}) or {}
    if not sub_configs:
        return kwargs
    for name, sub_class in sub_configs.items():
        if not getattr(sub_class, "model_type", ""):  # AutoConfig: the default's own class
            try:
                sub_class = type(getattr(config_class(), name))
            except Exception:  # noqa: BLE001 - no valid default: the sub-config keeps its own
                continue
        if getattr(sub_class, "model_type", ""):
            sub_kwargs, dropped, _ = valid_kwargs(sub_class, sub_config_kwargs(sub_class, attrs))
            if sub_kwargs is not None:
                if dropped:
                    log.info("%s.%s: %s left to the config's default", config_class.__name__, name, dropped)
                kwargs[name] = {"model_type": sub_class.model_type, **sub_kwargs}
    return kwargs


def valid_kwargs(config_class: type, kwargs: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None, str]:
    """``kwargs`` if the config validates with them; else without the one top-level field
    whose value it rejects (the first, in order, whose removal validates); else ``None``,
    with the first line of the validation error."""
    try:
        config_class(**kwargs)
        return kwargs, None, ""
    except Exception as e:  # noqa: BLE001 - transformers' validators raise several types
        error = f"{type(e).__name__}: " + next((ln.strip() for ln in str(e).splitlines()[::-1] if ln.strip()), "")
    for name in kwargs:
        fewer = {k: v for k, v in kwargs.items() if k != name}
        try:
            config_class(**fewer)
        except Exception:  # noqa: BLE001, S112
            continue
        return fewer, name, error
    return None, None, error


def extract(tests_dir: Path) -> dict[str, Any]:
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = init_defaults(tests_dir / "causal_lm_tester.py", "CausalLMModelTester")
    if base is None:
        raise SystemExit(f"no CausalLMModelTester in {tests_dir / 'causal_lm_tester.py'}")
    models: dict[str, Any] = {}
    for model_type, causal_lm_class in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        config_class = CONFIG_MAPPING[model_type]
        module = config_class.__module__.split(".")[-2]
        test_file = tests_dir / "models" / module / f"test_modeling_{module}.py"
        own = init_defaults(test_file, "ModelTester") if test_file.exists() else None
        attrs = {**base, **(own or {})}
        attrs["head_dim"] = attrs["hidden_size"] // attrs["num_attention_heads"]
        entry: dict[str, Any] = {
            "config_class": config_class.__name__,
            "causal_lm_class": causal_lm_class,
            "source": f"models/{module}/test_modeling_{module}.py" if own is not None else "causal_lm_tester.py",
        }
        kwargs, dropped, error = valid_kwargs(config_class, sub_config_kwargs(config_class, attrs))
        if kwargs is None:
            log.warning("%s: the tester's values do not make a valid config: %s", model_type, error)
            entry["error"] = error
        elif dropped:
            # the model's own tester sets a consistent value here; the config's default stands in
            log.info("%s: %s left to the config's default", model_type, dropped)
            entry["config_default"] = dropped
        entry["config"] = kwargs
        models[model_type] = entry
    return {"transformers_version": transformers.__version__, "models": models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests-dir", type=Path, required=True, help="transformers' tests/ folder")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    data = extract(args.tests_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    own = sum(m["source"] != "causal_lm_tester.py" for m in data["models"].values())
    log.info("%d model types (%d from their own tester) -> %s", len(data["models"]), own, args.out)


if __name__ == "__main__":
    main()
