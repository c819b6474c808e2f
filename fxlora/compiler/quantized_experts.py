"""Quantised MoE experts: an experts implementation that traces, whose GEMMs stay the
quantised weights' own.

transformers' ``grouped_mm`` and ``batched_mm`` experts read the stacked weights with ops a
quantised tensor subclass may not have (torchao's ``Int8Tensor`` has no ``transpose`` or
``bmm``), and its eager loop reads the routing on the host, which breaks the graph. Experts
whose parameters are torchao subclasses get instead the implementation registered here as
:data:`NAME`: ``fxlora::moe_lora`` with no adapter, whose base GEMMs dispatch to the subclass
(:func:`fxlora.ops.moe_lora.serve_weights_of`): per expert ``select`` and ``F.linear``, as the
eager loop computes them (on CPU), or the subclass's transpose and grouped GEMM, else its
``dequantize()`` and a grouped GEMM (on CUDA, capturable). The traced region is then one op
reading the experts' parameters, which the ``lora_moe`` pass serves as any other, the LoRA
deltas added after each GEMM, before the gate and before the routed sum.

:func:`serve` checks each module before anything changes: the layout its gate computes
(:func:`fxlora.compiler.experts_probe.choose_layout`) and the op, with no adapter, against the
module's own ``forward`` on a probe (:func:`fxlora.compiler.experts_probe.prove_region`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.adapters import experts
from fxlora.compiler.experts_probe import choose_layout, prove_region
from fxlora.errors import NotServed, QuantizationError
from fxlora.ops.moe_lora import serve_weights_of

NAME = "fxlora_moe_lora"
LAYOUT = "_fxlora_experts_layout"  # the module attribute holding the op's layout (its spec)


def forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts implementation :data:`NAME`: the routed experts by ``fxlora::moe_lora``."""
    up, down = experts.experts_parameters(self).values()
    up_bias, down_bias = experts.experts_biases(self)
    no_adapter = torch.full((hidden_states.shape[0],), -1, dtype=torch.int32, device=hidden_states.device)
    return torch.ops.fxlora.moe_lora(  # the packet: a call without adapters is no LoRA op (LORA_OPS)
        hidden_states, top_k_index, top_k_weights, up, up_bias, down, down_bias, [], [], no_adapter, getattr(self, LAYOUT)
    )


def serve(model: torch.nn.Module, method: str) -> None:
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
            prove_region(module, layout, _probe_like(model, module), [], [])
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


def _probe_like(model: torch.nn.Module, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values shaped and typed as the module's inputs (hidden states, top-k index and weights),
    for :func:`prove_region` to draw its probe from."""
    up = experts.experts_parameters(module)[experts.up_name(module)]
    dtype = up.dtype if up.dtype.is_floating_point else model.dtype
    top_k = getattr(model.config, "num_experts_per_tok", None) or 2
    fin = experts.in_out(module, up)[0]
    return torch.empty(1, fin, dtype=dtype), torch.empty(1, top_k, dtype=torch.long), torch.empty(1, top_k, dtype=dtype)
