"""Custom ops (namespace ``fxlora::``), one file per op: each with a fake implementation for
tracing, a PyTorch reference implementation (the oracle in tests) and, on CUDA, an
implementation over the Triton kernels of :mod:`fxlora.ops.triton`. The bottom layer beside
:mod:`fxlora.adapters`: nothing here imports the compiler, the runtime or the façade."""

from fxlora.ops.batch_info import batch_info
from fxlora.ops.lora_embedding import lora_embedding
from fxlora.ops.lora_linear import lora_linear, lora_linear_fused
from fxlora.ops.moe_lora import moe_lora

__all__ = ["batch_info", "lora_embedding", "lora_linear", "lora_linear_fused", "moe_lora"]
