"""The inner compiler: Inductor compiles both variants of every graph (the default on CUDA,
chosen here on CPU), serving the same mixed batches as the eager FX graphs, dense and MoE,
with adapters loaded after compilation; a name that is no inner compiler is refused; Inductor's
cache key holds the ops' sources; a graph reading float8 data keeps ATen's GEMM kernels, untimed."""

import json
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from torch.fx.experimental.proxy_tensor import make_fx

import fxlora
from fxlora.testing import make_adapter, tiny_model
from fxlora.testing.oracle import assert_matches_peft, merged_model

pytestmark = pytest.mark.inductor  # Inductor compiles the graphs of nearly every test here


def test_inductor_serves_a_mixed_batch_and_a_later_load():
    model = tiny_model("llama", seed=3)
    a = make_adapter(model, LoraConfig(r=4, target_modules="all-linear"), 1, "")
    b = make_adapter(model, LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"]), 2, "")
    cm = fxlora.compile(model, adapters={"a": a}, max_loras=2, max_rank=8, inner="inductor")
    ids = torch.randint(3, 96, (3, 5))
    assert_matches_peft(cm, model, {"a": a}, ["a", None, "a"], input_ids=ids)
    cm.load_adapter(b, adapter_name="b")  # copied into the pool's tensors, which the compiled code reads
    ids = torch.randint(3, 96, (4, 7))  # a new shape: the same compiled graph
    assert_matches_peft(cm, model, {"a": a, "b": b}, [None, "b", "a", "b"], input_ids=ids)
    assert cm.compile_count == 1
    assert "both compiled by inductor" in cm.explain()


def test_one_graph_serves_batches_smaller_and_larger_than_the_pool():
    # the prologue's segment list is as long as the pool whatever the token count, so that
    # Inductor does not guard on tokens against slots and compile a graph for each side
    model = tiny_model("llama", seed=3)
    a = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), 1, "")
    cm = fxlora.compile(model, adapters={"a": a}, max_loras=4, max_rank=4, inner="inductor")
    for names in (["a", None, "a", "a", None, "a"], ["a", None, "a"]):  # 6 tokens, then 3, on 4 slots
        ids = torch.randint(3, 96, (len(names), 1))
        assert_matches_peft(cm, model, {"a": a}, names, input_ids=ids)
    assert cm.compile_count == 1


def test_inductor_serves_experts():
    model = tiny_model("qwen3_moe", seed=4)
    cfg = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    a = make_adapter(model, cfg, 1, "")
    cm = fxlora.compile(model, adapters={"a": a}, max_loras=2, max_rank=4, inner="inductor")
    ids = torch.randint(3, 96, (3, 6))
    with torch.no_grad():
        out = cm(input_ids=ids, adapter_names=["a", None, "a"]).logits
        ref = torch.cat([merged_model(model, a)(input_ids=ids[[0]]).logits, model(input_ids=ids[[1]]).logits,
                         merged_model(model, a)(input_ids=ids[[2]]).logits])  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_an_unknown_inner_compiler_is_refused():
    model = tiny_model("llama", seed=3)
    with pytest.raises(ValueError, match="inner compiler 'tvm' is not one of"):
        fxlora.compile(model, inner="tvm")


def test_inductor_cache_key_holds_the_ops_sources(monkeypatch):
    # the key covers a graph, not the fakes of the custom ops in it: the ops' sources salt it
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from fxlora.compiler import inner

    def compiled_once() -> tuple[int, int]:
        gm = make_fx(lambda x: torch.relu(x) * 2, tracing_mode="fake")(torch.randn(4, 8))
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        run = inner.compile_inner(gm, "inductor")
        x = torch.randn(4, 8)
        assert torch.equal(run(x), torch.relu(x) * 2)
        return counters["inductor"]["fxgraph_cache_hit"] - hits, counters["inductor"]["fxgraph_cache_miss"] - misses

    with fresh_cache():
        assert compiled_once() == (0, 1)
        assert compiled_once() == (1, 0)  # the same sources: served from the cache
        monkeypatch.setattr(inner, "ops_digest", lambda: b"other ops")
        assert compiled_once() == (0, 1)  # other sources: compiled again


_TWO_VARIANTS = """
import json, torch
from peft import LoraConfig
from torch._dynamo.utils import counters
import fxlora
from fxlora.testing import make_adapter, tiny_model

model = tiny_model("llama", seed=4)
a = make_adapter(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), 1, "")
cm = fxlora.compile(model, adapters={"a": a}, max_loras=2, max_rank=4, inner="inductor")
ids = torch.randint(3, 96, (2, 5))
with torch.no_grad():
    cm(input_ids=ids, adapter_names=["a", None])
print(json.dumps(dict(counters["aot_autograd"])))
"""


@pytest.mark.long
def test_a_second_process_takes_both_variants_from_the_cache(tmp_path):
    # the warm setup: nothing in either variant keeps AOTAutograd's cache from serving it in
    # another process (a plain function's call in the graph, a set of names in the key)
    def run(seed: str) -> dict:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _TWO_VARIANTS], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold = run("1")  # each variant's regions, saved; the regions two variants share come from the cache the second time
    assert cold.get("autograd_cache_saved", 0) + cold.get("autograd_cache_hit", 0) == cold["total"] >= 2, cold
    warm = run("2")
    assert warm.get("autograd_cache_hit") == cold["total"] and "autograd_cache_miss" not in warm, warm


