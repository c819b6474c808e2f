"""Custom ops (namespace ``fxlora::``): each with a fake implementation for tracing and a
PyTorch reference implementation, the oracle in tests."""

from fxlora.ops.batch_info import batch_info
from fxlora.ops.lora_embedding import lora_embedding
from fxlora.ops.lora_linear import lora_linear, lora_linear_fused
from fxlora.ops.moe_lora import moe_lora

__all__ = ["batch_info", "lora_embedding", "lora_linear", "lora_linear_fused", "moe_lora"]
