"""The lora_parameters pass: LoRA of 3-D parameters outside transformers' experts modules, read
from what the graph does with them: Inkling's shared experts (a batched matmul per expert) and
depthwise convolution weights (Mamba-style layers) served in mixed batches against PEFT, and
the uses fxlora cannot read refused naming the parameter and the operation."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig

import fxlora
from fxlora.testing import check_rows, make_adapter, peft_model_with
from fxlora.testing.models import fill_zero_weights

SHARED = ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]


def mixed_against_peft(model, adapters, names, ids):
    """Compile, serve ``names`` over ``ids`` and check each adapter's rows against PEFT, whose
    answers are taken first: over the modules' own code, before fxlora gives any of them
    another forward (loop experts, segment GEMMs)."""
    with torch.no_grad():
        model(input_ids=ids)  # a model may set itself up on its first call (RWKV rescales its layers): before PEFT copies it
        want = {}
        for name in dict.fromkeys(names):
            rows = [i for i, n in enumerate(names) if n == name]
            runner = model if name is None else peft_model_with(model, {name: adapters[name]})
            want[name] = (rows, _logits(runner(input_ids=ids[rows])))
    cm = fxlora.compile(model, adapters, max_loras=len(adapters) + 1, max_rank=8)
    with torch.no_grad():
        out = _logits(cm(input_ids=ids, adapter_names=names))
    for name, (rows, expected) in want.items():
        check_rows(out[rows], expected, [name] * len(rows))
    return cm


def _logits(out):
    return getattr(out, "logits", out)


def test_inklings_shared_experts_match_peft():
    """Each shared expert is a batched matmul of its parameter: gate and up over one input
    every expert reads, down over each expert's own activations."""
    if "inkling_text" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no Inkling")
    config = transformers.CONFIG_MAPPING["inkling_text"](
        hidden_size=32, head_dim=16, intermediate_size=37, moe_intermediate_size=12, num_attention_heads=2,
        num_key_value_heads=2, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=99, hidden_act="gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.InklingForCausalLM(config).float().eval()
    fill_zero_weights(model, 0.5)
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=SHARED), seed=1, directory="", scale=0.5),
        "b": make_adapter(model, LoraConfig(r=2, lora_alpha=2, use_rslora=True, target_modules=["o_proj"], target_parameters=SHARED[1:]), seed=2, directory="", scale=0.5),
    }  # fmt: skip
    ids = torch.randint(3, 99, (4, 6), generator=torch.Generator().manual_seed(3))
    cm = mixed_against_peft(model, adapters, ["a", None, "b", "a"], ids)
    assert "Not served:\n  nothing" in cm.explain()
    assert "a delta per expert: shared_experts.down_proj, shared_experts.gate_proj, shared_experts.up_proj" in cm.explain()


