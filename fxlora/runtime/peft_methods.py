"""transformers' PEFT methods on a model fxlora serves, routed through fxlora or refused.

A ``transformers`` model carries PEFT's adapter methods (``load_adapter``, ``add_adapter``,
``set_adapter``, ``delete_adapter``, ...). Left as they are, ``load_adapter`` injects PEFT's
LoRA layers into the model the compiled graphs were traced from, and every row's output
changes, base rows included. :func:`guard` replaces them on the model instance: loading and
deleting go through fxlora's pool (a hot swap, as ``CompiledModel.load_adapter``), the
methods that would switch the whole model to an adapter, or add an untrained one, raise
before anything changes.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fxlora.errors import AdapterError

Load = Callable[[str, Any], None]  # (adapter name, source)
Unload = Callable[[str], None]

PER_ROW = "fxlora picks an adapter per row: pass adapter_names= (fxlora.compile) or use fxlora.use_adapters (torch.compile)"
REFUSED = {
    "add_adapter": "it adds an untrained adapter for training; fxlora serves trained ones: load_adapter(path, adapter_name=...)",
    "set_adapter": PER_ROW,
    "enable_adapters": PER_ROW,
    "disable_adapters": PER_ROW + ", with None for the base model",
    "enable_peft_hotswap": "fxlora's load_adapter already swaps adapters in place, without retracing",
}


# model -> its compiled model's load and unload, held weakly: the compiled model holds the
# model, so strong values here would keep both alive for good
_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[weakref.WeakMethod, weakref.WeakMethod]] = weakref.WeakKeyDictionary()


def guard(model: torch.nn.Module, load: Load, unload: Unload) -> None:
    """Give ``model`` (the instance) fxlora's versions of transformers' PEFT methods, which
    ``load`` and ``unload`` adapters (bound methods of the compiled model, held weakly: once
    it is dropped, the methods refuse). A copy of the model (``copy.deepcopy``) is not served
    by fxlora: on it the methods are transformers' own again."""
    if model in _OWNERS and _OWNERS[model][0]() is not None:
        return
    check_no_peft_layers(model)
    _OWNERS[model] = (weakref.WeakMethod(load), weakref.WeakMethod(unload))
    for method in (*SERVED, *REFUSED):
        object.__setattr__(model, method, types.MethodType(_method(method), model))


def _load_adapter(load: Load, peft_model_id=None, adapter_name=None, peft_config=None, adapter_state_dict=None, **kwargs):
    if kwargs:
        raise TypeError(
            f"load_adapter: fxlora reads the adapter itself and takes no {sorted(kwargs)}: pass the adapter's "
            "directory (or peft_config= and adapter_state_dict=) and adapter_name="
        )
    name = adapter_name or "default"  # transformers' default name
    if peft_model_id is not None and (peft_config is not None or adapter_state_dict is not None):
        raise AdapterError(f"adapter {name!r}: pass a directory or peft_config= with adapter_state_dict=, not both")
    if peft_model_id is None and (peft_config is None or adapter_state_dict is None):
        raise AdapterError(f"adapter {name!r}: pass its directory, or both peft_config= and adapter_state_dict=")
    load(name, peft_model_id if peft_model_id is not None else (peft_config, adapter_state_dict))


def _delete_adapter(unload: Unload, adapter_names: str | list[str]) -> None:
    for name in [adapter_names] if isinstance(adapter_names, str) else list(adapter_names):
        unload(name)


SERVED = ("load_adapter", "delete_adapter")


def _method(method: str) -> Callable[..., Any]:
    """``method`` on a guarded model: fxlora's; on a copy of one, transformers' own."""

    def call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        owner = _OWNERS.get(self)
        if owner is None:
            return getattr(type(self), method)(self, *args, **kwargs)
        load, unload = owner[0](), owner[1]()
        if load is None or unload is None:
            raise AdapterError(f"{method}(): the fxlora compiled model that served this model was dropped; compile it again")
        if method == "load_adapter":
            return _load_adapter(load, *args, **kwargs)
        if method == "delete_adapter":
            return _delete_adapter(unload, *args, **kwargs)
        raise AdapterError(f"{method}() on a model fxlora serves is not supported: {REFUSED[method]}")

    call.__name__ = method
    return call


def check_no_peft_layers(model: torch.nn.Module) -> None:
    """Refuse a model into which PEFT's layers were injected (transformers' ``load_adapter``
    or ``add_adapter`` before fxlora saw it): they would run for every row."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return
    layer = next((n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)), None)
    if layer is not None or getattr(model, "_hf_peft_config_loaded", False):
        where = f" (e.g. {layer!r})" if layer else ""
        raise AdapterError(
            f"the model holds PEFT adapter layers{where}, injected by transformers' load_adapter or add_adapter: they "
            "would run for every row. Give fxlora the adapters instead (adapters= / options={'adapters': ...}, or "
            "load_adapter after compiling), or pass a peft.PeftModel to fxlora.compile"
        )
