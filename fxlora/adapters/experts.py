"""MoE experts: find them in a model, and turn each adapter format for them into per-expert
factors of the fused 3-D parameters.

An experts module is one ``transformers`` built with ``use_experts_implementation``: its
instances carry ``has_gate``, ``has_bias``, ``is_transposed`` and ``is_concatenated``, and
hold ``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj`` as ``(E, out, in)``
parameters, ``(E, in, out)`` when transposed. Each of the two is a pool target of its own,
named ``<experts>.<parameter>``. Experts that ``transformers`` built without an experts
implementation, whose forward loops over the experts the routing hits (LongCat-Flash's), are
found by what they hold and take (:func:`is_loop_experts`) and given the same flags
(:func:`mark_loop_experts`), read from their parameters' shapes. A segment GEMM
(:func:`is_segment_gemm`), the half of an older experts layout, holds one such parameter.

Adapter formats, all turned into ``LoraFactors("experts", a (E_a, r, in), b (E_b, out, r))``
(:mod:`fxlora.adapters.placement` finds which format and which parameter):

- PEFT ``target_parameters`` (``experts.gate_up_proj``, ``gate_up_proj``, ...): one wrapper
  per parameter; ``lora_A (E·r, in)`` holds expert ``e``'s rows at ``e·r …``,
  ``lora_B (out, r·E)`` its columns at ``… ·E + e``.
- The shared-outer layout: the same, with an expert dimension of 1 in one factor
  (``lora_A (r, in)`` or ``lora_B (out, r)``), shared by every expert.
- Per-expert modules as written against older layouts: ``experts.<e>.gate_proj`` /
  ``up_proj`` / ``down_proj``, or Mixtral's ``w1`` / ``w3`` / ``w2``. Gate and up LoRA of an
  expert become one LoRA of ``gate_up_proj`` of rank ``r_gate + r_up`` (``A`` stacked, ``B``
  block-diagonal, each block at its half's output rows).
"""

from __future__ import annotations

import inspect
import re

import torch

from fxlora.adapters.peft_format import LoraFactors
from fxlora.errors import AdapterError

PER_EXPERT_NAMES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
PER_EXPERT_KEY = re.compile(r"^(?P<experts>.+)\.(?P<e>\d+)\.(?P<proj>[a-z_0-9]+)$")


def is_experts(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated")) and (
        isinstance(getattr(module, "down_proj", None), torch.nn.Parameter)
    )


LOOP_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")
SEGMENTS = "_fxlora_segments"  # set on a module proven to be a segment GEMM
LAYOUT = "_fxlora_experts_layout"  # set on experts fxlora::moe_lora computes: the op's layout (its spec)


def is_segment_gemm(module: torch.nn.Module) -> bool:
    """A module the compiler proved to multiply each contiguous segment of its input's rows by
    one group's slice of its 3-D weight ``(groups, in, out)``, ``forward(x, counts)`` with the
    segments' lengths, looping over them on the host (transformers 5.17's Aria,
    ``AriaGroupedExpertsGemm``): :func:`fxlora.compiler.experts_op.mark_segment_gemms`."""
    return bool(getattr(module, SEGMENTS, None))


