"""The lora_bmm pass: LoRA of 3-D parameters outside transformers' experts modules, read from
what the graph does with them: Inkling's shared experts (a batched matmul per expert) served in
mixed batches against PEFT, and the uses fxlora cannot read refused naming the parameter and
the operation."""

import pytest
import torch
import transformers
from peft import LoraConfig

import fxlora
from fxlora.testing import check_rows, make_adapter, peft_model_with
from fxlora.testing.models import fill_zero_weights

SHARED = ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]


def mixed_against_peft(model, adapters, names, ids):
    cm = fxlora.compile(model, adapters, max_loras=len(adapters) + 1, max_rank=8)
    with torch.no_grad():
        out = cm(input_ids=ids, adapter_names=names).logits
        for name in dict.fromkeys(names):
            rows = [i for i, n in enumerate(names) if n == name]
            runner = model if name is None else peft_model_with(model, {name: adapters[name]})
            check_rows(out[rows], runner(input_ids=ids[rows]).logits, [name] * len(rows))
    return cm


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


class Stacked(torch.nn.Module):
    """A 3-D parameter used as ``use`` says, between an embedding and a head."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.embed = torch.nn.Embedding(50, 8)
        self.block = torch.nn.Module()
        shape = (8, 1, 3) if use == "conv" else (2, 8, 8)  # a depthwise kernel; (experts, out, in)
        self.block.weight = torch.nn.Parameter(torch.randn(*shape) * 0.3)
        self.head = torch.nn.Linear(8, 50)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        x = h.reshape(1, -1, 8).expand(2, -1, -1)
        w = self.block.weight
        if self.use == "untransposed":
            y = torch.bmm(x, w).sum(0)
        elif self.use == "split":  # each expert a chunk of the tokens: no expert's tokens are the batch's rows
            y = torch.bmm(h.reshape(2, -1, 8), w.transpose(1, 2)).reshape(h.shape)
        elif self.use == "einsum":
            y = torch.einsum("bi,eoi->bo", h.reshape(-1, 8), w)
        else:  # a depthwise convolution over the sequence
            y = torch.nn.functional.conv1d(h.transpose(1, 2), w, padding=1, groups=8).transpose(1, 2)
        return self.head(y.reshape(h.shape))


@pytest.mark.parametrize(
    "use, operation",
    [
        ("untransposed", "its 3-D parameter block.weight enters bmm untransposed"),
        ("einsum", "its 3-D parameter block.weight enters einsum"),
        ("conv", "its 3-D parameter block.weight enters conv1d"),
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
