"""Adapters: read PEFT LoRA adapters and pack them into the fixed-slot pool the kernels read."""

from fxlora.adapters.modules import ModuleInfo, model_modules
from fxlora.adapters.peft_format import LoraAdapter, LoraFactors, read_adapter
from fxlora.adapters.pool import NO_ADAPTER, AdapterPool
from fxlora.adapters.slots import PoolGroup, PoolTarget

__all__ = [
    "NO_ADAPTER",
    "AdapterPool",
    "LoraAdapter",
    "LoraFactors",
    "ModuleInfo",
    "PoolGroup",
    "PoolTarget",
    "model_modules",
    "read_adapter",
]
