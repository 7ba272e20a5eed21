"""Settings: every option rtpkv has, declared once (name, default, rule) in `RuntimeConfig`.

The layers, later winning field by field: the defaults declared on `RuntimeConfig` < the
environment (`Settings`, one variable per field, upper-cased) < `ModelConfig` (rtpkv.model_factory)
< keyword arguments to `Pipeline(...)`. A layer contributes only the fields it was given. Adding
an option is one field declaration here (plus a validator where a rule needs one). An invalid
value raises `ConfigError` naming the variable or field, the value and the accepted range.
"""

from __future__ import annotations

import enum
import os
import reprlib
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator)
from pydantic_settings import BaseSettings, SettingsConfigDict

from rtpkv.env_check import check_environment
from rtpkv.errors import ConfigError
from rtpkv.rtp_llm_compat import env_options
from rtpkv.switches import parse_switch
from rtpkv.kernels.names import ATTENTION_BACKENDS, ISA_LEVELS, LINEAR_PATHS, WEIGHT_TYPES

# Values in error messages: bounded in depth and length, so a value nested a thousand levels
# deep or megabytes long is reported in a line (a plain repr would recurse or flood the log).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = \
    4, 200, 200, 10, 10

KV_CACHE_DTYPES = ("auto", "int8")
KV_EVENTS_LAYOUTS = ("map", "array")   # the KV events' layouts (rtpkv.fleet.wire)
KV_EVENTS_MEDIUM_NAMES = ("disk", "storage", "tiers")   # rtpkv.fleet.wire.MEDIUM_NAMES
_CHOICES = {"weight_type": WEIGHT_TYPES, "kv_cache_dtype": KV_CACHE_DTYPES,
            "kv_events_layout": KV_EVENTS_LAYOUTS,
            "kv_events_mediums": KV_EVENTS_MEDIUM_NAMES}   # lower-cased
# a block's retention priority when no request gave one (rtp-llm's default; 0-100, higher kept
# longer): the cache's default, and SECONDARY_OFFLOAD_MIN_PRIORITY's
DEFAULT_PRIORITY = 35


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


def describe_validation_error(exc: ValidationError, name: Callable[[str], str] = str,
                              value: Callable[[str, Any], Any] = lambda field, given: given) -> str:
    """The one formatter of pydantic errors: a clause per bad field, joined by "; ".

    `name` turns a field into what the user wrote (an environment variable, a generate_config
    key, ...); `value` may recover the value as the user wrote it (the raw environment string)."""
    clauses = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "value"
        if err["type"] == "missing":
            clauses.append(f"{name(field)} is missing")
        elif err["type"] == "extra_forbidden":
            clauses.append(f"{name(field)} is an unexpected key")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            shown = value(field, err.get("input"))
            shown = _SECRET_VALUES.get(field, lambda v: v)(shown)
            clauses.append(f"{name(field)}={_SHORT.repr(shown)} is invalid: {msg}")
    return "; ".join(clauses)


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


def check_zmq_endpoint(endpoint: str) -> None:
    """A ZeroMQ endpoint rtpkv can bind: tcp://HOST:PORT (HOST `*`: every interface) or
    ipc://PATH."""
    accepted = "accepted: tcp://HOST:PORT with PORT 1 to 65535 (HOST * for all), or ipc://PATH"
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"unsupported scheme; {accepted}")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"no valid HOST:PORT; {accepted}")


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


# Values never shown as given in an error message.
_SECRET_VALUES: dict[str, Callable[[Any], Any]] = {
    "remote_cache_url": lambda v: redact_url(v) if isinstance(v, str) else v,
    "remote_cache_password": lambda v: "***",
    "admin_api_key": lambda v: "***",
}


