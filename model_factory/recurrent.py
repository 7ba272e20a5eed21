"""Recurrent layers (linear attention, state-space models): the interface a layer kind
implements, and the pool that holds every sequence's state.

A recurrent layer keeps no per-token K/V: each sequence has a fixed set of state tensors that
every token overwrites (Gated DeltaNet: its short convolution's window and one recurrent matrix
per head; Mamba2: its convolution window and SSM state). The states of every recurrent layer of
a model live in one `StatePool`: slot s of each of its tensors is one sequence's state. A running
request holds one live slot from admission to its end; the cache's state checkpoints (a state
group's blocks) are slots of the same pool, so saving a checkpoint and restoring one are copies
between slots (`StatePool.copy`), and a layer can write a checkpoint itself in the middle of a
chunk (`RecurrentBatch.snapshots`): the state after exactly that many tokens.

The contract that keeps reuse exact: a layer computes each sequence token by token, with a fixed
order of operations on that sequence's own values, so the state after n tokens has the same bits
whether those tokens came in one chunk or many, alone or beside other sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one sequence in one layer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RecurrentBatch:
    """What a recurrent layer needs of a forward's batch: per sequence, its rows (contiguous,
    `query_start` and `query_len`, in the order of the forward's rows), its live state slot
    (holding the state before its first row), and the checkpoints to write on the way:
    `snapshots[i]` lists (n, slot) pairs, 1 <= n <= query_len[i]: the state after the first n
    rows of sequence i is copied into `slot`."""

    query_start: Sequence[int]
    query_len: Sequence[int]
    slots: Sequence[int]
    snapshots: Sequence[Sequence[tuple[int, int]]] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        n = len(self.query_start)
        if not len(self.query_len) == len(self.slots) == n:
            raise ValueError(f"{n} sequences but {len(self.query_len)} lengths and "
                             f"{len(self.slots)} state slots")
        if self.snapshots and len(self.snapshots) != n:
            raise ValueError(f"{n} sequences but {len(self.snapshots)} snapshot lists")
        for i, pairs in enumerate(self.snapshots):
            for tokens, _ in pairs:
                if not 1 <= tokens <= self.query_len[i]:
                    raise ValueError(f"sequence {i}: a snapshot after {tokens} tokens is outside "
                                     f"its chunk of {self.query_len[i]}")

    def snapshots_of(self, i: int) -> Sequence[tuple[int, int]]:
        return self.snapshots[i] if self.snapshots else ()


@runtime_checkable
class RecurrentLayer(Protocol):
    """A token mixer whose memory is a per-sequence state (model_factory/gated_delta.py's
    GatedDeltaNet is one). The decoder layer calls it where an attention layer would be
    called, with the forward's hidden rows after the input norm."""

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The state tensors one sequence needs in this layer, in the order `forward` takes
        them."""
        ...

    def forward(self, x: torch.Tensor, batch: RecurrentBatch,
                states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The layer's output rows for `x` (rows, hidden). `states`: this layer's pool tensors,
        one per state spec, each (slots, *spec.shape); each sequence's slot is read, advanced
        over its rows in place, and copied into its snapshot slots after the rows they name."""
        ...


class StatePool:
    """The state tensors of every recurrent layer, `num_slots` sequences' worth each, and the
    free list of their slots. Slot 0.. are interchangeable: the engine takes a live slot per
    running request, the cache its checkpoints."""

    def __init__(self, layer_specs: Sequence[Sequence[StateSpec]], num_slots: int,
                 device: torch.device = torch.device("cpu")):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least 1 slot, not {num_slots}")
        self.specs = [tuple(specs) for specs in layer_specs]
        self.num_slots = num_slots
        self.tensors: list[list[torch.Tensor]] = [
            [torch.zeros((num_slots, *spec.shape), dtype=spec.dtype, device=device)
             for spec in specs] for specs in self.specs]
        self._free = list(range(num_slots - 1, -1, -1))   # popped from the end: lowest first

    @staticmethod
    def slot_bytes(layer_specs: Sequence[Sequence[StateSpec]]) -> int:
        """Bytes of one sequence's state in every layer."""
        return sum(spec.nbytes for specs in layer_specs for spec in specs)

    @property
    def bytes_per_slot(self) -> int:
        return self.slot_bytes(self.specs)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot (its contents undefined: `zero` or `copy` into it before use)."""
        if not self._free:
            raise RuntimeError(f"the state pool's {self.num_slots} slots are all taken")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not taken")
        self._free.append(slot)

    def zero(self, slot: int) -> None:
        """The state before a sequence's first token."""
        for tensors in self.tensors:
            for t in tensors:
                t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` becomes a copy of slot `src` in every layer (a checkpoint saved or
        restored)."""
        for tensors in self.tensors:
            for t in tensors:
                t[dst].copy_(t[src])

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """Views of one slot's tensors, every layer's in order (for a tier to copy)."""
        return [t[slot] for tensors in self.tensors for t in tensors]

    def write_slot(self, slot: int, values: Sequence[torch.Tensor]) -> None:
        """Slot `slot` set from `read_slot`-ordered tensors."""
        views = self.read_slot(slot)
        if len(values) != len(views):
            raise ValueError(f"{len(values)} state tensors for a slot of {len(views)}")
        for view, value in zip(views, values):
            if value.shape != view.shape:
                raise ValueError(f"a state tensor of shape {tuple(value.shape)} for a slot "
                                 f"tensor of {tuple(view.shape)}")
            view.copy_(value)
