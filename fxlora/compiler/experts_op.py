"""Forwards that trace, for experts modules none of transformers' implementations serves:
``fxlora::moe_lora`` itself with no adapter, or one grouped GEMM for a segment GEMM.

- Quantised experts (:func:`serve_quantized`). transformers' ``grouped_mm`` and
  ``batched_mm`` experts read the stacked weights with ops a quantised tensor subclass may not
  have (torchao's ``Int8Tensor`` has no ``transpose`` or ``bmm``), and its eager loop reads the
  routing on the host, which breaks the graph. Experts whose parameters are torchao subclasses
  get the implementation registered here as :data:`NAME`, whose base GEMMs dispatch to the
  subclass (:func:`fxlora.ops.moe_lora.serve_weights_of`): per expert ``select`` and
  ``F.linear``, as the eager loop computes them (on CPU), or the subclass's transpose and
  grouped GEMM, else its ``dequantize()`` and a grouped GEMM (on CUDA, capturable).
- Loop experts (:func:`serve_loops`): experts ``transformers`` built without an experts
  implementation, whose forward loops over the experts the routing hits (LongCat-Flash's, with
  identity experts): found and flagged by :mod:`fxlora.adapters.experts`, each gets the op as
  its forward (an instance attribute; the class is untouched).

- Segment GEMMs (:func:`mark_segment_gemms`, :func:`serve_segment_gemms`): a module that
  multiplies each segment of its input's rows by one group of its 3-D weight, looping over
  the segments on the host (transformers 5.17's Aria, ``AriaGroupedExpertsGemm``), proven so
  on a probe, gets one grouped GEMM as its forward (:func:`fxlora.ops.grouped_mm.traceable_grouped_mm`);
  the ``lora_parameters`` pass serves its weight's LoRA.

The traced region of experts is then one op reading the experts' parameters, which the ``lora_moe`` pass
serves as any other, the LoRA deltas added after each GEMM, before the gate and before the
routed sum. Each module is checked before anything changes: the layout that computes as the
module does (:func:`fxlora.compiler.experts_probe.choose_layout`) and the op, with no adapter,
against the module's own ``forward`` on a probe
(:func:`fxlora.compiler.experts_probe.prove_region`); the proven layout stays on the module
(:data:`LAYOUT`).
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.adapters import experts
from fxlora.adapters.experts import LAYOUT
from fxlora.compiler.experts_probe import PROBE_RTOL, choose_layout, probe_like, prove_region, relative_error
from fxlora.errors import NotServed, QuantizationError
from fxlora.ops.grouped_mm import grouped_mm_reference, traceable_grouped_mm
from fxlora.ops.moe_lora import serve_weights_of

NAME = "fxlora_moe_lora"

log = logging.getLogger(__name__)


def forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts implementation :data:`NAME`, and the forward of loop experts: the routed
    experts by ``fxlora::moe_lora``."""
    up, down = experts.experts_parameters(self).values()
    up_bias, down_bias = experts.experts_biases(self)
    no_adapter = torch.full((hidden_states.shape[0],), -1, dtype=torch.int32, device=hidden_states.device)
    return torch.ops.fxlora.moe_lora(  # the packet: a call without adapters is no LoRA op (LORA_OPS)
        hidden_states, top_k_index, top_k_weights, up, up_bias, down, down_bias, [], [], no_adapter, getattr(self, LAYOUT)
    )


def serve_quantized(model: torch.nn.Module, method: str) -> None:
    """Give the experts of ``model``, quantised by ``method``, the implementation :data:`NAME`
    (all of them: the implementation is the model's). Raises :class:`QuantizationError` naming
    the method and the module when the op cannot compute one as its own code does; the model
    is unchanged then."""
    layouts = {}
    for fqn, module in model.named_modules():
        if not experts.is_experts(module):
            continue
        for weight in experts.experts_parameters(module).values():
            if is_traceable_wrapper_subclass(weight):
                serve_weights_of(type(weight))
        try:
            layout = choose_layout(module)
            prove_region(module, layout, probe_like(module, model), [], [])
        except NotServed as why:
            kinds = sorted({type(w).__name__ for w in experts.experts_parameters(module).values()})
            raise QuantizationError(
                f"the base model is quantised ({method}) and the experts module {fqn!r} holds {', '.join(kinds)} "
                f"weights, which fxlora::moe_lora cannot compute as the module does: {why}"
            ) from None
        layouts[module] = layout.spec
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # slow to import: only for a quantised MoE model

    ALL_EXPERTS_FUNCTIONS.register(NAME, forward)
    for module, layout in layouts.items():
        setattr(module, LAYOUT, layout)
    model.set_experts_implementation(NAME)


