"""The exception types fxlora raises for bad input."""


class AdapterError(ValueError):
    """An adapter cannot be read, does not fit the model, or is used wrongly.

    The message always names the adapter and the file, module, shape or PEFT feature at fault.
    """
