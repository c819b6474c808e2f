"""MoE experts: find them in a model, and turn each adapter format for them into per-expert
factors of the fused 3-D parameters.

An experts module is one ``transformers`` built with ``use_experts_implementation``: its
instances carry ``has_gate``, ``has_bias``, ``is_transposed`` and ``is_concatenated``, and
hold ``gate_up_proj`` (or ``up_proj`` without a gate) and ``down_proj`` as ``(E, out, in)``
parameters, ``(E, in, out)`` when transposed. Each of the two is a pool target of its own,
named ``<experts>.<parameter>``.

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

import dataclasses
import re

import torch

from fxlora.adapters.peft_format import LoraFactors
from fxlora.errors import AdapterError, NotServed

PER_EXPERT_NAMES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
PER_EXPERT_KEY = re.compile(r"^(?P<experts>.+)\.(?P<e>\d+)\.(?P<proj>[a-z_0-9]+)$")


def is_experts(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated")) and (
        isinstance(getattr(module, "down_proj", None), torch.nn.Parameter)
    )


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


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How ``fxlora::moe_lora`` computes an experts module: its layout scalars, named as the
    op's schema names them (the ``lora_moe`` pass hands them over by name)."""

    transposed: bool  # weights stored (E, in, out)
    gate: str  # one of fxlora.ops.moe_lora.GATES
    act: str  # a transformers activation name ("" for GPT-OSS's built-in gate)
    alpha: float = 0.0  # GPT-OSS's gate: sigmoid(alpha · gate); glu_softcapped: the gate's softcap
    limit: float = 0.0  # the clamped gates' limit; glu_softcapped: the up half's softcap


def layouts(module: torch.nn.Module) -> list[ExpertsLayout]:
    """The layouts ``fxlora::moe_lora`` knows that these experts may have, most likely first,
    read from what the module holds: its flags, its own activation (``act_fn``, not the
    config's ``hidden_act``, which a class may ignore) and its clamp parameters. None is
    taken on trust: the compiler keeps the one that computes as the module does. Raises
    :class:`NotServed` when the module has nothing the op could compute."""
    if getattr(module, "has_post_expert_norm", False):
        raise NotServed("a norm after each expert (has_post_expert_norm) is not supported")
    transposed = bool(module.is_transposed)
    alpha = _number(module, "alpha", "swiglu_alpha")
    limit = _number(module, "limit", "swiglu_limit")
    act_fn = getattr(module, "act_fn", None)
    if act_fn is not None:
        named = activation_name(act_fn)
        acts = [named] if named is not None else []
    else:  # a gate that calls its activation itself (HY-V4's F.silu): any the op knows
        acts = list(_activations())
    candidates: list[ExpertsLayout] = []
    if not module.has_gate:
        candidates += [ExpertsLayout(transposed, "act", a) for a in acts]
    elif module.is_concatenated:
        candidates += [ExpertsLayout(transposed, "glu", a) for a in acts]
        caps = [_number(getattr(act_fn, n, None), "softcap") for n in ("gate_softcap", "up_softcap")]
        if all(caps):  # a SwiGLU with soft-capped factors (Inkling2)
            candidates.append(ExpertsLayout(transposed, "glu_softcapped", "", *caps))
        if limit is not None:
            candidates += [ExpertsLayout(transposed, "glu_clamped", a, limit=limit) for a in acts]
            if alpha is not None:
                candidates.append(ExpertsLayout(transposed, "glu_concatenated_clamped", "", alpha, limit))
    elif alpha is not None and limit is not None:
        candidates.append(ExpertsLayout(transposed, "glu_interleaved_clamped", "", alpha, limit))
    if not candidates:
        raise NotServed(f"its gate ({gate_name(module)}) is not one fxlora::moe_lora knows")
    return candidates


def gate_name(module: torch.nn.Module) -> str:
    """The code that gates these experts, for messages."""
    cls = type(module).__name__
    act = getattr(module, "act_fn", None)
    act = f", act_fn {getattr(act, '__name__', type(act).__name__)}" if act is not None else ""
    return f"{cls}._apply_gate{act}" if module.has_gate else f"{cls}.act_fn{act}"


def activation_name(fn) -> str | None:
    """The ``transformers`` activation name (``ACT2FN``) computing what ``fn`` computes, or None.
    Same-class entries are tried first; an entry counts when it agrees with ``fn`` on a fixed
    spread of float64 values (``gelu`` and ``gelu_new`` differ there by 1e-3; aliases such as
    ``silu`` / ``swish`` agree bit for bit)."""
    x = torch.linspace(-12.0, 12.0, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            want = fn(x)
    except (RuntimeError, TypeError, ValueError):  # not a one-argument elementwise function
        return None
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return None
    names = sorted(_activations(), key=lambda n: type(_activations()[n]) is not type(fn))
    for name in names:
        with torch.no_grad():
            got = _activations()[name](x)
        if torch.allclose(got, want, rtol=1e-9, atol=1e-12):
            return name
    return None


_ACTIVATIONS: dict[str, torch.nn.Module] = {}


def _activations() -> dict[str, torch.nn.Module]:
    """One instance of every parameter-free ``ACT2FN`` activation (learned ones, PReLU's and
    xIELU's, cannot stand for a module's own)."""
    if not _ACTIVATIONS:
        from transformers.activations import ACT2FN
        from transformers.utils import logging

        verbosity = logging.get_verbosity()
        logging.set_verbosity_error()  # xIELU warns, on being made, that its CUDA kernel is absent
        try:
            made = {name: ACT2FN[name] for name in ACT2FN}
        finally:
            logging.set_verbosity(verbosity)
        _ACTIVATIONS.update({n: fn for n, fn in made.items() if not any(True for _ in fn.parameters())})
    return _ACTIVATIONS


def _number(module: torch.nn.Module | None, *names: str) -> float | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def in_out(module: torch.nn.Module, weight: torch.Tensor) -> tuple[int, int]:
    _, d1, d2 = weight.shape
    return (d1, d2) if module.is_transposed else (d2, d1)


def parameter_factors(culprit: str, module: torch.nn.Module, name: str, a, b, r: int, scaling: float) -> LoraFactors:
    """The experts LoRA of ``module``'s parameter ``name`` from PEFT's ``target_parameters``
    factors of rank ``r`` (or the shared-outer layout); ``culprit`` names the adapter and the
    parameter in errors."""
    params = experts_parameters(module)
    if name not in params:
        raise AdapterError(f"{culprit}: only the experts' {sorted(params)} are supported")
    weight = params[name]
    experts = weight.shape[0]
    fin, fout = in_out(module, weight)
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
