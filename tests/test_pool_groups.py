"""The pool's groups: linear targets joined into the multi-slice layout one launch serves."""

import pytest
import torch
from peft import LoraConfig

from fxlora.adapters import AdapterPool, PoolGroup, model_modules, read_adapter
from fxlora.errors import NotServed
from fxlora.testing import make_adapter, tiny_model

QKV = tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")


@pytest.fixture
def model_and_pool():
    model = tiny_model("llama")
    pool = AdapterPool(max_loras=3, max_rank=8, target_modules="all-linear")
    pool.register_modules(model_modules(model), complete=True)
    return model, pool


def adapter(model, name, seed, r, targets):
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets)
    return read_adapter(name, make_adapter(model, config, seed=seed, directory=""))


def test_join_lays_members_out_as_slices_and_loads_reach_the_group(model_and_pool):
    model, pool = model_and_pool
    first = pool.load(adapter(model, "first", 0, 4, ["q_proj", "v_proj"]))
    group = pool.join(QKV)
    assert isinstance(group, PoolGroup) and pool.join(QKV) is group
    members = [pool.targets[f] for f in QKV]
    assert group.widths == tuple(m.info.out_features for m in members)
    assert group.lora_a.shape == (3, 3 * 8, members[0].info.in_features)
    assert group.lora_b.shape == (3, sum(group.widths), 8)
    second = pool.load(adapter(model, "second", 1, 8, ["k_proj"]))  # written after the join
    col = 0
    for i, m in enumerate(members):
        # each member's factors are a view of the group's: one write serves both
        assert m.lora_a.untyped_storage().data_ptr() == group.lora_a.untyped_storage().data_ptr()
        assert torch.equal(group.lora_a[:, i * 8 : (i + 1) * 8], m.lora_a)
        assert torch.equal(group.lora_b[:, col : col + m.info.out_features], m.lora_b)
        col += m.info.out_features
        for slot in (first, second):
            assert group.rank[slot * 3 + i] == m.rank[slot]
            assert group.scaling[slot * 3 + i] == m.scaling[slot]
    assert group.rank.view(3, 3)[first].tolist() == [4, 0, 4]
    assert group.rank.view(3, 3)[second].tolist() == [0, 8, 0]
    before = group.lora_b[second].clone()
    assert before.abs().sum() > 0
    pool.unload("second")
    assert group.rank.view(3, 3)[second].tolist() == [0, 0, 0]
    assert not group.lora_b[second].any() and not group.lora_a[second].any()


def test_join_refuses_what_cannot_be_joined(model_and_pool):
    _, pool = model_and_pool
    pool.targets["model.layers.1.self_attn.q_proj"].wired = True  # a graph reads it alone
    layer1 = tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")
    with pytest.raises(NotServed, match="already served on its own"):
        pool.join(layer1)
    assert isinstance(pool.join(QKV), PoolGroup)
    with pytest.raises(NotServed, match="another group"):
        pool.join(QKV[:2])
    mixed = ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")  # different input widths
    with pytest.raises(NotServed, match="input width"):
        pool.join(mixed)
    assert set(pool.groups) == {QKV}
