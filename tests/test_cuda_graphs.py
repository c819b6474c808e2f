"""What a CUDA graph of a traced graph would fail to replay: CPU work (checked on traced
values, here fake CUDA tensors, so it runs without a GPU)."""

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxlora.runtime.cuda_graphs import GraphSet, cpu_work

MODE = FakeTensorMode()


def _val(device: str) -> torch.Tensor:
    with MODE:
        return torch.empty(4, device=device)


def _graph(host_step: bool) -> fx.GraphModule:
    """``x + counter.to("cuda")``, or ``x + (counter + 1).to("cuda")`` with a host-side step."""
    g = fx.Graph()
    x, counter = g.placeholder("x"), g.placeholder("counter")
    x.meta["val"], counter.meta["val"] = _val("cuda"), _val("cpu")
    if host_step:
        counter = g.call_function(operator.add, (counter, 1))
        counter.meta["val"] = _val("cpu")
    moved = g.call_method("to", (counter, "cuda"))
    moved.meta["val"] = _val("cuda")
    out = g.call_function(operator.add, (x, moved))
    out.meta["val"] = _val("cuda")
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g)


def test_host_inputs_only_copied_to_the_device_are_capturable():
    assert cpu_work(_graph(host_step=False)) is None


def test_host_computation_is_named():
    assert cpu_work(_graph(host_step=True)) == "it computes on a CPU tensor (placeholder counter)"


def test_a_graph_set_on_cpu_runs_eagerly():
    graphs = GraphSet(torch.device("cpu"), enabled=True)
    assert not graphs.enabled and "not CUDA" in graphs.fallback_reason
    assert torch.equal(graphs.call("k", lambda t: t + 1, (torch.ones(2),)), torch.full((2,), 2.0))
    assert graphs.run_captured(3, lambda key: torch.full((2,), float(key))).tolist() == [3.0, 3.0]
    assert not graphs.graphs and graphs.capture_seconds == 0


def test_host_to_device_copies_become_non_blocking():
    gm = _graph(host_step=False)
    cpu_work(gm)
    (to,) = [n for n in gm.graph.nodes if n.target == "to"]
    assert to.kwargs == {"non_blocking": True} and "non_blocking = True" in gm.code
