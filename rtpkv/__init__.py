"""rtpkv: an LLM inference SDK whose reason to exist is KV-cache reuse."""

__version__ = "0.1.0"
