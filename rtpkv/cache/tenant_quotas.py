"""TenantQuotas: each tenant's bound on cached blocks, read by the pool at every eviction and
changeable while the engine runs (`BlockPool.set_quota`, `Pipeline.set_tenant_quota`, the
server's `PUT /cache/tenants/{salt}`), as LMCache lets an operator change a tenant's quota
without a restart.

A tenant is a `cache_salt` (as bytes; b"" is the requests without one). Its bound is its own
entry (CACHE_SALT_QUOTAS at start, or one set since), else CACHE_SALT_QUOTA_BLOCKS for a salted
tenant; requests without a salt are bounded only by an entry for "".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from rtpkv.config import RuntimeConfig


class TenantQuotas:
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
