"""The proof ``lora_moe`` asks for before ``fxlora::moe_lora`` replaces an experts region:
the op, with no adapter, computes what the module's own code computes.

In a mixed batch the rows without an adapter run the op too, so the op must reproduce the
module, not fxlora's reading of it (a class may hard-code an activation its config names
otherwise). Two checks, on fixed random inputs (seeded, a few dozen values each):

- :func:`choose_layout`: the gate alone, in float64, against the module's ``_apply_gate``
  (``act_fn`` for experts without a gate), over values on both sides of any clamp; it picks
  the first of :func:`fxlora.adapters.experts.layouts`'s candidates that agrees.
- :func:`prove_region`: the whole block — both projections, the gate, the routed sum — in the
  traced dtypes, the op against the module's ``forward``, with every expert routed to. For
  experts sharded between tensor-parallel ranks the op runs on the local shards and the
  ranks' outputs are summed, as the module's own all-reduce sums them.

Either raises :class:`NotServed` saying what differs, and the region stays as traced.
"""

from __future__ import annotations

import dataclasses

import torch

from fxlora.adapters import experts
from fxlora.adapters.experts import ExpertsLayout
from fxlora.adapters.sharding import agree, local_tensor, process_group
from fxlora.errors import NotServed
from fxlora.ops.moe_lora import apply_gate, local_routing

# Relative error allowed between the op and the module's forward on the probe, per dtype:
# the two round in a different order (grouped vs per-expert GEMMs), nothing more. A wrong
# activation or gate is off by percents, and the float64 gate check catches finer ones.
PROBE_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def choose_layout(module: torch.nn.Module) -> ExpertsLayout:
    """The layout whose gate computes what the module's gate computes, in float64."""
    candidates = experts.layouts(module)
    device = next(iter(experts.experts_parameters(module).values())).device
    h = _gate_probe(max(c.limit for c in candidates)).to(device)
    try:
        with torch.no_grad():
            want = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    except (RuntimeError, TypeError, ValueError) as e:
        raise NotServed(f"its gate ({experts.gate_name(module)}) does not run on a float64 probe: {e}") from None
    for layout in candidates:
        got = apply_gate(h, layout.gate, layout.act, layout.alpha, layout.limit)
        if isinstance(want, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-7, atol=1e-10):
            return layout
    tried = sorted({c.gate for c in candidates})
    raise NotServed(
        f"its gate ({experts.gate_name(module)}) computes none of the gates fxlora::moe_lora knows "
        f"(tried {', '.join(tried)} with the module's activation and clamp parameters)"
    )


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
        f"fxlora::moe_lora with the layout read from it ({_describe(layout)}) differs from {type(module).__name__}.forward "
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
            want = module(hidden, index, weights)
        except Exception as e:  # noqa: BLE001 - whatever the module's code raises, it cannot be checked
            want = f"its forward ({name}.forward) does not run on a probe: {type(e).__name__}: {e}"
        try:
            ours = (index, weights) if first is None else local_routing(index, weights, first, mine[1])
            got = torch.ops.fxlora.moe_lora.default(
                hidden, *ours, local_tensor(up), biases[0], local_tensor(down), biases[1], up_lora, down_lora,
                no_adapter, **dataclasses.asdict(layout),
            )  # fmt: skip
        except RuntimeError as e:  # e.g. weights whose shapes the layout reads the wrong way round
            got = f"fxlora::moe_lora with the layout read from it ({_describe(layout)}) does not run on a probe: {e}"
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
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _gate_probe(limit: float) -> torch.Tensor:
    """Gate inputs in float64: rows at scales from well inside to well beyond ``limit``."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.3, 1.0, 3.0, 10.0, 3 * limit if limit > 0 else 30.0], dtype=torch.float64)
    return torch.randn(len(scales) * 8, 8, generator=gen, dtype=torch.float64) * scales.repeat_interleave(8)[:, None]


def _hint(size) -> int:
    return size if isinstance(size, int) else int(size.node.hint)


def _describe(layout: ExpertsLayout) -> str:
    fields = dataclasses.asdict(layout)
    return ", ".join(f"{k}={v!r}" for k, v in fields.items() if v not in ("", 0.0) or k in ("transposed", "gate"))
