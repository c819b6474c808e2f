"""A graph's compilation shows a progress bar: the passes, then the inner compiler's regions."""

import io

import pytest
import torch
from peft import LoraConfig
from tqdm.auto import tqdm

import fxlora
from fxlora.compiler import progress
from fxlora.passes import PIPELINE
from fxlora.testing import make_adapter, tiny_model


@pytest.fixture
def bars(monkeypatch):
    """The bars fxlora opens, each drawn into a buffer of its own whatever stderr is."""
    made = []

    class Drawn(tqdm):
        def __init__(self, *args, **kwargs):
            self.drawn = io.StringIO()
            super().__init__(*args, **{**kwargs, "disable": False, "file": self.drawn})
            made.append(self)

    monkeypatch.setattr(progress, "tqdm", Drawn)
    return made


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_compilation_advances_a_bar_over_its_steps(bars, inner, tmp_path):
    model = tiny_model("llama")
    a = make_adapter(model, LoraConfig(r=2, target_modules=["q_proj"]), 1, str(tmp_path / "a"))
    cm = fxlora.compile(model, adapters={"a": a}, max_rank=8, inner=inner)
    ids = torch.randint(3, 96, (2, 4))
    cm(input_ids=ids, adapter_names=["a", None])
    (bar,) = [b for b in bars if b.desc.startswith("fxlora: compiling")]
    assert bar.desc == "fxlora: compiling forward graph"
    passes = len(PIPELINE)  # hoist counts once for both variants
    drawn = bar.drawn.getvalue()
    assert "annotate" in drawn and "hoist" in drawn
    if inner == "eager":
        assert bar.total == passes
    else:  # each variant's distinct regions, one step each
        assert bar.total > passes
        assert "inductor: region 1/" in drawn
    assert bar.n == bar.total
    assert bar.disable  # closed
    cm(input_ids=ids, adapter_names=[None, "a"])  # nothing to compile: no bar
    assert len(bars) == 2  # this compilation's, and the first call's tracing


def test_steps_outside_a_compilation_show_nothing(bars):
    progress.expect(3)
    with progress.step("annotate"):
        pass
    assert bars == []


def test_a_first_call_shows_the_time_dynamo_takes(bars):
    import time

    with progress.waiting("fxlora: waiting"):
        time.sleep(1.2)  # redrawn meanwhile, with nothing else happening
    assert bars[-1].drawn.getvalue().count("fxlora: waiting: 00:0") >= 2
    cm = fxlora.compile(tiny_model("llama", seed=2), inner="eager")
    ids = torch.randint(3, 96, (2, 5))
    cm(input_ids=ids)
    assert [b.desc for b in bars[1:2]] == ["fxlora: tracing LlamaForCausalLM (first call)"]
    shown = len(bars)
    cm(input_ids=ids)
    assert len(bars) == shown  # compiled: no bar