def test_inductor_compiles_a_cuda_experts_op_as_its_composition():
    # the swap happens on a copy: the variant's own graph keeps the op, for explain() and the checks
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxlora.compiler import inner
    from fxlora.ops.moe_lora import moe_lora_composed

    op = torch.ops.fxlora.moe_lora.default
    graph = torch.fx.Graph()
    hidden = graph.placeholder("hidden")
    node = graph.call_function(op, (hidden,))
    graph.output(node)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert inner.composed(gm) is gm  # no traced value: the op stays
    with FakeTensorMode():
        node.meta["val"] = torch.empty(4, 8)
        assert inner.composed(gm) is gm  # on the CPU too
        node.meta["val"] = torch.empty(4, 8, device="cuda")
    swapped = inner.composed(gm)
    assert [n.target for n in swapped.graph.nodes if n.op == "call_function"] == [moe_lora_composed]
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [op]
    # AOTAutograd's cache takes the copy under fxlora's config (a warm setup reuses it)
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable

    with pytest.raises(BypassAOTAutogradCache, match="moe_lora_composed"):
        check_cacheable(swapped)
    with torch._inductor.config.patch(inner.config_patches(False)):
        check_cacheable(swapped)


def test_only_float8_graphs_keep_to_aten_gemms():
    # Inductor's GEMM choices stay its own but where a graph reads float8 data (as a tensor, or
    # inside a quantised weight): _int_mm needs its Triton templates below 17 rows
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    from fxlora.compiler import inner

    weights = {}
    for name, config in (("fp8", Float8WeightOnlyConfig()), ("int8", Int8WeightOnlyConfig())):
        linear = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
        quantize_(linear, config)
        weights[name] = linear.weight
    assert inner.reads_float8([torch.randn(2, 3), weights["fp8"], 4])
    assert inner.reads_float8([torch.randn(3).to(torch.float8_e5m2)])
    assert not inner.reads_float8([torch.randn(2, 3, dtype=torch.bfloat16), weights["int8"], None])
    assert inner.config_patches(True)["max_autotune_gemm_backends"] == "ATEN"
    assert "max_autotune_gemm_backends" not in inner.config_patches(False)
    with torch._inductor.config.patch(max_autotune=True):  # asked for: Inductor autotunes as it would
        assert "max_autotune_gemm_backends" not in inner.config_patches(True)


def test_coordinate_descent_tuning_waits_for_max_autotune():
    # torchao's configs switch it on for the whole process; fxlora's graphs compile without it
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from fxlora.compiler import inner

    config = torch._inductor.config  # what torchao sets is restored after the test (conftest)
    with config.patch(coordinate_descent_tuning=False):
        quantize_(torch.nn.Sequential(torch.nn.Linear(32, 32)), Int8WeightOnlyConfig())
        assert config.coordinate_descent_tuning  # what a user gets from torchao
        assert inner.config_patches(False)["coordinate_descent_tuning"] is False
        with config.patch(max_autotune=True):  # asked for: Inductor tunes as it would
            assert "coordinate_descent_tuning" not in inner.config_patches(False)
    with config.patch(coordinate_descent_tuning=False):
        assert "coordinate_descent_tuning" not in inner.config_patches(True)


def test_a_graph_holding_float8_weights_keeps_to_aten_gemms(monkeypatch):
    # weights the graph holds as attributes count, as its inputs do
    import torch._inductor.compile_fx

    from fxlora.compiler import inner

    patches = {}
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lambda gm, inputs, config_patches: patches.update(config_patches))
    for dtype, gemms in ((torch.float8_e4m3fn, "ATEN"), (torch.bfloat16, None)):
        module = torch.nn.Module()
        module.register_buffer("w", torch.randn(8, 4).to(dtype))
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        x.meta["val"] = torch.randn(2, 4)
        graph.output(graph.call_function(torch.nn.functional.linear, (x, graph.get_attr("w"))))
        patches.clear()
        inner.compile_inner(torch.fx.GraphModule(module, graph), "inductor")
        assert patches.get("max_autotune_gemm_backends") == gemms


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None or torch.cuda.get_device_capability() < (8, 9),
    reason="needs an NVIDIA GPU with FP8 GEMMs",
)
def test_fp8_gemms_take_aten_kernels_without_autotuning(monkeypatch):
    # without max-autotune Inductor may still time Triton templates against ATen for _scaled_mm,
    # each template a kernel to compile: fxlora's graphs keep ATen's
    from torch._inductor.kernel import mm
    from torch._inductor.utils import fresh_cache

    from fxlora.compiler import inner

    chosen_from = []
    autotune = mm.autotune_select_algorithm

    def spy(name, choices, *args, **kwargs):
        chosen_from.append(sorted({type(c).__name__ for c in choices}))
        return autotune(name, choices, *args, **kwargs)

    monkeypatch.setattr(mm, "autotune_select_algorithm", spy)

    def scaled_mm(a, b, scale_a, scale_b):
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)

    m, k, n = 32, 2048, 2048
    args = (
        torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn),
        torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t(),  # column-major, as _scaled_mm needs
        torch.rand(m, 1, device="cuda") + 0.5,
        torch.rand(1, n, device="cuda") + 0.5,
    )
    gm = make_fx(scaled_mm, tracing_mode="fake")(*args)
    with fresh_cache():
        run = inner.compile_inner(gm, "inductor")
        assert chosen_from == [["ExternKernelCaller"]]
        torch.testing.assert_close(run(*args), scaled_mm(*args))


def test_compositions_replace_the_op_by_overload_or_packet():
    # the experts of quantised models call the packet (no LoRA op), the lora_moe pass the overload
    import operator

    from fxlora.compiler import inner
    from fxlora.ops.moe_lora import moe_lora_composed

    assert inner._composition(torch.ops.fxlora.moe_lora) is moe_lora_composed
    assert inner._composition(torch.ops.fxlora.moe_lora.default) is moe_lora_composed
    assert inner._composition(torch.ops.aten.mm.default) is None and inner._composition(operator.add) is None
