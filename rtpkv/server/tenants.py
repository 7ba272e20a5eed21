"""Tenants on a server: the operator's switches on who a request's cache belongs to.

A multi-tenant gateway names the tenant in a header (Dynamo's `x-tenant-id`). With
TENANT_HEADER_SALT=1 the header's value is the request's `cache_salt`, so two tenants never hit
each other's blocks; a salt the client gives itself (`cache_salt`, or `prompt_cache_key` under
PROMPT_CACHE_KEY_SALT=1) only narrows it within the tenant ("acme/<salt>"), and a request
without the header gets "/<salt>": no client can name its way into a tenant's blocks.

`GET /cache/tenants/{salt}` reads a tenant's cached blocks, quota and quota evictions;
`PUT /cache/tenants/{salt}` with `{"quota_blocks": N}` (null: back to CACHE_SALT_QUOTA_BLOCKS)
changes its quota while the server runs. With ADMIN_API_KEY set, both answer only requests
carrying `Authorization: Bearer <key>` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import hmac
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Optional

from fastapi import FastAPI, Request

from rtpkv.server.errors import ApiError, ErrorCode, api_error

if TYPE_CHECKING:
    from rtpkv.pipeline import Pipeline

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


def add_tenant_routes(app: FastAPI, pipeline: "Pipeline", switches: CacheSwitches,
                      json_body: Callable[[Request], Awaitable[dict[str, Any]]]) -> None:
    def check_admin(request: Request) -> None:
        if switches.admin_api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {switches.admin_api_key}".encode()):
            raise ApiError(401, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           "this route needs the admin key: Authorization: Bearer <ADMIN_API_KEY>",
                           "authorization")

    async def call(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return await asyncio.to_thread(fn)   # waits for the engine's step lock
        except Exception as exc:
            raise api_error(exc) from exc

    @app.get("/cache/tenants/{salt:path}")
    async def tenant(salt: str, request: Request) -> dict[str, Any]:
        check_admin(request)
        return {"salt": salt, **await call(lambda: pipeline.tenant_quota(salt))}

    @app.put("/cache/tenants/{salt:path}")
    async def set_quota(salt: str, request: Request) -> dict[str, Any]:
        check_admin(request)
        body = await json_body(request)
        blocks = body.get("quota_blocks", ...)
        if set(body) != {"quota_blocks"} or not (
                blocks is None or (isinstance(blocks, int) and not isinstance(blocks, bool)
                                   and blocks >= 0)):
            raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           f"body must be {{\"quota_blocks\": N}} with N a number of KV blocks "
                           f"from 0, or null (back to CACHE_SALT_QUOTA_BLOCKS); got {body!r:.200}",
                           "quota_blocks")
        return {"salt": salt, **await call(lambda: pipeline.set_tenant_quota(salt, blocks))}