class Block(torch.nn.Module):
    """A 3-D parameter used as ``use`` says, in the module's own forward."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        shape = (8, 1, 3) if use.startswith("conv") else (2, 8, 8)  # a depthwise kernel; (experts, out, in)
        self.weight = torch.nn.Parameter(torch.randn(*shape) * 0.3)

    def forward(self, h):
        x, w = h.reshape(1, -1, 8).expand(2, -1, -1), self.weight
        if self.use == "untransposed":
            return torch.bmm(x, w).sum(0)
        if self.use == "split":  # each expert a chunk of the tokens: no expert's tokens are the batch's rows
            return torch.bmm(h.reshape(2, -1, 8), w.transpose(1, 2)).reshape(h.shape)
        if self.use == "einsum":
            return torch.einsum("bi,eoi->bo", h.reshape(-1, 8), w)
        y = torch.nn.functional.conv1d(h.transpose(1, 2), w, padding=1, groups=8).transpose(1, 2)  # over the sequence
        if self.use == "conv and product":  # and a decode step's product with the kernel
            y = y + (h[..., None] * w[:, 0]).sum(-1)
        return y


class Stacked(torch.nn.Module):
    """A :class:`Block` between an embedding and a head; with ``outside``, the model reads the
    block's weight itself, where PEFT's ``target_parameters`` applies no LoRA (only the
    block's own forward sees the adapted weight)."""

    def __init__(self, use: str, outside: bool = False):
        super().__init__()
        self.embed, self.block, self.head = torch.nn.Embedding(50, 8), Block(use), torch.nn.Linear(8, 50)
        self.outside = outside

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if self.outside:
            y = torch.nn.functional.conv1d(h.transpose(1, 2), self.block.weight, padding=1, groups=8).transpose(1, 2)
        else:
            y = self.block(h)
        return self.head(y.reshape(h.shape))


@pytest.mark.parametrize(
    "use, operation",
    [
        ("untransposed", "its 3-D parameter block.weight enters bmm untransposed"),
        ("einsum", "its 3-D parameter block.weight enters einsum"),
        ("conv and product", "its 3-D parameter block.weight enters conv1d and getitem"),
        ("split", "the batched matmul of its 3-D parameter block.weight: .*rows"),
    ],
)
def test_a_use_fxlora_cannot_read_is_refused_naming_it(use, operation):
    torch.manual_seed(0)
    model = Stacked(use).eval()
    adapter = make_adapter(model, LoraConfig(r=2, target_modules=["head"], target_parameters=["block.weight"]), seed=1, directory="")
    cm = fxlora.compile(model, {"a": adapter}, max_loras=2, max_rank=4)
    with pytest.raises(fxlora.LoraNotRunError, match=operation):
        cm(input_ids=torch.randint(0, 50, (2, 5)), adapter_names=["a", None])


@pytest.mark.parametrize("family", ["conv", "outside", "jamba"])
def test_convolution_weights_match_peft(family):
    """A depthwise convolution's weight: each row's delta is the convolution of its input with
    its adapter's weight delta, added onto the output. Read outside its module's forward (the
    model's own, or Jamba's Mamba mixer, which passes ``conv1d.weight`` to a function), PEFT
    applies no LoRA to it, and neither does fxlora, saying so in explain()."""
    torch.manual_seed(0)
    if family != "jamba":
        model, targets, vocab = Stacked("conv", outside=family == "outside").eval(), (["head"], ["block.weight"]), 50
    else:
        config = transformers.JambaConfig(
            hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
            mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, vocab_size=99, use_mamba_kernels=False,
        )  # fmt: skip
        model, targets, vocab = transformers.JambaForCausalLM(config).float().eval(), (["in_proj"], ["conv1d.weight"]), 99
        fill_zero_weights(model, 0.5)
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets[0], target_parameters=targets[1]), seed=1, directory=""),
        "b": make_adapter(model, LoraConfig(r=2, use_rslora=True, target_parameters=targets[1]), seed=2, directory=""),
    }  # fmt: skip
    ids = torch.randint(3, vocab, (4, 6), generator=torch.Generator().manual_seed(3))
    cm = mixed_against_peft(model, adapters, ["a", None, "b", "a"], ids)
    if family == "conv":
        assert "LoRA of 3-D parameters in a 1-D convolution: block.weight" in cm.explain()
        assert "Not served:\n  nothing" in cm.explain()
    else:
        assert "is read outside its module's forward (in " in cm.explain()
        assert "where PEFT applies no LoRA to it either: those reads keep the base weight" in cm.explain()
        assert "weight: targeted, but no traced graph calls it" in cm.explain()