def serve_loops(model: torch.nn.Module) -> list[str]:
    """Give each loop experts module of ``model`` the op as its forward, with the layout that
    computes as its own forward does; returns their names. A module no layout computes keeps
    its loop (which breaks the graph: a LoRA on it was refused before, by the gate check)."""
    served = []
    for fqn, module in model.named_modules():
        if experts.is_experts(module) and experts.is_loop_experts(module) and "forward" not in vars(module):
            try:
                layout = choose_layout(module)
            except NotServed as why:
                log.info("the experts module %r loops over its experts, and fxlora::moe_lora cannot compute it: %s", fqn, why)
                continue
            setattr(module, LAYOUT, layout.spec)
            module.forward = types.MethodType(forward, module)
            served.append(fqn)
    return served


def mark_segment_gemms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Mark each module of ``model`` that computes as a segment GEMM
    (:func:`fxlora.adapters.experts.is_segment_gemm`): its forward, on a probe of random rows
    in segments of several lengths (none empty too), against ``x[segment g] @ weight[g]``.
    Returns the modules marked (:func:`fxlora.adapters.experts.unmark` takes the mark off). The
    mark changes nothing the module computes; the pool reads its weight's LoRA as the module
    computes with it."""
    marked = []
    for module in model.modules():
        found = experts.segment_gemm_weight(module)
        if found is not None and not experts.is_segment_gemm(module) and _computes_segments(module, found[1]):
            setattr(module, experts.SEGMENTS, True)
            marked.append(module)
    return marked


def _computes_segments(module: torch.nn.Module, weight: torch.Tensor) -> bool:
    """Whether the module's forward, and :func:`segments_forward` in its place, both give
    ``x[segment g] @ weight[g]`` on two probes: every segment of 1 to 3 rows, then the same
    with the first segment empty."""
    groups, fin, _ = weight.shape
    gen = torch.Generator().manual_seed(0)
    full = torch.arange(groups) % 3 + 1
    for counts in (full, torch.cat([full.new_zeros(1), full[1:]])):
        if not counts.sum():
            continue
        x = torch.randn(int(counts.sum()), fin, generator=gen).to(weight.device, weight.dtype)
        counts = counts.to(weight.device)
        with torch.no_grad():
            want = grouped_mm_reference(x, weight, torch.cumsum(counts, 0, dtype=torch.int32))
            for run in (module, functools.partial(segments_forward, module)):
                try:
                    got = run(x, counts)
                except Exception:  # noqa: BLE001 - a module that does not take (rows, counts) is no segment GEMM
                    return False
                if not isinstance(got, torch.Tensor) or got.shape != want.shape or relative_error(got, want) > _allowed(weight):
                    return False
    return True


def _allowed(weight: torch.Tensor) -> float:
    return PROBE_RTOL.get(weight.dtype, PROBE_RTOL[torch.float16])


def segments_forward(self: torch.nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The forward of a segment GEMM: one grouped GEMM, with no read of the counts on the host."""
    weight = experts.segment_gemm_weight(self)[1]
    return traceable_grouped_mm(x, weight, torch.cumsum(counts, 0, dtype=torch.int32))


def serve_segment_gemms(model: torch.nn.Module) -> list[str]:
    """Give each marked segment GEMM of ``model`` :func:`segments_forward` as its forward;
    returns their names."""
    served = []
    for fqn, module in model.named_modules():
        if experts.is_segment_gemm(module) and "forward" not in vars(module):
            module.forward = types.MethodType(segments_forward, module)
            served.append(fqn)
    return served
