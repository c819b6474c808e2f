"""The exception types fxlora raises for bad input, and :class:`NotServed`, which stays inside:
the adapters layer raises it and the passes catch it."""


class AdapterError(ValueError):
    """An adapter cannot be read, does not fit the model, or is used wrongly.

    The message always names the adapter and the file, module, shape or PEFT feature at fault.
    """


class NoFreeSlot(AdapterError):
    """Every GPU slot of the adapter pool is read by calls in flight, for longer than a call
    would wait: the message names the adapter and ``max_loras``."""


class QuantizationError(ValueError):
    """The base model is quantised in a way fxlora cannot add LoRA onto, on a module LoRA
    targets; the message names the quantisation method and the module."""


class GenerationConfigError(ValueError):
    """A generation setting fxlora does not serve, or a bad value of one; the message names
    the setting and where it came from."""


class TraceError(RuntimeError):
    """Dynamo could not trace or compile the model: the message names Dynamo's reason, the
    line of the model where it stopped, and the torch version; Dynamo's error is its cause."""


class LoraNotRunError(RuntimeError):
    """A row asks for an adapter whose LoRA did not run on a module it targets: that part of
    the model ran outside the compiled graphs (a graph break, or Dynamo giving up on a frame),
    so the row would get the base model's output there."""


class NotServed(Exception):
    """A module (or set of modules) fxlora leaves to its base computation; the message says
    why. The passes catch it and report the reason in ``explain()``; it never reaches users."""


class ShardingError(ValueError):
    """The model is sharded (tensor parallelism) in a way fxlora cannot split LoRA factors
    for, on a module LoRA targets; the message names the module and its placement."""


class AdapterWarning(UserWarning):
    """A call names no adapters while some are loaded, so every row runs the base model."""
