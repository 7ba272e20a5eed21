"""Tenants on a server: the operator's switches on who a request's cache belongs to.

A multi-tenant gateway names the tenant in a header (Dynamo's `x-tenant-id`). With
TENANT_HEADER_SALT=1 the header's value is the request's `cache_salt`, so two tenants never hit
each other's blocks; a salt the client gives itself (`cache_salt`, or `prompt_cache_key` under
PROMPT_CACHE_KEY_SALT=1) only narrows it within the tenant ("acme/<salt>"), and a request
without the header gets "/<salt>": no client can name its way into a tenant's blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from rtpkv.server.errors import ApiError, ErrorCode

TENANT_VALUE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True)
class CacheSwitches:
    """What the operator lets clients' cache words do (Settings: PROMPT_CACHE_KEY_SALT,
    TENANT_HEADER with TENANT_HEADER_SALT, ADMIN_API_KEY)."""

    prompt_cache_key_salt: bool = False
    tenant_header: Optional[str] = None   # None: the tenant is not read from a header
    admin_api_key: Optional[str] = None

    @classmethod
    def from_settings(cls, settings: Any) -> "CacheSwitches":
        return cls(settings.prompt_cache_key_salt,
                   settings.tenant_header if settings.tenant_header_salt else None,
                   settings.admin_api_key)

    def tenant(self, headers: Mapping[str, str]) -> Optional[str]:
        """The request's tenant from its header, or None (no header, or the switch is off)."""
        if self.tenant_header is None:
            return None
        value = headers.get(self.tenant_header)
        if value is None:
            return None
        if not TENANT_VALUE.match(value):
            raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           f"header {self.tenant_header}: {value[:140]!r} is invalid; accepted: "
                           "1 to 128 of A-Z a-z 0-9 . _ : -", self.tenant_header)
        return value

    def salt(self, config: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
        """`config` with its cache_salt set as the tenant header says (unchanged when the
        switch is off)."""
        if self.tenant_header is None:
            return config
        tenant, own = self.tenant(headers), config.get("cache_salt")
        if tenant is None and own is None:
            return config
        if own is not None and not isinstance(own, str):
            return config   # GenerateConfig refuses it, naming cache_salt
        return {**config, "cache_salt": "/".join(p for p in (tenant or "", own) if p is not None)}