class Shared(torch.nn.Module):
    """Shared experts as a batched matmul, and a linear beside them."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 8, 8) * 0.3)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, h):
        experts = torch.bmm(h.reshape(1, -1, 8).expand(2, -1, -1), self.weight.transpose(1, 2)).sum(0)
        return self.proj(h) + experts.reshape(h.shape)


class Wrapping(torch.nn.Module):
    """A module with a 3-D parameter and a linear inside: PEFT wraps the module for the
    parameter, so the file names the linear ``block.base_layer.proj``."""

    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = torch.nn.Embedding(50, 8), Shared(), torch.nn.Linear(8, 50)

    def forward(self, input_ids):
        return self.head(self.block(self.embed(input_ids)))


def test_a_linear_inside_a_module_peft_wraps_for_its_parameter():
    torch.manual_seed(0)
    model = Wrapping().eval()
    config = LoraConfig(r=2, target_modules=["proj"], target_parameters=["block.weight"])
    adapters = {"a": make_adapter(model, config, seed=1, directory=""), "b": make_adapter(model, config, seed=2, directory="")}
    assert any(".base_layer.proj." in key for key in adapters["a"][1])
    ids = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(4))
    mixed_against_peft(model, adapters, ["a", "b", None], ids)


def test_rwkvs_time_mix_parameters_match_peft():
    """RWKV's time-mix parameters ``(1, 1, hidden)`` mix each token with the one before,
    ``hidden * W + shifted * (1 - W)``: each row gets its own adapted copy of ``W``."""
    config = transformers.RwkvConfig(hidden_size=32, attention_hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     vocab_size=99, context_length=16)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(config).float().eval()
    fill_zero_weights(model, 0.5)
    mix = ["attention.time_mix_key", "attention.time_mix_receptance", "feed_forward.time_mix_key"]
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["key"], target_parameters=mix), seed=1, directory=""),
        "b": make_adapter(model, LoraConfig(r=2, use_rslora=True, target_parameters=mix[1:]), seed=2, directory=""),
    }  # fmt: skip
    ids = torch.randint(3, 99, (4, 6), generator=torch.Generator().manual_seed(3))
    cm = mixed_against_peft(model, adapters, ["a", None, "b", "a"], ids)
    assert "LoRA of 3-D parameters in products with its values, a copy per row" in cm.explain()
    assert "Not served:\n  nothing" in cm.explain()


def test_values_that_meet_something_else_than_the_rows_are_refused():
    """A parameter of one expert whose values enter a matmul before they meet the rows."""

    class Mixing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(1, 8, 8) * 0.3)

        def forward(self, h):
            return h @ (self.weight * 2)[0]

    model = Stacked("conv").eval()
    model.block = Mixing()
    adapter = make_adapter(model, LoraConfig(r=2, target_modules=["head"], target_parameters=["block.weight"]), seed=1, directory="")
    cm = fxlora.compile(model, {"a": adapter}, max_loras=2, max_rank=4)
    with pytest.raises(fxlora.LoraNotRunError, match="block.weight's values enter getitem before they meet the batch's rows"):
        cm(input_ids=torch.randint(0, 50, (2, 5)), adapter_names=["a", None])


def test_jetmoes_routed_experts_match_peft():
    """JetMoE's experts (attention and MLP) each run ``F.linear(x, weight[e])`` over the tokens
    routed to them, ``split(hidden[index], counts)``: each routed token reads its own row's
    slot, through the second linear's input too (the first's outputs, concatenated and gated)."""
    config = transformers.JetMoeConfig(
        hidden_size=32, intermediate_size=37, kv_channels=8, num_experts_per_tok=2, num_hidden_layers=2,
        num_key_value_heads=2, num_local_experts=4, vocab_size=99,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.JetMoeForCausalLM(config).float().eval()
    fill_zero_weights(model, 0.5)
    experts = ["input_linear.weight", "output_linear.weight"]
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", target_parameters=experts), seed=1, directory=""),
        "b": make_adapter(model, LoraConfig(r=2, use_rslora=True, target_parameters=experts[1:]), seed=2, directory=""),
    }  # fmt: skip
    ids = torch.randint(3, 99, (4, 6), generator=torch.Generator().manual_seed(3))
    cm = mixed_against_peft(model, adapters, ["a", None, "b", "a"], ids)
    assert "LoRA of 3-D parameters in linears over the tokens routed to each expert" in cm.explain()
    assert "Not served:\n  nothing" in cm.explain()


class SegmentGemm(torch.nn.Module):
    """Rows in segments by expert, each segment times its expert's ``(in, out)`` slice, looping
    on the host (transformers 5.17's ``AriaGroupedExpertsGemm``)."""

    def __init__(self, experts: int, fin: int, fout: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, fin, fout) / fin**0.5)

    def forward(self, input, tokens_per_expert):
        ends = torch.cumsum(tokens_per_expert.cpu(), 0).tolist()
        out = torch.zeros(input.shape[0], self.weight.shape[-1], dtype=input.dtype)
        for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
            out[start:end] = input[start:end] @ self.weight[e]
        return out


