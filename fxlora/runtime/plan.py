"""What the engine takes in at a turn, the same on every rank of a tensor-parallel model.

A :class:`Plan` is a turn's news: the requests added, the requests cancelled, and whether the
loop stops. On one process it is what the caller queued. Under tensor parallelism rank 0
decides: its plan travels to the other ranks through torch.distributed (as JSON bytes in a
tensor, never pickled), which take it in place of their own queues, so every rank admits,
prefills, decodes and ends the same requests at the same turn. Nothing else the engine
decides depends on the host: the tokens and the finished flags it reads are the same on every
rank.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

from fxlora.runtime.sequence import Decoding, Sequence


@dataclass
class Plan:
    added: list[Sequence] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    stop: bool = False

    def broadcast(self, group: object) -> Plan:
        """Rank 0's plan, on every rank of ``group``."""
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        # (the engine sends plans over a host backend; NCCL works too, waiting for the device)
        source = dist.get_global_rank(group, 0)
        payload = json.dumps(self._encode()).encode() if dist.get_rank(group) == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.long, device=device)
        dist.broadcast(size, source, group=group)
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
        if payload:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        dist.broadcast(data, source, group=group)
        return self if payload else Plan._decode(json.loads(bytes(data.cpu().tolist()).decode()))

    def _encode(self) -> dict:
        added = [
            dict(request_id=s.request_id, prompt=s.prompt_ids, adapter=s.adapter_name, streaming=s.streaming,
                 decoding=dataclasses.asdict(s.decoding))
            for s in self.added
        ]  # fmt: skip
        return dict(added=added, cancelled=sorted(self.cancelled), stop=self.stop)

    @staticmethod
    def _decode(values: dict) -> Plan:
        added = []
        for a in values["added"]:
            decoding = Decoding(**{**a["decoding"], "eos_token_ids": tuple(a["decoding"]["eos_token_ids"])})
            added.append(Sequence(a["request_id"], a["prompt"], a["adapter"], decoding, a["streaming"]))
        return Plan(added, set(values["cancelled"]), values["stop"])
