"""Runtime: the Dynamo backend, per-call adapter routing between the ``lora`` and
``nolora`` graphs."""

from fxlora.runtime.backend import Backend, fxlora_backend
from fxlora.runtime.routing import Router, Selection, use_adapters

__all__ = ["Backend", "Router", "Selection", "fxlora_backend", "use_adapters"]
