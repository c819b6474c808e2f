"""Custom ops (namespace ``fxlora::``), one file per op: each with its schema, a fake
implementation for tracing, a PyTorch reference implementation (the oracle in tests) and, on
CUDA, an implementation over the Triton kernels of :mod:`fxlora.kernels`. The linear LoRA ops
share their CUDA dispatch, the shrink and expand around a base (:mod:`fxlora.ops.delta_launcher`).
Above the kernels, beside :mod:`fxlora.adapters`: nothing here imports the compiler, the
passes, the runtime or the façade.

Operands travel in bundles (:mod:`fxlora.ops.operands`): a target's factors as one
``Tensor[]`` (:class:`LoraWeights`), its tokens' batch metadata as another
(:class:`BatchInfo`), so every LoRA op's signature is its base operands, those two bundles
and its scratch. Adding an op touches its file here (op, fake, reference, CUDA dispatch),
its kernel in :mod:`fxlora.kernels` if it has one of its own, its pass in
:mod:`fxlora.passes` (which builds the bundles with the compiler's ``pool_nodes`` and
``batch_info_for``), and one test on each side: ``tests/test_kernel_<op>.py`` against its
reference, and a pass test on a graph.
"""

import torch

from fxlora.ops.batch_info import batch_info
from fxlora.ops.decode_attention import decode_attention
from fxlora.ops.grouped_mm import grouped_mm
from fxlora.ops.lora_conv_delta import lora_conv_delta
from fxlora.ops.lora_delta import lora_delta
from fxlora.ops.lora_embedding import lora_embedding
from fxlora.ops.lora_embedding_delta import lora_embedding_delta
from fxlora.ops.lora_grouped_delta import lora_grouped_delta, lora_grouped_delta_composed
from fxlora.ops.lora_linear import lora_linear, lora_linear_beside, lora_linear_fused
from fxlora.ops.lora_shrink import lora_shrink
from fxlora.ops.lora_weight_rows import lora_weight_rows
from fxlora.ops.moe_lora import moe_lora, moe_lora_composed
from fxlora.ops.operands import BatchInfo, LoraWeights
from fxlora.ops.paged_attention import gather_pages, paged_decode_attention

# The ops that add LoRA: a graph that holds none has no LoRA to run.
LORA_OPS = frozenset({
    torch.ops.fxlora.lora_conv_delta.default,
    torch.ops.fxlora.lora_delta.default,
    torch.ops.fxlora.lora_linear.default,
    torch.ops.fxlora.lora_linear_fused.default,
    torch.ops.fxlora.lora_linear_beside.default,
    torch.ops.fxlora.lora_shrink.default,
    torch.ops.fxlora.lora_weight_rows.default,
    torch.ops.fxlora.lora_embedding.default,
    torch.ops.fxlora.lora_embedding_delta.default,
    torch.ops.fxlora.lora_grouped_delta.default,
    torch.ops.fxlora.moe_lora.default,
})

# ops that Inductor compiles as their composition on CUDA (fxlora.compiler.inner): their
# routing and gathers fuse with the graph's own, and only their GEMMs and LoRA kernels stay calls
COMPOSITIONS = {
    torch.ops.fxlora.moe_lora.default: moe_lora_composed,
    torch.ops.fxlora.lora_grouped_delta.default: lora_grouped_delta_composed,
}

__all__ = [
    "COMPOSITIONS",
    "LORA_OPS",
    "BatchInfo",
    "LoraWeights",
    "batch_info",
    "decode_attention",
    "gather_pages",
    "grouped_mm",
    "lora_conv_delta",
    "lora_delta",
    "lora_embedding",
    "lora_embedding_delta",
    "lora_grouped_delta",
    "lora_linear",
    "lora_linear_beside",
    "lora_linear_fused",
    "lora_shrink",
    "lora_weight_rows",
    "moe_lora",
    "paged_decode_attention",
]
