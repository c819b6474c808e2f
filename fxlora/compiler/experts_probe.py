"""The proof ``lora_moe`` asks for before ``fxlora::moe_lora`` replaces an experts region:
the op, with no adapter, computes what the module's own code computes. :func:`layouts` reads
the candidate :class:`~fxlora.ops.moe_lora.ExpertsLayout` from what the module holds.

In a mixed batch the rows without an adapter run the op too, so the op must reproduce the
module, not fxlora's reading of it (a class may hard-code an activation its config names
otherwise). Two checks, on fixed random inputs (seeded, a few dozen values each):

- :func:`choose_layout`: the gate alone, in float64, against the module's ``_apply_gate``
  (``act_fn`` for experts without a gate), over values on both sides of any clamp; it picks
  the first of :func:`layouts`' candidates that agrees.
- :func:`prove_region`: the whole block — both projections, the gate, the routed sum — in the
  traced dtypes, the op against the module's ``forward``, with every expert routed to. For
  experts sharded between tensor-parallel ranks the op runs on the local shards and the
  ranks' outputs are summed, as the module's own all-reduce sums them.

Either raises :class:`NotServed` saying what differs, and the region stays as traced. Loop
experts (:func:`fxlora.adapters.experts.is_loop_experts`) have no gate of their own to check:
:func:`choose_layout` takes the first candidate :func:`prove_region` accepts. A module that
fxlora gave the op as its forward keeps the layout proven then (:data:`LAYOUT`).
"""

from __future__ import annotations

import dataclasses

import torch

from fxlora.adapters import experts
from fxlora.adapters.experts import LAYOUT
from fxlora.adapters.sharding import agree, local_tensor, process_group
from fxlora.errors import NotServed
from fxlora.ops.moe_lora import ExpertsLayout, apply_gate, local_routing

# Relative error allowed between the op and the module's forward on the probe, per dtype:
# the two round in a different order (grouped vs per-expert GEMMs), nothing more. A wrong
# activation or gate is off by percents, and the float64 gate check catches finer ones.
PROBE_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}



def choose_layout(module: torch.nn.Module) -> ExpertsLayout:
    """The layout whose gate computes what the module's gate computes, in float64; for loop
    experts, the first whose op computes what the module's forward computes."""
    if hasattr(module, LAYOUT):
        return ExpertsLayout.parse(getattr(module, LAYOUT))
    candidates = layouts(module)
    if module.has_gate and experts.is_loop_experts(module):
        return _first_proven(module, candidates)
    device = next(iter(experts.experts_parameters(module).values())).device
    h = _gate_probe(max((p for c in candidates for p in c.params), default=0.0)).to(device)
    try:
        with torch.no_grad():
            want = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    except (RuntimeError, TypeError, ValueError) as e:
        raise NotServed(f"its gate ({experts.gate_name(module)}) does not run on a float64 probe: {e}") from None
    for layout in candidates:
        got = apply_gate(h, layout)
        if isinstance(want, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-7, atol=1e-10):
            return layout
    tried = sorted({c.gate for c in candidates})
    raise NotServed(
        f"its gate ({experts.gate_name(module)}) computes none of the gates fxlora::moe_lora knows "
        f"(tried {', '.join(tried)} with the module's activation and clamp parameters)"
    )


def _first_proven(module: torch.nn.Module, candidates: list[ExpertsLayout]) -> ExpertsLayout:
    why = None
    for layout in candidates:
        try:
            prove_region(module, layout, probe_like(module), [], [])
        except NotServed as e:
            why = why or e
        else:
            return layout
    raise why


def probe_like(module: torch.nn.Module, model: torch.nn.Module | None = None) -> tuple[torch.Tensor, ...]:
    """Values shaped and typed as an experts module's inputs (hidden states, top-k index and
    weights), for :func:`prove_region` to draw its probe from: the model's dtype where the
    weights are quantised, and its config's ``num_experts_per_tok`` (else 2) routes a token."""
    up = experts.experts_parameters(module)[experts.up_name(module)]
    dtype = up.dtype if up.dtype.is_floating_point or model is None else model.dtype
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None) or 2
    fin = experts.in_out(module, up)[0]
    return torch.empty(1, fin, dtype=dtype), torch.empty(1, top_k, dtype=torch.long), torch.empty(1, top_k, dtype=dtype)


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
            candidates.append(ExpertsLayout(transposed, "glu_softcapped", "", tuple(caps)))
        if limit is not None:
            candidates += [ExpertsLayout(transposed, "glu_clamped", a, (limit,)) for a in acts]
            if alpha is not None:
                candidates.append(ExpertsLayout(transposed, "glu_concatenated_clamped", "", (alpha, limit)))
    elif alpha is not None and limit is not None:
        candidates.append(ExpertsLayout(transposed, "glu_interleaved_clamped", "", (alpha, limit)))
    if not candidates:
        raise NotServed(f"its gate ({experts.gate_name(module)}) is not one fxlora::moe_lora knows")
    params = list(experts.experts_parameters(module).values())
    if params[0].shape[0] > params[1].shape[0]:  # more up experts than down: routes past down's go to identity experts
        candidates = [dataclasses.replace(c, identity=True) for c in candidates]
    return candidates


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


