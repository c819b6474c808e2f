"""The pool's groups: linear targets joined into the multi-slice layout one launch serves."""

import collections

import pytest
import torch
from peft import LoraConfig
from torch.utils._python_dispatch import TorchDispatchMode

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
    attention = "model.layers.0.self_attn"
    with pytest.raises(NotServed, match="not neighbours"):
        pool.join((f"{attention}.q_proj", f"{attention}.v_proj"))  # k_proj lies between them
    with pytest.raises(NotServed, match="not neighbours"):
        pool.join(QKV[::-1])
    mixed = ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")  # different input widths
    with pytest.raises(NotServed, match="input width"):
        pool.join(mixed)
    with pytest.raises(NotServed, match="different layers"):
        pool.join(("model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj"))
    assert pool.groups == {}


def test_joins_share_the_members_tensors_whatever_was_built_first(model_and_pool):
    """A graph that reads a member alone and one that reads its group read the same memory,
    in either order, and overlapping groups too: nothing moves when a group is made."""
    model, pool = model_and_pool
    members = [pool.targets[f] for f in QKV]
    alone = [(m.lora_a.data_ptr(), m.lora_b.data_ptr()) for m in members]
    whole, pair = pool.join(QKV), pool.join(QKV[1:])
    assert [(m.lora_a.data_ptr(), m.lora_b.data_ptr()) for m in members] == alone
    assert whole.lora_a.data_ptr() == members[0].lora_a.data_ptr()
    assert pair.lora_a.data_ptr() == members[1].lora_a.data_ptr() and pair.lora_b.data_ptr() == members[1].lora_b.data_ptr()
    slot = pool.load(adapter(model, "late", 2, 4, ["k_proj", "v_proj"]))
    assert torch.equal(pair.lora_a[slot], whole.lora_a[slot, 8:])
    assert pair.rank.view(3, 2)[slot].tolist() == [4, 4] and whole.rank.view(3, 3)[slot].tolist() == [0, 4, 4]


class _Launches(TorchDispatchMode):
    """Counts the ops that launch work (fills, copies, gathers), not views: ``calls`` each op
    once, ``count`` a list op once per tensor it writes."""

    def __init__(self):
        super().__init__()
        self.count, self.calls = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("zero_", "fill_", "copy_", "index_select", "index_put_", "_foreach_zero_", "_foreach_copy_"):
            self.calls[name] += 1
            self.count[name] += len(args[0]) if name.startswith("_foreach") else 1
        return func(*args, **(kwargs or {}))


def test_a_slot_is_written_by_tensor_not_by_target(model_and_pool):
    """Writing an adapter into a slot fills each stack's two tensors and copies each factor in
    one list op each, copies each set's scaling and rank once, and every group's in one list
    copy a value: no launch per target, group and value."""
    model, pool = model_and_pool
    group = pool.join(QKV)
    later = pool.join(tuple(f"model.layers.1.self_attn.{p}_proj" for p in "kv"))  # another layer's
    slot = pool.load(adapter(model, "x", 3, 4, "all-linear"))
    stacks = sum(len(s.stacks) for s in pool._sets)
    with _Launches() as launches:
        pool._write(slot, pool.adapters["x"])
    sets, groups = len(pool._sets), 2
    assert launches.calls == {"_foreach_zero_": 1, "_foreach_copy_": 1 + 2, "copy_": 2 * sets}
    assert launches.count == {"_foreach_zero_": 2 * stacks, "_foreach_copy_": 2 * len(pool.targets) + 2 * groups, "copy_": 2 * sets}
    assert later.rank.view(3, 2)[slot].tolist() == [4, 4]
    for target in pool.targets.values():  # and it wrote what the adapter holds
        f = pool.adapters["x"].modules[target.fqn]
        assert torch.equal(target.lora_a[slot, : f.rank], f.a) and torch.equal(target.lora_b[slot, :, : f.rank], f.b)
        assert not target.lora_a[slot, f.rank :].any() and target.rank[slot] == f.rank
        assert target.scaling[slot] == pytest.approx(f.scaling)
    assert group.rank.view(3, 3)[slot].tolist() == [4, 4, 4]
