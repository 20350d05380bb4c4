"""The state pool's slots: for a hybrid model (linear-attention layers beside full-attention ones),
each running request holds one slot, which keeps every linear layer's recurrent state and conv
state (the runner's tensors, worker/model_runner.py). A slot is taken on admission and given back
on finish, abort and preemption (a preempted request recomputes its state from its tokens); a
sequence that starts at position 0 ignores what its slot held, so a slot is never cleared.

The block manager holds this pool beside its KV blocks, so one admission takes both or neither:
with no free slot a request waits, as it does with no free blocks."""
from __future__ import annotations

from dataclasses import dataclass, field

from roseinfer.engine.request import Request


@dataclass
class StatePool:
    num_slots: int
    free_slots: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.free_slots = list(range(self.num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate(self, req: Request) -> bool:
        """A slot for the request (kept if it has one); False when none is free."""
        if req.state_slot is not None:
            return True
        if not self.free_slots:
            return False
        req.state_slot = self.free_slots.pop()
        return True

    def free(self, req: Request) -> None:
        if req.state_slot is not None:
            self.free_slots.append(req.state_slot)
            req.state_slot = None
