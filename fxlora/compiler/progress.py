"""The progress bar of a graph's compilation: the passes, then the inner compiler's regions.

The backend opens a bar (:func:`bar`) while it turns a graph Dynamo traced into its compiled
variants; the pipeline and the inner compiler, below it, announce the steps they will take
(:func:`expect`) and run each one under :func:`step`, which names it beside the bar while it
runs and ticks it off when it ends; both do nothing when no bar is open
(a graph rebuilt for another instance of its code, a variant compiled on a later call).
The bar is tqdm's, on stderr, shown on a terminal only (as the decode runtime's bars);
``TQDM_DISABLE=1`` hides it. Dynamo's tracing, before the backend has a graph, has no steps to
count: :func:`waiting` shows a bar of the time it has taken so far.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator

from tqdm.auto import tqdm

_bar: contextvars.ContextVar[tqdm | None] = contextvars.ContextVar("fxlora_compile_progress", default=None)


def shown(enabled: bool = True) -> dict[str, bool | None]:
    """tqdm's ``disable`` argument for fxlora's bars: on a terminal only (``None``), and never
    when ``enabled`` is False. An explicit argument would override ``TQDM_DISABLE``, so where
    that is set none is passed and tqdm reads it."""
    if not enabled:
        return {"disable": True}
    return {} if "TQDM_DISABLE" in os.environ else {"disable": None}


@contextlib.contextmanager
def bar(desc: str) -> Iterator[None]:
    """Show the progress of the compilation in the block under ``desc``; closed (and gone
    from the terminal) when the block ends."""
    progress = tqdm(desc=desc, total=0, unit="step", leave=False, **shown())
    token = _bar.set(progress)
    try:
        yield
    finally:
        _bar.reset(token)
        progress.close()


def expect(steps: int) -> None:
    """``steps`` more steps lie ahead."""
    progress = _bar.get()
    if progress is not None:
        progress.total += steps
        progress.refresh()


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """The block is one step, ``name``."""
    progress = _bar.get()
    if progress is None:
        yield
        return
    progress.set_postfix_str(name)
    yield
    progress.update()


@contextlib.contextmanager
def waiting(desc: str) -> Iterator[None]:
    """Show ``desc`` and the time the block has taken, redrawn twice a second (a block with no
    steps to count, as Dynamo tracing a model); gone when the block ends."""
    progress = tqdm(desc=desc, bar_format="{desc}: {elapsed}", leave=False, **shown())
    done = threading.Event()

    def redraw() -> None:
        while not done.wait(0.5):
            progress.refresh()

    ticker = threading.Thread(target=redraw, name="fxlora-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        progress.close()
