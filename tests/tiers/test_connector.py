"""The connector API seen through its tier adapter, without a model: every connector step is
driven, failures are misses, staging blocks never leak."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest
import torch

from rtpkv.cache.connector import (ConnectorContext, ConnectorRequest, ConnectorStep,
                                   KvCacheConnector)
from rtpkv.cache.tiers.connector import ConnectorTier, load_connector_class, make_connector_tier
from rtpkv.cache.tiers import BlockMeta, TierLayout

LAYOUT = TierLayout(fingerprint="ab" * 32, block_size=4, dtype=torch.float32, shape=(2, 3, 2, 4, 8))
CONTEXT = ConnectorContext(layout=LAYOUT, num_layers=3, num_staging_blocks=4)


def meta(i: int) -> BlockMeta:
    return BlockMeta(key=i.to_bytes(32, "little"), parent_key=(i + 100).to_bytes(32, "little"),
                     tokens=(i, i, i, i))


def payload(i: int) -> torch.Tensor:
    return torch.full(LAYOUT.shape, float(i))


class DictConnector(KvCacheConnector):
    """A store in a dict, recording every call it gets."""

    def __init__(self, context=None):
        super().__init__(context)
        self.store: dict[bytes, torch.Tensor] = {}
        self.calls: list[str] = []
        self.kv = None

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int):
        self.calls.append("match")
        n = 0
        while n < request.num_blocks and request.block_keys[n] in self.store:
            n += 1
        return n * self.context.layout.block_size, False

    def update_state_after_alloc(self, request, block_ids):
        self.calls.append("alloc")
        self.allocated = list(block_ids)

    def build_connector_meta(self, step: ConnectorStep) -> Any:
        self.calls.append("meta")
        return {"load": [(t.key, t.block_id) for t in step.load],
                "save": [(t.key, t.block_id) for t in step.save]}

    def register_kv_caches(self, kv_cache_tensor):
        self.calls.append("register")
        self.kv = kv_cache_tensor

    def start_load_kv(self):
        self.calls.append("start_load")
        for key, block_id in self._metadata["load"]:
            self.kv[block_id].copy_(self.store[key])

    def wait_for_layer_load(self, layer_idx):
        self.calls.append(f"wait_layer{layer_idx}")

    def save_kv_layer(self, layer_idx):
        self.calls.append(f"save_layer{layer_idx}")

    def wait_for_save(self):
        self.calls.append("wait_save")
        for key, block_id in self._metadata["save"]:
            self.store[key] = self.kv[block_id].clone()

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        self.calls.append("finished")
        return [], list(started_loading_req_ids)


@pytest.fixture
def tier():
    made = []

    def make(connector=None, context=CONTEXT) -> ConnectorTier:
        t = make_connector_tier(connector or DictConnector, context)
        made.append(t)
        return t

    yield make
    for t in made:
        t.check_integrity()
        t.close()


def test_every_step_is_driven_in_order(tier):
    t = tier()
    c = t.connector
    assert c.calls == ["register"] and c.kv.shape == (4, *LAYOUT.shape)
    source = payload(1)
    t.store(meta(1), source)
    source.zero_()
    assert c.calls[1:] == ["meta", "save_layer0", "save_layer1", "save_layer2", "wait_save"]
    t.store(meta(2), payload(2))
    c.calls.clear()
    assert t.lookup([meta(1).key, meta(2).key, meta(3).key]) == 2
    assert torch.equal(t.load(meta(1)), payload(1))
    assert torch.equal(t.load(meta(2)), payload(2))
    assert c.calls == ["match", "alloc", "meta", "start_load", "wait_layer0", "wait_layer1",
                       "wait_layer2", "finished"]
    s = t.stats()
    assert (s["connector_hits"], s["connector_onboarded_blocks"], s["connector_saved_blocks"]) == (2, 2, 2)


def test_a_load_outside_the_matched_chain_is_a_miss(tier):
    t = tier()
    t.store(meta(1), payload(1))
    assert t.load(meta(1)) is None                          # no lookup first
    assert t.lookup([meta(1).key]) == 1
    assert t.load(meta(5)) is None
    assert t.lookup([meta(5).key]) == 0


def test_blocks_staged_but_not_taken_are_released(tier):
    t = tier()
    for i in (1, 2, 3):
        t.store(meta(i), payload(i))
    assert t.lookup([meta(i).key for i in (1, 2, 3)]) == 3
    assert t.load(meta(1)) is not None                      # the manager stops after one
    t.check_integrity()
    assert t.lookup([meta(2).key]) == 1                     # the next lookup frees the rest
    assert len(t._free) == 4


def test_one_walk_matches_a_chain_per_group_and_the_next_walk_lets_go(tier):
    """A walk's lookups (one chain per KV cache group) are all staged for its loads; a walk
    that loaded nothing leaves nothing staged for the next (4 staging blocks here)."""
    t = tier()
    for i in (1, 2, 3):
        t.store(meta(i), payload(i))
    t.begin_walk()
    assert t.lookup([meta(1).key, meta(2).key]) == 2
    assert t.lookup([meta(3).key]) == 1                     # another group's chain
    assert torch.equal(t.load(meta(3)), payload(3))
    assert torch.equal(t.load(meta(1)), payload(1))
    for _ in range(3):
        t.begin_walk()
        assert t.lookup([meta(i).key for i in (1, 2, 3)]) == 3
    t.check_integrity()
    assert len(t._free) == 4


class Raising(DictConnector):
    def __init__(self, where: str):
        super().__init__(CONTEXT)
        self.where = where

    def _maybe(self, name):
        if self.where == name:
            raise RuntimeError(f"store down in {name}")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._maybe("match")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def start_load_kv(self):
        self._maybe("load")
        super().start_load_kv()

    def wait_for_save(self):
        self._maybe("save")
        super().wait_for_save()


@pytest.mark.parametrize("where", ["match", "load", "save"])
def test_a_connector_that_raises_is_logged_and_a_miss(tier, caplog, where):
    c = Raising(where)
    t = tier(c)
    with caplog.at_level(logging.ERROR, logger="rtpkv"):
        t.store(meta(1), payload(1))
        found = t.lookup([meta(1).key])
        loaded = t.load(meta(1)) if found else None
    assert loaded is None
    assert f"store down in {where}" in caplog.text
    assert t.stats()["connector_errors"] == 1
    assert t.stats()["connector_saved_blocks"] == (0 if where == "save" else 1)


@pytest.mark.parametrize("answer", [3, -4, "8", 400])
def test_a_bad_token_count_is_a_miss_or_capped(tier, answer):
    class Odd(DictConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return answer, False

    t = tier(Odd)
    t.store(meta(1), payload(1))
    found = t.lookup([meta(1).key])
    assert found == (1 if answer == 400 else 0)


def test_asynchronous_saves_hold_staging_until_finished(tier):
    class Async(DictConnector):
        done: list[int] = []

        def request_finished(self, request, block_ids):
            self.last = request.request_id
            return True

        def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
            done = [r for r in finished_gen_req_ids if r in self.done]
            return done, list(started_loading_req_ids)

    t = tier(Async)
    for i in range(4):
        t.store(meta(i), payload(i))
    assert t.stats()["connector_saves_in_flight"] == 4
    t.check_integrity()
    t.store(meta(9), payload(9))                              # no staging block free: dropped
    assert t.stats()["connector_saves_dropped"] == 1
    assert t.lookup([meta(0).key]) == 0                       # no staging block to load into
    t.connector.done.append(t.connector.last)
    t.store(meta(10), payload(10))                            # reaped, then saved
    assert t.stats()["connector_saved_blocks"] == 5


def test_an_instance_made_without_context_gets_the_engines():
    c = DictConnector()
    t = make_connector_tier(c, CONTEXT)
    assert c.context is CONTEXT and t.connector is c


def test_loading_by_module_and_class_name(monkeypatch):
    module = types.ModuleType("my_connectors")
    module.DictConnector = DictConnector
    module.NotOne = dict
    monkeypatch.setitem(sys.modules, "my_connectors", module)
    assert load_connector_class("my_connectors", "DictConnector") is DictConnector
    with pytest.raises(ValueError, match="KV_CONNECTOR_CLASS='NotOne'"):
        load_connector_class("my_connectors", "NotOne")
    with pytest.raises(ValueError, match="KV_CONNECTOR_CLASS='Missing'"):
        load_connector_class("my_connectors", "Missing")
    with pytest.raises(ValueError, match="KV_CONNECTOR_MODULE='no_such_module_xyz'"):
        load_connector_class("no_such_module_xyz", "X")
    with pytest.raises(ValueError, match="kv_connector"):
        make_connector_tier(object(), CONTEXT)
