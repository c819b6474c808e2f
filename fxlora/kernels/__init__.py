"""Custom ops (namespace ``fxlora::``): each with a fake implementation for tracing and a
PyTorch reference implementation, the oracle in tests."""

from fxlora.kernels.batch_info import batch_info
from fxlora.kernels.lora_embedding import lora_embedding
from fxlora.kernels.lora_linear import lora_linear, lora_linear_fused
from fxlora.kernels.moe_lora import moe_lora

__all__ = ["batch_info", "lora_embedding", "lora_linear", "lora_linear_fused", "moe_lora"]
