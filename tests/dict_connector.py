"""A KvCacheConnector whose store is a dict in a class attribute, shared by every instance (a
'remote' store a second pipeline reads): the pipeline tests' user connector. Reset it with
`DictConnector.blocks = {}`."""

from __future__ import annotations

import torch

from rtpkv.cache.connector import KvCacheConnector


class DictConnector(KvCacheConnector):
    blocks: dict[bytes, torch.Tensor] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = 0
        while n < request.num_blocks and request.block_keys[n] in self.blocks:
            n += 1
        return n * self.context.layout.block_size, False

    def register_kv_caches(self, kv_cache_tensor):
        self.kv = kv_cache_tensor

    def start_load_kv(self):
        for t in self._metadata.load:
            self.kv[t.block_id].copy_(self.blocks[t.key])

    def wait_for_save(self):
        for t in self._metadata.save:
            self.blocks[t.key] = self.kv[t.block_id].clone()