def segment_gemm_weight(module: torch.nn.Module) -> tuple[str, torch.nn.Parameter] | None:
    """The weight of a module that may be a segment GEMM: its one parameter, 3-D and plain,
    with a forward of two inputs; None for any other module."""
    params = list(module.named_parameters(recurse=False))
    if len(params) != 1 or is_experts(module) or any(True for _ in module.children()):
        return None
    name, weight = params[0]
    if weight.dim() != 3 or not weight.is_floating_point() or type(weight) is not torch.nn.Parameter:
        return None
    try:
        inputs = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = [p for p in inputs if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (name, weight) if len(positional) == len(inputs) == 2 else None


def is_loop_experts(module: torch.nn.Module) -> bool:
    """Experts ``transformers`` built without ``use_experts_implementation`` (whose wrapper
    keeps the class's own forward as ``__wrapped__``): a forward over :data:`LOOP_INPUTS` and
    fused ``gate_up_proj (E', 2·I, H)`` and ``down_proj (E, H, I)`` parameters, stored ``(E,
    out, in)`` as PEFT reads a 3-D parameter of a module that does not say ``is_transposed``.
    ``E' > E`` where routes past ``E`` go to parameter-free experts (LongCat-Flash's identity
    experts); the probe proves what the forward computes before anything is served."""
    forward = getattr(type(module), "forward", None)
    if forward is None or hasattr(forward, "__wrapped__"):
        return False
    try:
        inputs = tuple(inspect.signature(forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    up, down = (getattr(module, n, None) for n in ("gate_up_proj", "down_proj"))
    if inputs != LOOP_INPUTS or not all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in (up, down)):
        return False
    return up.shape[1] == 2 * down.shape[2] and up.shape[2] == down.shape[1]


def mark_loop_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Give each loop experts module of ``model`` (:func:`is_loop_experts`) the flags
    ``use_experts_implementation`` gives transformers' experts: a gate over concatenated halves
    (the probe rejects any other), weights stored ``(E, out, in)``, biases where it holds both.
    Returns the modules marked; :func:`unmark` takes the flags off again. The flags change
    nothing the module computes, nor how PEFT reads it."""
    marked = []
    for module in model.modules():
        if not is_experts(module) and is_loop_experts(module):
            module.has_gate, module.is_concatenated, module.has_post_expert_norm = True, True, False
            module.has_bias = all(isinstance(getattr(module, n, None), torch.nn.Parameter) for n in ("gate_up_proj_bias", "down_proj_bias"))
            module.is_transposed = False
            marked.append(module)
    return marked


MARKS = ("has_gate", "is_concatenated", "has_post_expert_norm", "has_bias", "is_transposed", SEGMENTS, LAYOUT, "forward")


def unmark(modules: list[torch.nn.Module]) -> None:
    """Take off what fxlora put on ``modules``: the flags of :func:`mark_loop_experts`, the
    segment GEMMs' mark, and the layout and forward the compiler gave either."""
    for module in modules:
        for name in MARKS:
            module.__dict__.pop(name, None)


def up_name(module: torch.nn.Module) -> str:
    """The name of the experts' up parameter: ``gate_up_proj``, or ``up_proj`` without a gate."""
    return "gate_up_proj" if module.has_gate else "up_proj"


def experts_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The experts' up (:func:`up_name`) and ``down_proj`` parameters."""
    up = up_name(module)
    return {up: getattr(module, up), "down_proj": module.down_proj}


def experts_biases(module: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The biases of the experts' up and down projections, or ``(None, None)`` without any."""
    if not module.has_bias:
        return None, None
    return getattr(module, f"{up_name(module)}_bias"), module.down_proj_bias


def gate_name(module: torch.nn.Module) -> str:
    """The code that gates these experts, for messages."""
    cls = type(module).__name__
    act = getattr(module, "act_fn", None)
    act = f", act_fn {getattr(act, '__name__', type(act).__name__)}" if act is not None else ""
    if not module.has_gate:
        return f"{cls}.act_fn{act}"
    return f"{cls}.forward{act}" if is_loop_experts(module) else f"{cls}._apply_gate{act}"


def in_out(module: torch.nn.Module, weight: torch.Tensor) -> tuple[int, int]:
    """``(in, out)`` features of a 3-D parameter as the module computes with it: ``(experts,
    out, in)`` as PEFT's ``target_parameters`` reads it, or ``(experts, in, out)`` where the
    module says ``is_transposed`` or is a segment GEMM (whose PEFT factors
    :func:`parameter_factors` turns round)."""
    _, d1, d2 = weight.shape
    return (d1, d2) if getattr(module, "is_transposed", False) or is_segment_gemm(module) else (d2, d1)


def parameter_factors(culprit: str, module: torch.nn.Module, name: str, a, b, r: int, scaling: float) -> LoraFactors:
    """The experts LoRA of ``module``'s parameter ``name`` from PEFT's ``target_parameters``
    factors of rank ``r`` (or the shared-outer layout); ``culprit`` names the adapter and the
    parameter in errors."""
    if is_experts(module) and name not in experts_parameters(module):
        raise AdapterError(f"{culprit}: only the experts' {sorted(experts_parameters(module))} are supported")
    weight = getattr(module, name)
    experts = weight.shape[0]
    turned = is_segment_gemm(module)  # PEFT reads (experts, out, in); the module computes x @ P[e]
    fin, fout = in_out(module, weight)[:: -1 if turned else 1]  # as PEFT reads it
    ea, eb = a.shape[0] // r, b.shape[1] // r
    fits = a.shape[0] % r == 0 and b.shape[1] % r == 0 and ea in (1, experts) and eb in (1, experts)
    if not fits or a.shape[1] != fin or b.shape[0] != fout:
        raise AdapterError(
            f"{culprit} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: shape mismatch, the parameter "
            f"({experts} experts, {fin} -> {fout}) at rank {r} needs ({experts}*{r} or {r}, {fin}) and "
            f"({fout}, {r}*{experts} or {r})"
        )
    a = a.reshape(ea, r, fin)
    b = b.reshape(fout, r, eb).permute(2, 0, 1)
    if turned:  # x @ (B A) = (x @ B) @ A: the LoRA of a linear whose factors are Bᵀ and Aᵀ
        a, b = b.transpose(1, 2), a.transpose(1, 2)
    fmt = "target_parameters" if ea == eb == experts else "shared-outer"
    return LoraFactors("experts", a, b, scaling, format=fmt)


def per_expert_factors(where, experts_fqn, module, parts) -> dict[str, LoraFactors]:
    """The experts LoRA of ``module``'s parameters from per-expert modules' LoRA, ``parts``
    keyed by ``(expert, "gate" | "up" | "down")``."""
    params = experts_parameters(module)
    up = up_name(module)
    count = params["down_proj"].shape[0]
    out = {}
    for name, halves in ((up, ("gate", "up") if module.has_gate else ("up",)), ("down_proj", ("down",))):
        weight = params[name]
        fin, fout = in_out(module, weight)
        got = {(e, p): f for (e, p), f in parts.items() if p in halves}
        if not got:
            continue
        rank = max(sum(got[(e, p)].rank for p in halves if (e, p) in got) for e in range(count))
        a = torch.zeros(count, rank, fin, dtype=next(iter(got.values())).a.dtype)
        b = torch.zeros(count, fout, rank, dtype=a.dtype)
        width = fout // len(halves)
        for e in range(count):
            col = 0
            for i, p in enumerate(halves):
                f = got.get((e, p))
                if f is None:
                    continue
                if f.a.shape[1] != fin or f.b.shape[0] != width:
                    raise AdapterError(
                        f"{where}: shape mismatch: LoRA of {experts_fqn}.{e} {p} has lora_A {tuple(f.a.shape)} and "
                        f"lora_B {tuple(f.b.shape)}, but {experts_fqn}.{name} needs (r, {fin}) and ({width}, r)"
                    )
                rows = _half_rows(module, i, len(halves), fout)
                a[e, col : col + f.rank] = f.a
                b[e, rows, col : col + f.rank] = f.b * f.scaling
                col += f.rank
        out[f"{experts_fqn}.{name}"] = LoraFactors("experts", a, b, 1.0, format="per-expert modules")
    return out


def _half_rows(module, i: int, halves: int, fout: int):
    """Output rows of half ``i`` (gate 0, up 1) of a fused up projection."""
    if halves == 1:
        return slice(None)
    if module.is_concatenated:
        return slice(i * fout // 2, (i + 1) * fout // 2)
    return slice(i, None, 2)
