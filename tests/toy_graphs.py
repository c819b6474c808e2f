"""A small hand-written module, its FX graph and an adapter pool, for the pass tests."""

import torch
import torch.fx as fx
import torch.nn.functional as F
from peft import LoraConfig

from fxlora.adapters import AdapterPool, model_modules, read_adapter


class Toy(torch.nn.Module):
    """embedding -> linear (+bias) -> relu -> linear; only ``emb`` and ``lin1`` get LoRA."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.lin1 = torch.nn.Linear(8, 6)
        self.lin2 = torch.nn.Linear(6, 5, bias=False)

    def forward(self, ids):
        h = F.embedding(ids, self.emb.weight)
        return F.linear(torch.relu(F.linear(h, self.lin1.weight, self.lin1.bias)), self.lin2.weight)


class _Record(fx.Interpreter):
    """Runs the graph once, storing each node's value in ``meta["val"]`` as tracers do."""

    def run_node(self, n):
        out = super().run_node(n)
        n.meta["val"] = out
        return out


def toy_graph(ids: torch.Tensor) -> tuple[Toy, fx.GraphModule]:
    torch.manual_seed(0)
    toy = Toy().eval()
    gm = fx.symbolic_trace(toy)
    _Record(gm).run(ids)
    return toy, gm


def toy_adapter(seed: int, rank: int, alpha: float = 4.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    state = {
        "base_model.model.lin1.lora_A.weight": r(rank, 8),
        "base_model.model.lin1.lora_B.weight": r(6, rank),
        "base_model.model.emb.lora_embedding_A": r(rank, 11),
        "base_model.model.emb.lora_embedding_B": r(8, rank),
    }
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=["lin1", "emb"]), state


def toy_pool(toy: Toy) -> AdapterPool:
    pool = AdapterPool(max_loras=3, max_rank=4)
    pool.load(read_adapter("one", toy_adapter(1, 2)))
    pool.load(read_adapter("two", toy_adapter(2, 4, alpha=2.0)))
    pool.register_modules(model_modules(toy), complete=True)
    return pool


def toy_expected(toy: Toy, pool: AdapterPool, ids: torch.Tensor, names: list) -> torch.Tensor:
    """The LoRA forward written out row by row, straight from the adapters' factors."""
    rows = []
    for i, name in enumerate(names):
        h = F.embedding(ids[i], toy.emb.weight)
        if name is not None:
            f = pool.adapters[name].modules["emb"]
            h = h + F.embedding(ids[i], f.a.T) @ f.b.T * f.scaling
        y = F.linear(h, toy.lin1.weight, toy.lin1.bias)
        if name is not None:
            f = pool.adapters[name].modules["lin1"]
            y = y + (h @ f.a.T) @ f.b.T * f.scaling
        rows.append(F.linear(torch.relu(y), toy.lin2.weight))
    return torch.stack(rows)
