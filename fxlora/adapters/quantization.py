"""Quantised base models: which quantisation a model carries, and whether fxlora can add LoRA
onto each targeted module it quantised.

torchao replaces a linear's weight by a tensor subclass (``Int8Tensor``,
``IntxUnpackedToInt8Tensor``, ...); the trace keeps ``F.linear`` of that weight, which the
``lora_linear`` pass leaves as it is and adds the delta onto (``fxlora::lora_delta``). That is served, whether the
model came through transformers' ``TorchAoConfig`` or ``torchao.quantize_``; so is
bitsandbytes' 4-bit ``Linear4bit`` (``BitsAndBytesConfig(load_in_4bit=True)``, QLoRA's base),
whose forward traces as bitsandbytes' own ops and whose LoRA is kept in its compute dtype. A targeted
embedding or experts parameter quantised so, and a targeted module quantised by another
method (its own module class, a packed weight, a float8 weight in a plain parameter as
transformers' ``FineGrainedFP8Config`` leaves, whose kernels transformers fetches from the
Hub at run time, or a linear whose forward compressed-tensors wrapped to quantise on every
call), raises :class:`QuantizationError` when the model is compiled, naming the method and the
module. Checkpoints loaded with ``CompressedTensorsConfig(dequantize=True)`` or
``FineGrainedFP8Config(dequantize=True)`` (as transformers loads fine-grained FP8 on a machine
without an FP8 GPU) are plain models and served. torchao's float8 configs are the served FP8
path. Experts whose parameters are torchao subclasses (``FqnToConfig`` on
``experts.gate_up_proj`` / ``experts.down_proj``) run ``fxlora::moe_lora``, whose GEMMs are the
subclass's own (:mod:`fxlora.compiler.experts_op`), and carry LoRA as unquantised
experts do; experts quantised otherwise keep the model's implementation and carry none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fxlora.adapters import experts
from fxlora.adapters.modules import ModuleInfo
from fxlora.adapters.pool import AdapterPool
from fxlora.errors import QuantizationError

SERVED_METHODS = ("torchao",)


@dataclass(frozen=True)
class QuantizedBase:
    """What :func:`check_quantized` found: the method, the targeted linears whose quantised
    weights keep their traced matmul (the delta goes onto their outputs), the experts modules
    whose torchao parameters ``fxlora::moe_lora`` reads through their own ops, and the experts
    modules quantised otherwise (no LoRA there: they keep the model's experts loop)."""

    method: str
    modules: tuple[str, ...]
    experts: tuple[str, ...] = ()
    kept_experts: tuple[str, ...] = ()
    experts_formats: tuple[str, ...] = ()  # how the experts' parameters are held: their tensor classes and dtypes

    def describe(self) -> str:
        n = len(self.modules)
        line = f"the base model is quantised ({self.method})" + (
            f": {n} targeted linear(s) keep their quantised matmul, fxlora::lora_delta adds the LoRA delta onto their outputs"
            if n
            else "; none of its targeted linears is quantised"
        )
        if self.experts:
            line += (
                f"; {len(self.experts)} experts module(s) with quantised parameters ({_patterns(self.experts)}: "
                f"{', '.join(self.experts_formats)}) run fxlora::moe_lora on the quantised weights' own GEMMs"
            )
        if self.kept_experts:
            line += (
                f"; {len(self.kept_experts)} experts module(s) with quantised parameters ({_patterns(self.kept_experts)}) "
                "keep the model's experts implementation and carry no LoRA"
            )
        return line


def _patterns(fqns: tuple[str, ...]) -> str:
    """Module names with their layer numbers as ``*``: ``model.layers.*.mlp.experts``."""
    return ", ".join(sorted({re.sub(r"\.\d+(?=\.|$)", ".*", f) for f in fqns}))


def quantization_method(model: torch.nn.Module) -> str | None:
    """The model's quantisation as a name: transformers' ``quant_method`` and, for torchao,
    its config class (``"torchao Int8WeightOnlyConfig"``); ``"torchao"`` for weights
    ``torchao.quantize_`` replaced; None for an unquantised model."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None and getattr(model, "hf_quantizer", None) is not None:
        config = model.hf_quantizer.quantization_config
    if config is not None:
        fields = config if isinstance(config, dict) else vars(config)
        method = fields.get("quant_method")
        method = str(getattr(method, "value", method) or type(config).__name__)
        quant_type = fields.get("quant_type")
        if method == "torchao" and quant_type is not None:
            kind = quant_type if isinstance(quant_type, str) else type(quant_type).__name__
            if isinstance(quant_type, dict):  # a config read back from JSON: {"default": {"_type": ...}}
                kind = ", ".join(str(v.get("_type", k)) if isinstance(v, dict) else str(v) for k, v in quant_type.items())
            return f"torchao {kind}"
        return method
    if any(_torchao_weight(p) for p in model.parameters()):
        return "torchao"
    if any(_compressed_tensors_module(m) for m in model.modules()):  # its wrappers outlive a dequantised load
        return "compressed-tensors"
    if any(type(m).__module__.startswith("bitsandbytes") for m in model.modules()):  # its layers swapped in by hand
        return "bitsandbytes"
    return None


# where a method's checkpoints load as a plain model, the way to it
DEQUANTIZED = {
    "fp8": "; an FP8 checkpoint loaded with quantization_config=FineGrainedFP8Config(dequantize=True) is a plain "
    "model and served",
}


def check_quantized(model: torch.nn.Module, pool: AdapterPool, modules: dict[str, ModuleInfo]) -> QuantizedBase | None:
    """None for an unquantised model; else the method and the targeted linears it quantised.
    ``modules``: the model's, about to be registered with ``pool``, which decides the targets.
    Raises :class:`QuantizationError` for a targeted module fxlora cannot add LoRA onto."""
    method = quantization_method(model)
    if method is None:
        return None
    served = []
    for fqn, info in modules.items():
        if not pool.wants(fqn, info):
            continue
        module = model.get_submodule(fqn) if info.kind != "experts" else info.owner
        weight = info.weight if info.weight is not None else getattr(module, "weight", None)
        if info.kind == "experts":
            params = experts.experts_parameters(module).values() if experts.is_experts(module) else [info.weight]
            odd = [p for p in params if not _served_experts_weight(p)]
            if odd:
                raise QuantizationError(
                    f"the base model is quantised ({method}) and LoRA targets the experts parameter {fqn!r}, whose "
                    f"module holds a {type(odd[0]).__name__} {odd[0].dtype}: fxlora serves LoRA on quantised experts whose "
                    "parameters are torchao tensor subclasses (TorchAoConfig with FqnToConfig on the experts' "
                    "parameters) only; leave them out of the adapters and target_modules"
                )
            continue
        if _compressed_tensors_module(module):
            raise QuantizationError(
                f"the base model is quantised ({method}) and LoRA targets {fqn!r}, whose forward compressed-tensors "
                "replaced to quantise its weight and input on every call: fxlora cannot add LoRA onto it; a checkpoint "
                "loaded with quantization_config=CompressedTensorsConfig(dequantize=True) is served where transformers "
                "then leaves plain linears (5.24 does, 5.17 does not)"
            )
        if _torchao_weight(weight) or _bitsandbytes_linear(module):
            if info.kind != "linear":
                raise QuantizationError(
                    f"the base model is quantised ({method}) and LoRA targets the {info.kind} {fqn!r}, whose weight is "
                    f"a {type(weight).__name__}: fxlora adds LoRA onto quantised linears only"
                )
            served.append(fqn)
        elif _quantized(weight) or (not method.startswith(SERVED_METHODS) and not _plain_module(module)):
            raise QuantizationError(
                f"the base model is quantised ({method}) and LoRA targets {fqn!r} ({type(module).__name__}, weight "
                f"{type(weight).__name__} {getattr(weight, 'dtype', '')}): fxlora serves quantised bases through torchao "
                "tensor-subclass weights (transformers' TorchAoConfig, torchao.quantize_; for float8 weights, "
                "Float8WeightOnlyConfig) and bitsandbytes' 4-bit Linear4bit only" + DEQUANTIZED.get(method, "")
            )
    quantized_experts = {
        fqn: list(experts.experts_parameters(m).values())
        for fqn, m in model.named_modules()
        if experts.is_experts(m) and any(map(_quantized, experts.experts_parameters(m).values()))
    }
    kept = tuple(fqn for fqn, ps in quantized_experts.items() if not all(map(_served_experts_weight, ps)))
    targeted = [fqn for fqn, info in modules.items() if info.kind == "experts" and pool.wants(fqn, info)]
    if kept and targeted:  # the experts implementation is the model's: all experts keep the eager loop then
        raise QuantizationError(
            f"the base model is quantised ({method}) and LoRA targets the experts parameter {targeted[0]!r}, but the "
            f"experts {kept[0]!r} hold weights quantised otherwise than by torchao, which keep the model's experts "
            "implementation for every experts module: no experts LoRA can be served in this model"
        )
    formats = sorted({_format(p) for f, ps in quantized_experts.items() if f not in kept for p in ps})
    return QuantizedBase(method, tuple(served), tuple(f for f in quantized_experts if f not in kept), kept, tuple(formats))


def _format(weight: torch.Tensor) -> str:
    """A quantised parameter as the report names it: its tensor class and the dtype it holds,
    as ``Float8Tensor float8_e4m3fn``."""
    inner = next((getattr(weight, n) for n in ("qdata", "int_data", "tensor_impl") if hasattr(weight, n)), None)
    dtype = getattr(inner, "dtype", None) if isinstance(inner, torch.Tensor) else None
    return f"{type(weight).__name__} {str(dtype).removeprefix('torch.')}" if dtype is not None else type(weight).__name__


def _bitsandbytes_linear(module: torch.nn.Module) -> bool:
    """A bitsandbytes 4-bit linear (QLoRA's base): its forward is bitsandbytes' custom ops,
    which trace as they are; the delta goes onto its output. (The 8-bit one finds outlier
    columns by value, which breaks the graph: it is refused.)"""
    return type(module).__module__.startswith("bitsandbytes") and type(module).__name__ == "Linear4bit"


def _compressed_tensors_module(module: torch.nn.Module) -> bool:
    """A module compressed-tensors set up to quantise in its forward (it holds the scheme)."""
    return getattr(module, "quantization_scheme", None) is not None


def _torchao_weight(weight: object) -> bool:
    return is_traceable_wrapper_subclass(weight) and type(weight).__module__.startswith("torchao")


def _served_experts_weight(weight: torch.Tensor) -> bool:
    return _torchao_weight(weight) or not _quantized(weight)


PLAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _quantized(weight: object) -> bool:
    """Whether a weight is anything but a plain tensor of a compute dtype (a float8 weight,
    as transformers' ``FP8Linear`` holds, is quantised)."""
    if not isinstance(weight, torch.Tensor):
        return False
    plain = type(weight) in (torch.Tensor, torch.nn.Parameter)
    return not plain or weight.dtype not in PLAIN_DTYPES


def _plain_module(module: torch.nn.Module) -> bool:
    """A module whose class torch or transformers define (a quantisation library's own linear,
    bitsandbytes' ``Linear4bit`` say, is not)."""
    return type(module).__module__.split(".")[0] in ("torch", "transformers")
