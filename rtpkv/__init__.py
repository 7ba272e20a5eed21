"""rtpkv: an LLM inference SDK whose reason to exist is KV-cache reuse.

`from rtpkv import Pipeline, ModelFactory, ModelConfig` works; the imports are lazy, so
`import rtpkv` (the CLI's --version, for one) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Pipeline": "rtpkv.pipeline",
    "ModelFactory": "rtpkv.model_factory",
    "ModelConfig": "rtpkv.model_factory",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rtpkv' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
