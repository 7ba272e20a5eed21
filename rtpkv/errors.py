"""Exceptions users can catch by kind."""


class RtpkvError(Exception):
    """Base class of every error rtpkv raises on purpose."""


class ConfigError(RtpkvError, ValueError):
    """An environment variable, ModelConfig field or generate_config key is invalid."""


class RequestError(RtpkvError, ValueError):
    """A request is invalid (bad prompt, too long, unknown task, ...); other requests go on."""


class EmptyPromptError(RequestError):
    """The prompt has no token."""


class PromptTooLongError(RequestError):
    """The prompt (with max_new_tokens) does not fit in max_seq_len."""


class UnknownTaskError(RequestError):
    """A request names a task_id that is not registered."""


class CapacityError(RequestError):
    """A request can never fit in the KV pool."""


class RequestTimeoutError(RtpkvError, TimeoutError):
    """A request did not finish within its `timeout_ms`."""


class EngineStoppedError(RtpkvError, RuntimeError):
    """The pipeline was stopped while a request was in flight."""
