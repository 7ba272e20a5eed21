"""Settings: every environment variable rtpkv reads, validated once at start-up.

`Settings` reads the environment; `ModelConfig` (rtpkv.model_factory) and keyword arguments
override it field by field. An invalid value raises `ConfigError` naming the variable, the value
and the accepted range.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rtpkv.errors import ConfigError

_TRUE = {"1", "true", "on"}
_FALSE = {"0", "false", "off"}


class CapacitySchedulerPolicy(str, enum.Enum):
    """How admission treats KV capacity (TensorRT-LLM's names)."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"
    STATIC_BATCH = "STATIC_BATCH"


class ContextChunkingPolicy(str, enum.Enum):
    """How the per-step token budget is shared between prompts being prefilled."""

    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"


class SchedulePolicy(str, enum.Enum):
    """Order of admission among waiting requests: arrival, or longest cached prefix first."""

    FCFS = "fcfs"
    LPM = "lpm"


def parse_switch(value: Any) -> Any:
    """Accept 1/0, true/false, on/off in any case (and real booleans); refuse anything else."""
    if isinstance(value, bool) or value is None:
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("accepted values are 1/0, true/false, on/off (any case)")


class CacheOptions(BaseModel):
    """The fields shared by `Settings` (environment) and `ModelConfig` (code).

    Every field is optional here: None means "not given", and `resolve` fills the defaults.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False)

    dtype: Optional[str] = Field(None, pattern="^(auto|float32|bfloat16|float16)$")
    device: Optional[str] = Field(None, pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    max_seq_len: Optional[int] = Field(None, ge=0)
    seq_size_per_block: Optional[int] = None
    kv_cache_mem_mb: Optional[float] = Field(None, gt=0)
    kv_cache_max_tokens: Optional[int] = Field(None, gt=0)
    kv_cache_event_buffer_max_size: Optional[int] = Field(None, ge=0)
    reuse_cache: Optional[bool] = None
    multi_task_prompt: Optional[str] = None
    multi_task_prompt_str: Optional[str] = None
    capacity_scheduler_policy: Optional[CapacitySchedulerPolicy] = None
    context_chunking_policy: Optional[ContextChunkingPolicy] = None
    max_num_batched_tokens: Optional[int] = Field(None, ge=1)
    concurrency_limit: Optional[int] = Field(None, ge=1)
    schedule_policy: Optional[SchedulePolicy] = None
    # tiers below the device pool (rtpkv.cache.tiers.factory)
    enable_memory_cache: Optional[bool] = None
    memory_cache_size_mb: Optional[float] = Field(None, ge=0)
    host_cache_size: Optional[int] = Field(None, ge=0)   # bytes; set in ModelConfig, wins
    secondary_offload_min_priority: Optional[int] = Field(None, ge=0, le=100)
    enable_memory_cache_disk: Optional[bool] = None
    memory_cache_disk_paths: Optional[str] = None
    memory_cache_disk_size_mb: Optional[float] = Field(None, gt=0)
    write_cache_sync: Optional[bool] = None
    kv_connector_module: Optional[str] = None
    kv_connector_class: Optional[str] = None
    kv_connector: Optional[Any] = None   # a KvCacheConnector class or instance (ModelConfig)

    enable_remote_cache: Optional[bool] = None
    remote_cache_url: Optional[str] = None
    remote_cache_password: Optional[str] = Field(None, repr=False)
    remote_cache_ttl_s: Optional[int] = Field(None, ge=0)
    remote_cache_timeout_ms: Optional[int] = Field(None, ge=1, le=60000)

    @field_validator("reuse_cache", "enable_memory_cache", "enable_memory_cache_disk",
                     "write_cache_sync", "enable_remote_cache", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        return parse_switch(value)

    @field_validator("seq_size_per_block")
    @classmethod
    def _power_of_two(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and (value < 1 or value > 1024 or value & (value - 1)):
            raise ValueError("must be a power of two from 1 to 1024")
        return value

    @field_validator("capacity_scheduler_policy", "context_chunking_policy", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("schedule_policy", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("remote_cache_url")
    @classmethod
    def _redis_url(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            check_redis_url(value)
        return value


def check_redis_url(url: str) -> None:
    """redis://[user:password@]host[:port][/db] or rediss:// (TLS); raises ValueError saying why."""
    accepted = "accepted: redis://[:password@]host[:port][/db] or rediss:// for TLS"
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"{exc}; {accepted}") from None
    try:
        port = parts.port
    except ValueError:
        raise ValueError("port must be 1 to 65535") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"scheme must be redis or rediss; {accepted}")
    if not parts.hostname:
        raise ValueError(f"no host; {accepted}")
    if port == 0:
        raise ValueError("port must be 1 to 65535")
    db = parts.path.lstrip("/")
    if db and not (db.isdigit() and int(db) < 16384):
        raise ValueError(f"database {db!r} must be a number from 0; {accepted}")
    if parts.query or parts.fragment:
        raise ValueError(f"options after '?' or '#' are not accepted; {accepted}")


