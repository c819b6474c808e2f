"""Tiny random-weight models and PEFT adapters for tests and demos (no model hub).

``tiny_model(family)`` builds a ``transformers`` causal LM from a config with random
weights, ``quantized_model`` a torchao-quantised copy of one; ``make_adapter`` wraps a copy of it with PEFT, gives the LoRA factors random
values and returns the adapter saved to a directory or as ``(config, state_dict)``.
"""

from __future__ import annotations

import copy
import re
import tempfile
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

# model_type and the config fields that make it tiny; every family is a dense decoder.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3"),
    "gemma2": dict(model_type="gemma2"),
    "gemma3": dict(model_type="gemma3_text"),
    "phi3": dict(model_type="phi3"),
    "gpt2": dict(model_type="gpt2"),  # Conv1D linears: weights stored (in, out), fan_in_fan_out
}

# MoE decoders: 4 routed experts, 2 per token, on every layer unless the family keeps dense
# first layers; experts implementations read from each experts class.
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
                        rope_interleave=True, head_dim=4, num_key_value_heads=4),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                    layer_types=None),
}  # fmt: skip


def tiny_config(
    family: str,
    *,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 48,
    vocab_size: int = 96,
    **overrides: Any,
):
    """``overrides``: further config fields (e.g. the number of experts of an MoE family)."""
    from transformers import AutoConfig

    kw = {**(FAMILIES.get(family) or MOE_FAMILIES[family]), **overrides}
    model_type = kw.pop("model_type")
    if model_type == "gpt2":
        return AutoConfig.for_model(
            "gpt2", n_embd=hidden_size, n_layer=num_hidden_layers, n_head=num_attention_heads, n_inner=intermediate_size,
            vocab_size=vocab_size, n_positions=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    return AutoConfig.for_model(
        model_type,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=kw.pop("num_key_value_heads", num_key_value_heads),
        head_dim=kw.pop("head_dim", hidden_size // num_attention_heads),
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kw: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **config_kw), dtype=dtype)
    fill_zero_weights(model, 0.5)
    return model.eval()


@torch.no_grad()
def fill_zero_weights(model: torch.nn.Module, std: float) -> None:
    """Draw every all-zero weight matrix from ``N(0, std²)``: ``transformers`` starts MoE
    routers at zero, where every token would pick the same experts."""
    for p in model.parameters():
        if p.dim() >= 2 and not p.any():
            p.normal_(0.0, std)


def quantized_model(model: torch.nn.Module, quant_type: Any, **kwargs: Any) -> torch.nn.Module:
    """``model`` quantised by torchao as transformers users load one: saved to a temporary
    directory and read back with ``from_pretrained(..., quantization_config=TorchAoConfig(
    quant_type))`` (``kwargs``: further ``from_pretrained`` arguments). No hub needed."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    with tempfile.TemporaryDirectory(prefix="fxlora-quantized-") as directory:
        model.save_pretrained(directory)
        quantized = AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=TorchAoConfig(quant_type), dtype=model.dtype, **kwargs
        )
    return quantized.eval()


def lora_module_names(model: torch.nn.Module) -> list[str]:
    """Short names (``q_proj``, ``embed_tokens``, ...) of every linear and embedding module
    that sees one input per row: position embeddings, whose ids all rows share, are left out."""
    from fxlora.adapters import model_modules

    shared = {"wpe", "embed_positions"}
    modules = model_modules(model)
    return sorted({n for name, info in modules.items() if (n := name.rsplit(".", 1)[-1]) not in shared and not info.parameter})


def layered_module_names(model: torch.nn.Module) -> list[str]:
    """The short names of :func:`lora_module_names` that live inside numbered layers (the ones
    ``layers_to_transform`` can select)."""
    from fxlora.adapters import model_modules

    modules = model_modules(model)
    return sorted({name.rsplit(".", 1)[-1] for name, info in modules.items() if re.search(r"\.\d+\.", name) and not info.parameter})


@torch.no_grad()
def make_adapter(
    model: torch.nn.Module, config: LoraConfig, seed: int, directory: str | None = None, scale: float = 0.5
) -> Any:
    """A PEFT LoRA adapter for ``model`` with random factors of size about ``scale``.

    Saved with ``save_pretrained`` into ``directory`` (or a new temporary directory) and
    returned as its path; with ``directory=""`` returned in memory as ``(config, state_dict)``.
    """
    config = copy.deepcopy(config)
    config.init_lora_weights = False
    peft_model = get_peft_model(copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            fan = 1 if "lora_embedding_A" in name else p.shape[-1]  # an embedding's A is looked up, not summed
            p.copy_(torch.randn(p.shape, generator=gen) * scale / fan**0.5)
    if directory == "":
        state = get_peft_model_state_dict(peft_model)
        return peft_model.peft_config["default"], {k: v.clone() for k, v in state.items()}
    directory = directory or tempfile.mkdtemp(prefix="fxlora-adapter-")
    peft_model.save_pretrained(directory)
    return directory


@torch.no_grad()
def per_expert_adapter(model: torch.nn.Module, r: int, seed: int, names=("gate_proj", "up_proj", "down_proj"), scale: float = 0.5):
    """``(LoraConfig, state_dict)`` of LoRA on every expert as separate modules
    (``experts.<e>.gate_proj`` ...), as adapters written against per-expert layouts are; ``names``
    are the gate, up and down projections' names (Mixtral's: ``w1, w3, w2``)."""
    from fxlora.adapters import experts

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for fqn, module in model.named_modules():
        if not experts.is_experts(module):
            continue
        params = experts.experts_parameters(module)
        up = experts.up_name(module)
        fin_up, fout_up = experts.in_out(module, params[up])
        fin_down, fout_down = experts.in_out(module, params["down_proj"])
        width = fout_up // 2 if module.has_gate else fout_up
        shapes = dict(zip(names, [(fin_up, width), (fin_up, width), (fin_down, fout_down)]))
        if not module.has_gate:
            shapes.pop(names[0])
        for e in range(params["down_proj"].shape[0]):
            for name, (fin, fout) in shapes.items():
                prefix = f"base_model.model.{fqn}.{e}.{name}"
                state[f"{prefix}.lora_A.weight"] = torch.randn(r, fin, generator=gen) * scale / fin**0.5
                state[f"{prefix}.lora_B.weight"] = torch.randn(fout, r, generator=gen) * scale / r**0.5
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(names))
    return config, state


def shared_outer(adapter: tuple, shared: str = "B") -> tuple:
    """A ``target_parameters`` adapter ``(config, state_dict)`` rewritten to the shared-outer
    layout: factor ``shared`` (``"A"`` or ``"B"``) keeps expert 0's slice only, shared by all."""
    config, state = adapter
    out = {}
    for key, t in state.items():
        r = config.r
        if f".lora_{shared}." in key and "experts" in key:
            t = t[:r] if shared == "A" else t.reshape(t.shape[0], r, -1)[..., 0]
        out[key] = t.clone()
    return config, out
