"""A device tensor on its way to the host, read without waiting for later work."""

from __future__ import annotations

import torch


class Pending:
    """A device tensor on its way to pinned host memory: :meth:`get` waits for the copy alone,
    not for work issued after it."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None):
        self.host, self.done = host, done

    @staticmethod
    def of(values: torch.Tensor) -> Pending:
        if values.device.type != "cuda":
            return Pending(values.clone(), None)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Pending(host, done)

    def get(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host