def prove_region(
    module: torch.nn.Module,
    layout: ExpertsLayout,
    traced: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    up_lora: list[torch.Tensor],
    down_lora: list[torch.Tensor],
    mine: tuple[int, int] | None = None,
) -> int | None:
    """Raise :class:`NotServed` unless ``fxlora::moe_lora`` with ``layout`` and no adapter
    gives the module's ``forward`` output on a probe shaped as the ``traced`` (fake) hidden
    states, top-k index and top-k weights.

    ``mine``: the first of this rank's experts and their count, when experts are split between
    ranks. The module's routes may then number the model's experts (transformers' ``ep_size``
    plan keeps a rank's routes inside the experts module) or this rank's (older plans renumber
    them in the router, sending other ranks' routes to the sentinel ``count``): both are probed,
    on every rank alike since each probe runs collectives. Returns the number that the routes
    the region reads give this rank's first expert (None without ``mine``)."""
    hidden_val, index_val, weights_val = traced
    params = experts.experts_parameters(module)
    up_name = experts.up_name(module)
    up = params[up_name]
    count, fin = up.shape[0], experts.in_out(module, up)[0]  # a DTensor's shape is the whole parameter's
    top_k = min(_hint(index_val.shape[-1]), count)
    tokens = max(2, -(-count // top_k))  # every expert gets a token
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, fin, generator=gen)
    experts_of = torch.randperm(count, generator=gen)[torch.arange(tokens * top_k) % count].view(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    device = up.device
    hidden = hidden.to(device, hidden_val.dtype)
    index = experts_of.to(device, index_val.dtype)
    weights = (weights / weights.sum(-1, keepdim=True)).to(device, weights_val.dtype)
    probes = [(index, weights, None)]
    if mine is not None:
        first, local = mine
        ours = (index >= first) & (index < first + local)
        probes = [(index, weights, first), (torch.where(ours, index - first, local), weights.masked_fill(~ours, 0.0), 0)]
    errors = [_compare(module, layout, hidden, routes, up_lora, down_lora, mine) for routes in probes]
    allowed = PROBE_RTOL.get(hidden.dtype, PROBE_RTOL[torch.float16])
    for error, (_, _, first) in zip(errors, probes):
        if isinstance(error, float) and error <= allowed:
            return first
    measured = [e for e in errors if isinstance(e, float)]
    if not measured:
        raise NotServed(errors[0])
    raise NotServed(
        f"fxlora::moe_lora with the layout read from it ({layout}) differs from {type(module).__name__}.forward "
        f"by {min(measured):.2g} on a probe (allowed {allowed:g})"
    )


def _compare(module, layout, hidden, routes, up_lora, down_lora, mine) -> float | str:
    """The op's relative error against the module's forward on ``routes`` (index, weights,
    and the number of this rank's first expert in them), or why either does not run."""
    index, weights, first = routes
    up, down = experts.experts_parameters(module).values()
    biases = experts.experts_biases(module)
    no_adapter = torch.full((hidden.shape[0],), -1, dtype=torch.int32, device=hidden.device)
    name = type(module).__name__
    group = process_group(module)
    with torch.no_grad():
        try:
            # loop experts: their own loop, not the op fxlora gave them; others as called (TP's wrappers included)
            own = type(module).forward.__get__(module) if experts.is_loop_experts(module) else module
            want = own(hidden, index, weights)
        except Exception as e:  # noqa: BLE001 - whatever the module's code raises, it cannot be checked
            want = f"its forward ({name}.forward) does not run on a probe: {type(e).__name__}: {e}"
        try:
            ours = (index, weights) if first is None else local_routing(index, weights, first, mine[1])
            got = torch.ops.fxlora.moe_lora.default(
                hidden, *ours, local_tensor(up), biases[0], local_tensor(down), biases[1], up_lora, down_lora,
                no_adapter, layout.spec,
            )  # fmt: skip
        except RuntimeError as e:  # e.g. weights whose shapes the layout reads the wrong way round
            got = f"fxlora::moe_lora with the layout read from it ({layout}) does not run on a probe: {e}"
        if group is not None:  # each rank computed its part of the sum, if every rank computed it
            try:
                agree(RuntimeError(got) if isinstance(got, str) else None, group)
            except RuntimeError as e:
                got = str(e)
            else:
                torch.distributed.all_reduce(got, group=group)
    if isinstance(want, str) or isinstance(got, str):
        return want if isinstance(want, str) else got
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return f"its forward ({name}.forward) does not return the routed sum fxlora::moe_lora computes"
    return relative_error(got, want)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in float64 (0 where both are empty)."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _gate_probe(limit: float) -> torch.Tensor:
    """Gate inputs in float64: rows at scales from well inside to well beyond ``limit``."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.3, 1.0, 3.0, 10.0, 3 * limit if limit > 0 else 30.0], dtype=torch.float64)
    return torch.randn(len(scales) * 8, 8, generator=gen, dtype=torch.float64) * scales.repeat_interleave(8)[:, None]


def _hint(size) -> int:
    return size if isinstance(size, int) else int(size.node.hint)
