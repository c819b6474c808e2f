"""fxlora: serve many LoRA adapters on one ``transformers`` model through torch.fx passes.

``fxlora.compile(model, adapters={...})`` returns a :class:`CompiledModel` whose forward
takes ``adapter_names=[...]``, one per row; ``torch.compile(model, backend="fxlora",
options={...})`` with :func:`use_adapters` does the same through Dynamo directly.
"""

from fxlora.compiled import CompiledModel, compile
from fxlora.errors import (
    AdapterError,
    AdapterWarning,
    GenerationConfigError,
    LoraNotRunError,
    NoFreeSlot,
    QuantizationError,
    ShardingError,
    TraceError,
)
from fxlora.runtime import use_adapters

__version__ = "0.1.0"

__all__ = [
    "AdapterError", "AdapterWarning", "CompiledModel", "GenerationConfigError", "LoraNotRunError", "NoFreeSlot", "QuantizationError", "ShardingError", "TraceError", "compile", "use_adapters",
]