class SegmentExperts(torch.nn.Module):
    def __init__(self, hidden: int = 16, inter: int = 6, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.router, self.top_k, self.experts = torch.nn.Linear(hidden, experts, bias=False), top_k, experts
        self.fc1, self.fc2 = SegmentGemm(experts, hidden, 2 * inter), SegmentGemm(experts, inter, hidden)

    def forward(self, h):
        weights, index = torch.topk(self.router(h), self.top_k, dim=-1)
        weights = weights.softmax(-1)
        counts = torch.histc(index.flatten().float(), bins=self.experts, min=0, max=self.experts - 1).long()
        order = torch.argsort(index.view(-1))
        up, gate = self.fc1(h.index_select(0, order // self.top_k), counts).chunk(2, dim=-1)
        out = self.fc2(F.silu(up) * gate, counts)
        unsorted = torch.zeros_like(out).index_copy(0, order, out).view(-1, self.top_k, out.shape[-1])
        return (unsorted * weights.unsqueeze(-1)).sum(1)


class SegmentModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.moe, self.head = torch.nn.Embedding(50, 16), SegmentExperts(), torch.nn.Linear(16, 50)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        rows, length, hidden = h.shape
        return self.head(h + self.moe(h.reshape(-1, hidden)).view(rows, length, hidden))


def test_segment_gemms_match_peft():
    """A module that multiplies rows in segments by its 3-D weight, looping on the host, is
    proven so and given one grouped GEMM as its forward; each routed row reads its token's
    slot, and PEFT's factors, which read the weight as (experts, out, in), are turned round."""
    torch.manual_seed(0)
    model = SegmentModel().eval()
    targets = ["fc1.weight", "fc2.weight"]
    adapters = {
        "a": make_adapter(model, LoraConfig(r=4, lora_alpha=8, target_modules=["router"], target_parameters=targets), seed=1, directory="", scale=0.5),
        "b": make_adapter(model, LoraConfig(r=2, use_rslora=True, target_parameters=targets[1:]), seed=2, directory="", scale=0.5),
    }  # fmt: skip
    ids = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(3))
    cm = mixed_against_peft(model, adapters, ["a", None, "b", "a"], ids)
    assert "LoRA of 3-D parameters in grouped GEMMs over rows in segments: fc1.weight, fc2.weight" in cm.explain()
    assert "Not served:\n  nothing" in cm.explain()


def test_arias_segment_gemms_match_peft():
    """transformers 5.17's Aria: its experts' fc1 / fc2 are segment GEMMs (later versions
    build Aria's experts on transformers' experts implementation)."""
    aria = pytest.importorskip("transformers.models.aria.modeling_aria")
    if not hasattr(aria, "AriaGroupedExpertsGemm"):
        pytest.skip("this transformers builds Aria's experts as an experts module")
    config = transformers.AriaTextConfig(
        hidden_size=32, head_dim=16, intermediate_size=37, num_attention_heads=2, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=99,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AriaTextForCausalLM(config).float().eval()
    fill_zero_weights(model, 0.5)
    targets = ["fc1.weight", "fc2.weight"]
    adapters = {"a": make_adapter(model, LoraConfig(r=4, target_modules="all-linear", target_parameters=targets), seed=1, directory="", scale=0.5)}
    ids = torch.randint(3, 99, (3, 5), generator=torch.Generator().manual_seed(3))
    cm = mixed_against_peft(model, adapters, ["a", None, "a"], ids)
    assert "Not served:\n  nothing" in cm.explain()
