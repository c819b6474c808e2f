"""Runtime: the Dynamo backend, per-call adapter routing between the ``lora`` and
``nolora`` graphs."""

from fxlora.runtime.backend import Backend, fxlora_backend
from fxlora.runtime.routing import Router, current_adapter_names, use_adapters

__all__ = ["Backend", "Router", "current_adapter_names", "fxlora_backend", "use_adapters"]
