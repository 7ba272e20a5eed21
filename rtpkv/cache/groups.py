"""KV cache groups: layers that attend alike share a block table (vLLM's hybrid KV cache manager).

A model whose layers attend over different windows (Gemma 2/3, Qwen2 with max_window_layers)
needs the whole history only in its full-attention layers; its sliding layers need the last W
tokens. Each group of layers of one kind gets its own block table per request over the one
pool: a full group holds every block, a sliding group only the blocks inside its window (it
releases the rest as the request grows, `KVCacheManager.release_out_of_window`). Every group has
the same number of layers (`slots`: a pool block holds that many layers' K/V), as in vLLM: the
kind with the fewest layers sets it, and the others are cut into groups of that many (the last
one possibly shorter, its unused slots left idle).

A model whose layers all attend alike is one group, as before groups existed: its block holds
every layer. Groups serve the tiers, the connector and partial reuse as they serve the device
pool (a tier keeps each group's blocks as records of their own key).

The group order puts full attention first, so group 0's table is the request's `block_table`
and the longest: the scheduler and the reports read it as before. A group's keys chain from a
root of its own (`group_root`), so a block's key names its group; group 0 keeps the model's
root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

FULL_ATTENTION = "full_attention"     # vLLM's KVCacheSpecKind names
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class KVGroup:
    index: int
    window: Optional[int]        # tokens each query attends to; None: full attention
    layers: tuple[int, ...]      # model layers, in slot order

    @property
    def kind(self) -> str:
        return FULL_ATTENTION if self.window is None else SLIDING_WINDOW


def _capped(window: Optional[int], limit: Optional[int]) -> Optional[int]:
    if window is None or limit is None:
        return window if limit is None else limit
    return min(window, limit)


def model_root_name(fingerprint: str, layer_windows: Sequence[Optional[int]],
                    engine_window: Optional[int]) -> str:
    """What a model's key root is made from (`PrefixIndex`): its fingerprint, followed, where
    any layer attends over a window (its own or MAX_ATTENTION_WINDOW), by every layer's window.
    The K/V a layer stores depend on what every layer below it attended to, so two runs that
    differ in a window never share a block; a model without windows keeps its root."""
    windows = [_capped(w, engine_window) for w in layer_windows]
    if all(w is None for w in windows):
        return fingerprint
    return fingerprint + "|windows=" + ",".join("full" if w is None else str(w) for w in windows)


def kv_groups(layer_windows: Sequence[Optional[int]],
              engine_window: Optional[int]) -> tuple[KVGroup, ...]:
    """The groups of a model whose layers attend over `layer_windows`, each capped by the
    engine's window. One group (every layer, the engine's window) where the layers all attend
    alike."""
    windows = [_capped(w, engine_window) for w in layer_windows]
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))   # full first
    if len(kinds) == 1:
        return (KVGroup(0, engine_window, tuple(range(len(windows)))),)
    by_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    slots = min(len(layers) for layers in by_kind.values())
    groups: list[KVGroup] = []
    for window in kinds:
        layers = by_kind[window]
        for start in range(0, len(layers), slots):
            groups.append(KVGroup(len(groups), window, tuple(layers[start:start + slots])))
    return tuple(groups)


def slots(groups: Sequence[KVGroup]) -> int:
    """Layers a pool block holds: the largest group's."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: Sequence[KVGroup]) -> list[tuple[int, int]]:
    """(group, slot) of each model layer, in layer order."""
    placed = {layer: (g.index, slot) for g in groups for slot, layer in enumerate(g.layers)}
    return [placed[layer] for layer in range(len(placed))]


def group_root(root: bytes, group: KVGroup, grouped: bool,
               hash_fn: Callable[[bytes], bytes]) -> bytes:
    """The key a group's first block chains from: the model's root where the model is one
    group, else a hash of it, the group's layers and its window, so that a block's key names
    what its slots hold."""
    if not grouped:
        return root
    return hash_fn(root + f"|kv-group|{group.window}|{','.join(map(str, group.layers))}".encode())
