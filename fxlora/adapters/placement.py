"""Place an adapter on the model: what only the model tells about its LoRA.

PEFT saves a ``target_parameters`` LoRA under the path of a wrapper module, one wrapper per
adapted parameter, nested in the order the owning module registered its parameters (the
first innermost, ``<owner>.base_layer…``). Which parameter a wrapper adapts follows from the
owner's parameters and PEFT's matching of ``target_parameters`` (a parameter's path equal to
an entry, or ending in ``"." + entry``: a bare ``"gate_up_proj"`` names that parameter of
every module), and from it the rank and scaling: PEFT looks ``rank_pattern`` /
``alpha_pattern`` up by the parameter's path. Then:

- a 3-D parameter of an experts module becomes an experts LoRA
  (:func:`fxlora.adapters.experts.parameter_factors`);
- a 2-D parameter ``W (out, in)`` becomes ``W + scaling · B @ A`` in PEFT, which in
  ``F.linear(x, W)`` is the linear LoRA ``scaling · (x Aᵀ) Bᵀ``: it is served as the linear
  LoRA of its module when that is an ``nn.Linear`` (its ``weight``), or a module holding that
  one 2-D parameter (an MoE router; :meth:`ModuleInfo.over_parameter`), whose ``F.linear``
  over it the passes then look for;
- anything else is refused, naming the adapter, the module and the parameter.

Per-expert modules (``experts.<e>.gate_proj`` ...) become experts LoRA as well.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from fxlora.adapters import experts
from fxlora.adapters.modules import ModuleInfo
from fxlora.adapters.peft_format import (
    LoraAdapter,
    LoraFactors,
    all_linear,
    all_linear_selects,
    module_factors,
    rank_and_scaling,
    targets_parameter,
    unwrapped,
)
from fxlora.errors import AdapterError


def resolve(adapter: LoraAdapter, model: torch.nn.Module) -> LoraAdapter:
    """``adapter`` with every LoRA keyed by what the model's pool targets: each
    ``target_parameters`` wrapper's by its parameter (``<experts>.<parameter>``, or the module
    of a linear over a 2-D parameter), per-expert modules' by their experts' parameters;
    other modules unchanged."""
    modules = dict(model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    where = f"adapter {adapter.name!r} ({adapter.source})"
    out: dict[str, LoraFactors] = {}
    per_expert: dict[str, dict[tuple[int, str], LoraFactors]] = defaultdict(dict)

    def put(fqn: str, factors: LoraFactors, key: str) -> None:
        if fqn in out:
            raise AdapterError(f"{where}: {key!r} and another entry both hold LoRA of {fqn!r}")
        out[fqn] = factors

    for key, f in adapter.modules.items():
        m = experts.PER_EXPERT_KEY.match(key)
        if f.kind == "parameter":
            put(*_from_wrapper(where, adapter, key, f, modules, head), key)
        elif key not in modules and m and m["experts"] in modules and experts.is_experts(modules[m["experts"]]):
            proj = experts.PER_EXPERT_NAMES.get(m["proj"])
            if proj is None:
                raise AdapterError(f"{where}: module {key!r}: {m['proj']!r} is not an expert projection")
            per_expert[m["experts"]][(int(m["e"]), proj)] = f
        else:
            if f.kind == "linear" and head is not None and modules.get(key) is head and all_linear(adapter.config.target_modules):
                raise AdapterError(  # read without the model, the head looked like any linear
                    f"{where}: holds weights for module {key!r}, the model's output head, which its target_modules "
                    "'all-linear' leaves out, as PEFT does (PEFT would not load them): name it in target_modules to serve it"
                )
            put(key, f, key)
    for owner, parts in per_expert.items():
        for fqn, factors in experts.per_expert_factors(where, owner, modules[owner], parts).items():
            put(fqn, factors, f"{owner}.<e>")
    if out.keys() == adapter.modules.keys() and all(out[k] is f for k, f in adapter.modules.items()):
        return adapter
    return dataclasses.replace(adapter, modules=out)


def _from_wrapper(where, adapter: LoraAdapter, key: str, f: LoraFactors, modules, head) -> tuple[str, LoraFactors]:
    config = adapter.config
    owner = unwrapped(key)
    module = modules.get(owner)
    if module is None:
        raise AdapterError(f"{where}: holds target_parameters LoRA {key!r}, but the model has no module {owner!r}")
    depth = (len(key) - len(owner)) // len(".base_layer")
    targeted = [p for p, _ in module.named_parameters(recurse=False) if targets_parameter(config, f"{owner}.{p}")]
    if not targeted and depth == 0 and _picked_by_all_linear(config, module, head):
        # "all-linear" names modules by type: this one is a linear module of its own
        return key, module_factors(adapter.name, adapter.source, config, key, "linear", f.a, f.b)
    if depth >= len(targeted):
        names = [p for p, _ in module.named_parameters(recurse=False)]
        raise AdapterError(
            f"{where}: holds LoRA {key!r}, which is neither a module its target_modules select nor the wrapper of a "
            f"parameter its target_parameters {sorted(config.target_parameters or ())} name: {owner!r} holds "
            f"{names}, of which {targeted} are named"
        )
    name = targeted[len(targeted) - 1 - depth]
    weight = getattr(module, name)
    r, scaling = rank_and_scaling(config, f"{owner}.{name}")
    culprit = f"{where}: target_parameters LoRA of {owner}.{name}"
    kind = f"{type(module).__name__}'s {tuple(weight.shape)} parameter"
    if weight.dim() == 3:  # the graph tells how it is used (the passes refuse what they cannot read)
        return f"{owner}.{name}", experts.parameter_factors(culprit, module, name, f.a, f.b, r, scaling)
    if weight.dim() != 2:
        raise AdapterError(f"{culprit} ({kind}): PEFT adapts 2-D and 3-D parameters only")
    fout, fin = weight.shape
    if tuple(f.a.shape) != (r, fin) or tuple(f.b.shape) != (fout, r):
        raise AdapterError(
            f"{culprit} has lora_A {tuple(f.a.shape)} and lora_B {tuple(f.b.shape)}: shape mismatch, the parameter "
            f"({fout}, {fin}) at rank {r} needs ({r}, {fin}) and ({fout}, {r})"
        )
    if not _linear_over(module, name):
        raise AdapterError(
            f"{culprit} ({kind}): not supported: LoRA of a 2-D parameter is served as the LoRA of a linear over it, "
            "the weight of an nn.Linear or the one 2-D parameter of a module whose forward calls F.linear on it"
        )
    return owner, LoraFactors("linear", f.a, f.b, scaling)


def _picked_by_all_linear(config, module: torch.nn.Module, head: torch.nn.Module | None) -> bool:
    info = ModuleInfo.of(module)
    return info is not None and all_linear_selects(config.target_modules, info.kind, info.parameter, module is head)


def _linear_over(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s 2-D parameter ``name`` is the weight of a linear the pool serves."""
    if isinstance(module, torch.nn.Linear):
        return name == "weight"
    if experts.is_experts(module):
        return False
    info = ModuleInfo.of(module) or ModuleInfo.over_parameter(module)
    return info is not None and info.parameter == name