class RuntimeConfig(BaseModel):
    """Every option with its default and its rule: the single list of rtpkv's options.

    A resolved instance is what the engine runs with; `Settings` and `ModelConfig` are the same
    fields read from the environment and from code."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    max_seq_len: int = Field(0, ge=0)  # 0: the checkpoint's max_position_embeddings
    # tokens each query attends to (itself included); None: the model's sliding_window, else
    # all of max_seq_len. Checked against max_seq_len and the block size at engine start.
    max_attention_window: Optional[int] = Field(None, ge=1)
    seq_size_per_block: int = 64
    kv_cache_mem_mb: Optional[float] = Field(None, gt=0)
    kv_cache_max_tokens: Optional[int] = Field(None, gt=0)
    # of the device memory free after the weights, for a CUDA pool (TensorRT-LLM's
    # kv_cache_free_gpu_mem_fraction); KV_CACHE_MAX_TOKENS caps it (rtpkv.cache.builder)
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0, le=1)
    kv_cache_event_buffer_max_size: int = Field(0, ge=0)  # 0: KV cache events off
    reuse_cache: bool = False
    # reuse past the last whole cached block: copy the k matching tokens of a cached block
    # (or a finished request's partly filled last block) into a fresh one (rtpkv.cache.manager)
    enable_partial_reuse: bool = False
    # keys of recently evicted blocks remembered to explain misses (reuse_stop "evicted",
    # cache_stats' ghost hits); None: as many as the pool has blocks, 0: none
    kv_cache_ghost_blocks: Optional[int] = Field(None, ge=0)
    # per-tenant bound on cached blocks (rtpkv.cache.block_pool): a salted tenant past it has
    # its own cached blocks evicted first; cache_salt_quotas overrides it per salt ("" = no salt)
    cache_salt_quota_blocks: Optional[int] = Field(None, ge=0)
    # a recurrent model's (Qwen3-Next, Qwen3.5, Granite 4.0-H) saved states: one every
    # LINEAR_STEP blocks of a request (rtpkv.cache.state_group), and the pool's memory split one
    # per that many blocks
    linear_step: int = 8
    cache_salt_quotas: Optional[dict[str, int]] = None
    multi_task_prompt: Optional[str] = None
    multi_task_prompt_str: Optional[str] = None
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: ContextChunkingPolicy = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    max_num_batched_tokens: int = Field(2048, ge=1)
    # greedy decode steps run in one call of the fused CPU decoder when only plain greedy
    # decodes run and nothing waits (vLLM's num_scheduler_steps): tokens stream in bursts of up
    # to this many, and the per-step Python is paid once a burst (rtpkv.engine.engine)
    num_scheduler_steps: int = Field(1, ge=1, le=64)
    concurrency_limit: int = Field(32, ge=1)
    schedule_policy: SchedulePolicy = SchedulePolicy.FCFS
    # kernel choices (rtpkv.kernels): auto = the fastest that builds and supports the dtype
    rtpkv_attention: str = Field("auto", pattern=f"^({'|'.join(ATTENTION_BACKENDS)})$")
    rtpkv_linear: str = Field("auto", pattern=f"^({'|'.join(LINEAR_PATHS)})$")
    # the vector ISA the C kernels are built for (rtpkv.kernels.cpu_build): auto = the highest
    # this CPU runs; every level gives the same bits
    rtpkv_isa: str = Field("auto", pattern=f"^({'|'.join(ISA_LEVELS)})$")
    # decode-only steps on CUDA replay a CUDA graph captured per batch-size bucket (1, 2, 4, ...;
    # rtpkv.engine.cuda_graphs, with RTPKV_ATTENTION=triton); ENFORCE_EAGER=1 (vLLM's name)
    # runs every step eagerly
    enforce_eager: bool = False
    # seconds between malloc_trim(0) calls from the engine thread (rtpkv.engine.heap_trim), which
    # keep glibc's freed activations from staying resident under load; 0: off
    rtpkv_malloc_trim_s: float = Field(10.0, ge=0)
    # int8 linear layers: rtp-llm's weight-only int8 (rtpkv.kernels.int8_linear), WEIGHT_TYPE=INT8
    # or INT8_MODE=1 (its older alias); or int8 weights and activations
    # (rtpkv.kernels.w8a8_linear), WEIGHT_TYPE=W8A8_INT8; or bfloat16 weights computed in float32
    # (rtpkv.kernels.bf16_linear), WEIGHT_TYPE=BF16; "auto" keeps the model's dtype
    weight_type: str = "auto"
    int8_mode: bool = False
    # the KV cache's storage (rtpkv.kernels.kv_quant): KV_CACHE_DTYPE=int8, or rtp-llm's
    # INT8_KV_CACHE=1; "auto" stores K/V in the model's dtype (FP8_KV_CACHE: rtpkv.rtp_llm_compat)
    kv_cache_dtype: str = "auto"
    int8_kv_cache: bool = False
    # tiers below the device pool (rtpkv.cache.tiers.factory)
    enable_memory_cache: bool = False
    memory_cache_size_mb: float = Field(0.0, ge=0)
    host_cache_size: Optional[int] = Field(None, ge=0)   # bytes (TensorRT-LLM's name); wins
    secondary_offload_min_priority: int = Field(DEFAULT_PRIORITY, ge=0, le=100)
    enable_memory_cache_disk: bool = False
    memory_cache_disk_paths: Optional[str] = None
    memory_cache_disk_size_mb: float = Field(10240.0, gt=0)
    write_cache_sync: bool = False
    kv_connector_module: Optional[str] = None
    kv_connector_class: Optional[str] = None
    kv_connector: Optional[Any] = None   # a KvCacheConnector class or instance (ModelConfig)
    enable_remote_cache: bool = False
    remote_cache_url: Optional[str] = None   # redis://[:password@]host[:port][/db], rediss://
    remote_cache_password: Optional[str] = Field(None, repr=False)
    remote_cache_ttl_s: int = Field(0, ge=0)  # 0: keys never expire
    remote_cache_timeout_ms: int = Field(200, ge=1, le=60000)
    # KV events on the wire in vLLM's ZeroMQ format (rtpkv.fleet.publisher)
    kv_events_endpoint: Optional[str] = None          # PUB, bound: tcp://*:5557 (all), ipc://..
    kv_events_replay_endpoint: Optional[str] = None   # ROUTER for replay requests (binds)
    kv_events_topic: str = Field("", max_length=256)
    kv_events_buffer_steps: int = Field(10000, ge=1, le=1000000)  # batches kept for replay
    kv_events_layout: str = "map"   # "map" (vllm-router) or "array" (llm-d): rtpkv.fleet.wire
    kv_events_mediums: str = "disk"   # how host memory and disk are named: rtpkv.fleet.wire

    @field_validator("reuse_cache", "enable_partial_reuse", "enable_memory_cache",
                     "enable_memory_cache_disk", "write_cache_sync", "enable_remote_cache",
                     "int8_mode", "int8_kv_cache", "enforce_eager", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        return parse_switch(value)

    @field_validator("linear_step")
    @classmethod
    def _linear_step(cls, value: int) -> int:
        if not 1 <= value <= 4096:
            raise ValueError("accepted range is 1..4096 (blocks between saved recurrent states)")
        return value

    @field_validator("seq_size_per_block")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 1 or value > 1024 or value & (value - 1):
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

    @field_validator("weight_type", "kv_cache_dtype", "kv_events_layout", "kv_events_mediums",
                     mode="before")
    @classmethod
    def _choice(cls, value: Any, info: ValidationInfo) -> Any:
        accepted = _CHOICES[info.field_name]
        text = str(value).strip().lower()
        if text not in accepted:
            raise ValueError(f"accepted values are {', '.join(accepted)} (any case)")
        return text

    @property
    def weight_quantization(self) -> Optional[str]:
        """How the linear layers are quantized: "int8" (weight-only: WEIGHT_TYPE=INT8 or
        INT8_MODE=1), "w8a8_int8" (weights and activations: WEIGHT_TYPE=W8A8_INT8; it wins over
        INT8_MODE=1), "bf16" (bfloat16 weights, float32 arithmetic: WEIGHT_TYPE=BF16), or None
        (the model's dtype)."""
        if self.weight_type != "auto":
            return self.weight_type
        return "int8" if self.int8_mode else None

    @property
    def int8_kv(self) -> bool:
        """Whether K/V are stored as int8 (KV_CACHE_DTYPE=int8 or INT8_KV_CACHE=1)."""
        return self.kv_cache_dtype == "int8" or self.int8_kv_cache

    @field_validator("remote_cache_url")
    @classmethod
    def _redis_url(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            check_redis_url(value)
        return value

    @field_validator("cache_salt_quotas")
    @classmethod
    def _quotas(cls, value: Optional[dict[str, int]]) -> Optional[dict[str, int]]:
        for salt, blocks in (value or {}).items():
            if blocks < 0:
                raise ValueError(f"the quota of cache_salt {salt!r} is {blocks}; quotas are "
                                 "numbers of KV blocks, 0 or more")
        return value

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            check_zmq_endpoint(value)
        return value

    def given(self) -> dict[str, Any]:
        """The options this layer was given (explicitly, not by default)."""
        return {k: getattr(self, k) for k in RuntimeConfig.model_fields if k in self.model_fields_set}

    def replace(self, **overrides: Any) -> "RuntimeConfig":
        """A copy with `overrides` (option names; None means "not given") validated and applied."""
        unknown = sorted(set(overrides) - set(RuntimeConfig.model_fields))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {unknown}; accepted: {sorted(RuntimeConfig.model_fields)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        return resolve(self, make_options(RuntimeConfig, given))


def env_var_names() -> list[str]:
    """The environment variables rtpkv reads: one per option, upper-cased."""
    return [name.upper() for name in RuntimeConfig.model_fields]


class Settings(RuntimeConfig, BaseSettings):
    """The environment: `REUSE_CACHE`, `SEQ_SIZE_PER_BLOCK`, `MULTI_TASK_PROMPT`, ..."""

    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False, env_prefix="")

    # `rtpkv serve` only (rtp-llm's names): the checkpoint and where to listen.
    checkpoint_path: Optional[str] = None
    start_port: int = Field(8088, ge=1, le=65535)
    host: str = Field("127.0.0.1", min_length=1)
    max_request_body_mb: float = Field(16.0, gt=0)  # larger bodies: 413 before parsing
    warm_up: bool = True   # rtp-llm's switch: one short request at start, before "ready"
    # how clients steer the cache (rtpkv.server.tenants): OpenAI's prompt_cache_key becomes the
    # cache_salt (it is a routing hint, not an isolation boundary, unless the operator says so);
    # the tenant header, when TENANT_HEADER_SALT is on, is every request's cache_salt; with an
    # admin key, /cache/tenants answers only requests that carry it
    prompt_cache_key_salt: bool = False
    tenant_header: str = Field("x-tenant-id", pattern=r"^[A-Za-z0-9-]{1,64}$")
    tenant_header_salt: bool = False
    admin_api_key: Optional[str] = Field(None, min_length=8, repr=False)

    @field_validator("warm_up", "prompt_cache_key_salt", "tenant_header_salt", mode="before")
    @classmethod
    def _server_switch(cls, value: Any) -> Any:
        return parse_switch(value)

    @classmethod
    def from_env(cls) -> "Settings":
        """Read and validate the environment; a bad value raises ConfigError naming it, and a
        variable that looks meant for rtpkv but has no effect is warned about (env_check)."""
        check_environment(name.upper() for name in cls.model_fields)
        try:
            return cls(**env_options(os.environ))   # rtp-llm's names for rtpkv's options
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, str.upper, _env_value)) from None


def _env_value(field: str, given: Any) -> Any:
    return os.environ.get(field.upper(), os.environ.get(field, given))


def make_options(kind: type[RuntimeConfig], values: dict[str, Any]) -> RuntimeConfig:
    """Build an options layer, turning pydantic's error into a ConfigError naming the field."""
    try:
        return kind(**values)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def resolve(*layers: Optional[RuntimeConfig]) -> RuntimeConfig:
    """Merge option layers, later ones winning for the fields they were given."""
    values: dict[str, Any] = {}
    for layer in layers:
        if layer is not None:
            values.update(layer.given())
    return make_options(RuntimeConfig, values)
