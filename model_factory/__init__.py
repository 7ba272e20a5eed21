"""Model loading: `ModelFactory.from_huggingface(path, ModelConfig())`."""

from rtpkv.model_factory.factory import Model, ModelFactory
from rtpkv.model_factory.model_config import ModelConfig
from rtpkv.model_factory.spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["Model", "ModelConfig", "ModelFactory", "ModelSpec", "SUPPORTED_ARCHITECTURES"]