def redact_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs and error messages."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return parts._replace(netloc=netloc).geturl()
    except ValueError:
        return "<unparsable URL>"


class Settings(CacheOptions, BaseSettings):
    """The environment: `REUSE_CACHE`, `SEQ_SIZE_PER_BLOCK`, `MULTI_TASK_PROMPT`, ..."""

    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False, env_prefix="")

    @classmethod
    def from_env(cls) -> "Settings":
        """Read and validate the environment; a bad value raises ConfigError naming it."""
        try:
            return cls()
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, env=True)) from None


def describe_validation_error(exc: ValidationError, env: bool = False) -> str:
    """One line per bad field: the variable (or field), the value given, what is accepted."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "value"
        name = field.upper() if env else field
        value = err.get("input")
        if env and field in CacheOptions.model_fields:
            value = os.environ.get(name, os.environ.get(field, value))
        if field == "remote_cache_url" and isinstance(value, str):
            value = redact_url(value)
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{name}={value!r} is invalid: {msg}")
    return "; ".join(lines)


DEFAULTS: dict[str, Any] = {
    "dtype": "auto",
    "device": "auto",
    "max_seq_len": 0,
    "seq_size_per_block": 64,
    "kv_cache_mem_mb": None,
    "kv_cache_max_tokens": None,
    "kv_cache_event_buffer_max_size": 0,
    "reuse_cache": False,
    "multi_task_prompt": None,
    "multi_task_prompt_str": None,
    "capacity_scheduler_policy": CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
    "context_chunking_policy": ContextChunkingPolicy.FIRST_COME_FIRST_SERVED,
    "max_num_batched_tokens": 2048,
    "concurrency_limit": 32,
    "schedule_policy": SchedulePolicy.FCFS,
    "enable_memory_cache": False,
    "memory_cache_size_mb": 0.0,
    "host_cache_size": None,
    "secondary_offload_min_priority": 35,
    "enable_memory_cache_disk": False,
    "memory_cache_disk_paths": None,
    "memory_cache_disk_size_mb": 10240.0,
    "write_cache_sync": False,
    "kv_connector_module": None,
    "kv_connector_class": None,
    "kv_connector": None,
    "enable_remote_cache": False,
    "remote_cache_url": None,
    "remote_cache_password": None,
    "remote_cache_ttl_s": 0,
    "remote_cache_timeout_ms": 200,
}


@dataclass(frozen=True)
class RuntimeConfig:
    """Every option with its final value: defaults < environment < ModelConfig < keywords."""

    dtype: str
    device: str
    max_seq_len: int
    seq_size_per_block: int
    kv_cache_mem_mb: Optional[float]
    kv_cache_max_tokens: Optional[int]
    kv_cache_event_buffer_max_size: int
    reuse_cache: bool
    multi_task_prompt: Optional[str]
    multi_task_prompt_str: Optional[str]
    capacity_scheduler_policy: CapacitySchedulerPolicy
    context_chunking_policy: ContextChunkingPolicy
    max_num_batched_tokens: int
    concurrency_limit: int
    schedule_policy: SchedulePolicy
    enable_memory_cache: bool
    memory_cache_size_mb: float
    host_cache_size: Optional[int]
    secondary_offload_min_priority: int
    enable_memory_cache_disk: bool
    memory_cache_disk_paths: Optional[str]
    memory_cache_disk_size_mb: float
    write_cache_sync: bool
    kv_connector_module: Optional[str]
    kv_connector_class: Optional[str]
    kv_connector: Any
    enable_remote_cache: bool
    remote_cache_url: Optional[str]
    remote_cache_password: Optional[str] = field(repr=False)
    remote_cache_ttl_s: int
    remote_cache_timeout_ms: int

    def __post_init__(self) -> None:
        if self.enable_remote_cache and not self.remote_cache_url:
            raise ConfigError("ENABLE_REMOTE_CACHE=1 needs REMOTE_CACHE_URL "
                              "(redis://host:port/db, or rediss:// for TLS)")

    def replace(self, **overrides: Any) -> "RuntimeConfig":
        """A copy with `overrides` (ModelConfig field names) validated and applied."""
        return resolve(self, make_options(CacheOptions, _checked(overrides)))


def _checked(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(CacheOptions.model_fields))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown}; accepted: {sorted(CacheOptions.model_fields)}"
        )
    return overrides


def make_options(kind: type[CacheOptions], values: dict[str, Any]) -> CacheOptions:
    """Build an options model, turning pydantic's error into a ConfigError naming the field."""
    try:
        return kind(**values)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def resolve(*layers: "CacheOptions | RuntimeConfig | None") -> RuntimeConfig:
    """Merge option layers, later ones winning where they give a value (not None)."""
    values = dict(DEFAULTS)
    for layer in layers:
        if layer is None:
            continue
        items = layer.__dict__ if isinstance(layer, RuntimeConfig) else layer.model_dump()
        for key, value in items.items():
            if value is not None and key in values:
                values[key] = value
    return RuntimeConfig(**values)
