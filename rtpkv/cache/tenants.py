"""The cache's tenants: who a cached block belongs to, each tenant's quota, and its counts.

A tenant is a `cache_salt` (as bytes; b"" is the requests without one). Its salt enters a
request's chain at the first block the request owns (`KeyChain.tenant`), so every block it
computes carries it (`Block.tenant`); task-prompt blocks are nobody's (tenant None, never
counted). `Tenants` counts each tenant's indexed blocks and tails where `BlockPool` adds and
removes them, knows which tenants are past their quota, and picks the quota victim an
eviction takes first (`TenantEvictionPolicy` keeps each tenant's own order).

A tenant's bound (`TenantQuotas`) is its own entry (CACHE_SALT_QUOTAS at start, or one set
since: `set_quota`, `Pipeline.set_tenant_quota`, the server's `PUT /cache/tenants/{salt}`, as
LMCache lets an operator change a tenant's quota without a restart), else
CACHE_SALT_QUOTA_BLOCKS for a salted tenant; requests without a salt are bounded only by an
entry for "". Stats and events name a tenant by a digest of its salt (`tenant_label`), never
the salt.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from rtpkv.errors import ConfigError

if TYPE_CHECKING:
    from rtpkv.cache.block import Block
    from rtpkv.cache.eviction import EvictionPolicy
    from rtpkv.config import RuntimeConfig


def tenant_label(salt: bytes) -> str:
    """How stats name a tenant: a digest of its salt, never the salt (a tenant's secret)."""
    return hashlib.sha256(salt).hexdigest()[:12] if salt else "(no salt)"


class TenantQuotas:
    """Each tenant's bound on cached blocks, changeable while the engine runs."""

    def __init__(self, default: Optional[int] = None,
                 overrides: Optional[dict[bytes, int]] = None):
        self.default = default
        self.overrides = dict(overrides or {})

    @classmethod
    def from_config(cls, config: "RuntimeConfig") -> Optional["TenantQuotas"]:
        """The configured quotas, or None when there are none (the pool then keeps no
        per-tenant eviction order)."""
        overrides = {salt.encode(): n for salt, n in (config.cache_salt_quotas or {}).items()}
        if config.cache_salt_quota_blocks is None and not overrides:
            return None
        return cls(config.cache_salt_quota_blocks, overrides)

    def __call__(self, salt: bytes) -> Optional[int]:
        return self.overrides.get(salt, self.default if salt else None)

    def set(self, salt: bytes, blocks: Optional[int]) -> None:
        """`salt`'s own bound (None: back to the default)."""
        if blocks is None:
            self.overrides.pop(salt, None)
        elif blocks < 0:
            raise ValueError(f"a quota is a number of KV blocks, 0 or more; got {blocks}")
        else:
            self.overrides[salt] = blocks


Quota = Callable[[bytes], Optional[int]]


class Tenants:
    """Per-tenant counts of cached blocks (indexed blocks and kept tails), the tenants past
    their quota, and their quota evictions. `BlockPool` tells it each change."""

    def __init__(self, quota: Optional[Quota] = None):
        self.quota = quota
        self.blocks: Counter[bytes] = Counter()          # indexed blocks and tails per tenant
        self.quota_evictions: Counter[bytes] = Counter()
        self._over: set[bytes] = set()                    # tenants past their quota

    @property
    def num_over_quota(self) -> int:
        return len(self._over)

    def count(self, tenant: Optional[bytes], delta: int) -> None:
        """A tenant's indexed blocks and tails change by `delta`; track whether it is past its
        quota. A task prompt's blocks (tenant None) are nobody's: not counted."""
        if tenant is None:
            return
        count = self.blocks[tenant] + delta
        if count:
            self.blocks[tenant] = count
        else:
            self.blocks.pop(tenant, None)
        if self.quota is None:
            return
        bound = self.quota(tenant)
        if bound is not None and count > bound:
            self._over.add(tenant)
        else:
            self._over.discard(tenant)

    def quota_victim(self, policy: "EvictionPolicy") -> Optional[int]:
        """A cached block of a tenant past its quota (its own least valuable; the tenant
        furthest past it first, ties by salt: deterministic), or None (always, without
        quotas; with them the pool's policy is a `TenantEvictionPolicy`)."""
        excess = lambda t: self.blocks[t] - self.quota(t)  # noqa: E731
        for tenant in sorted(self._over, key=lambda t: (-excess(t), t)):
            block_id = policy.pop_tenant(tenant)
            if block_id is not None:
                self.quota_evictions[tenant] += 1
                return block_id
        return None

    def set_quota(self, salt: str, blocks: Optional[int]) -> None:
        """Change one tenant's quota now (None: back to CACHE_SALT_QUOTA_BLOCKS); whether it is
        past it is decided now, so it gives way from the next eviction on."""
        if not isinstance(self.quota, TenantQuotas):
            raise ConfigError("per-tenant quotas are off: start with CACHE_SALT_QUOTA_BLOCKS or "
                              "CACHE_SALT_QUOTAS to change them at run time")
        self.quota.set(salt.encode(), blocks)
        self.count(salt.encode(), 0)

    def report(self, salt: str) -> dict[str, object]:
        """One tenant's cached blocks, quota and quota evictions (the operator names it by its
        salt; stats name it by `tenant_label`)."""
        key = salt.encode()
        quota = self.quota(key) if self.quota is not None else None
        return {"tenant": tenant_label(key), "cached_blocks": self.blocks[key],
                "quota_blocks": quota, "quota_evictions": self.quota_evictions[key],
                "over_quota": quota is not None and self.blocks[key] > quota}

    def stats(self) -> dict[str, object]:
        """Per-tenant counts (cached blocks, quota, quota evictions), each tenant named by a
        digest of its salt: counts only, never a key, a token or a salt."""
        tenants = set(self.blocks) | set(self.quota_evictions)
        return {
            "tenants_over_quota": self.num_over_quota,
            "quota_evictions": sum(self.quota_evictions.values()),
            "tenants": {tenant_label(t): {
                "blocks": self.blocks[t],
                "quota": self.quota(t) if self.quota is not None else None,
                "quota_evictions": self.quota_evictions[t]} for t in sorted(tenants)},
        }

    def check_integrity(self, blocks: Iterable["Block"]) -> None:
        """The counts equal the pool's indexed blocks and tails per tenant, and the over-quota
        set follows from them."""
        held = Counter(b.tenant for b in blocks
                       if (b.indexed or b.tail) and b.tenant is not None)
        assert held == self.blocks, "per-tenant block counts drifted"
        if self.quota is not None:
            assert self._over == {t for t, n in held.items()
                                  if (q := self.quota(t)) is not None and n > q}, \
                "the over-quota set drifted"
