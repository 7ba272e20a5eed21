"""ModelFactory.from_huggingface: a checkpoint directory (or a hub name already in the local
Hugging Face cache) becomes a `Model` ready for a Pipeline."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch

from rtpkv.config import RuntimeConfig, Settings, resolve
from rtpkv.errors import ConfigError
from rtpkv.kernels import weight_types
from rtpkv.kernels.cpu_build import select_isa
from rtpkv.kernels.linear import bf16_gemm_supported
from rtpkv.locked_tokenizer import LockedTokenizer
from rtpkv.model_factory import cohere, granite, qwen, qwen_tokenizer
from rtpkv.model_factory.llama import CausalLM
from rtpkv.model_factory.model_config import ModelConfig
from rtpkv.model_factory.moe import checkpoint_tensors
from rtpkv.model_factory.spec import ModelSpec
from rtpkv.model_factory.weights import iter_tensors, weight_files, weights_digest
from rtpkv.torch_threads import serial_torch

log = logging.getLogger("rtpkv")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Model:
    """A loaded checkpoint: the torch module, its tokenizer, and the resolved options."""

    module: CausalLM
    spec: ModelSpec
    tokenizer: Any
    config: RuntimeConfig
    path: Path
    fingerprint: str
    tasks: Optional[list[dict[str, Any]]] = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype = torch.float32   # the KV pool's: `dtype`, or torch.int8


def resolve_model_dir(name: Union[str, os.PathLike], revision: Optional[str] = None) -> Path:
    """A local directory as is; otherwise a hub id looked up in the local Hugging Face cache,
    downloaded only when the environment allows network access."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    text = str(name)
    if path.is_absolute() or text.startswith(".") or text.count("/") > 1:
        raise FileNotFoundError(f"model directory {text!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, revision=revision, local_files_only=True))
    except Exception:
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "on", "yes"):
            raise FileNotFoundError(
                f"model {text!r} is not a local directory and is not in the local Hugging Face "
                "cache (HF_HUB_OFFLINE is set, so it was not downloaded)"
            ) from None
    try:
        return Path(snapshot_download(text, revision=revision))
    except Exception as exc:
        raise FileNotFoundError(
            f"model {text!r} is not a local directory, is not in the local Hugging Face cache, "
            f"and could not be downloaded ({type(exc).__name__})"
        ) from None


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} is invalid: CUDA is not available on this machine")
    return device


def _pick_dtype(name: str, spec: ModelSpec, device: torch.device,
                weight_quantization: Optional[str] = None) -> torch.dtype:
    """"auto": the checkpoint's dtype, except on a CPU, where a 16-bit checkpoint runs in
    bfloat16 only if the CPU has native bf16 GEMMs (AVX512-BF16, AMX) and in float32 otherwise:
    the fastest dtype there, and reuse stays bit-exact in both (kernels/linear.py). Int8 weights
    compute in float32 on a CPU (kernels/int8_linear.py, kernels/w8a8_linear.py): any other
    device or dtype is refused."""
    if weight_quantization:
        compute = str(weight_types.COMPUTE_DTYPE).removeprefix("torch.")
        if device.type != weight_types.DEVICE or name not in ("auto", compute):
            switch = f"WEIGHT_TYPE={weight_quantization.upper()}" + (
                " (or INT8_MODE=1)" if weight_quantization == "int8" else "")
            raise ConfigError(f"{switch} runs on a CPU in {compute}; "
                              f"device={device.type}, dtype={name} is not supported with it")
        return weight_types.COMPUTE_DTYPE
    if name != "auto":
        return _DTYPES[name]
    dtype = _DTYPES.get(str(spec.torch_dtype).removeprefix("torch."), torch.float32)
    if device.type == "cpu" and dtype != torch.float32:
        return torch.bfloat16 if bf16_gemm_supported() else torch.float32
    return dtype


def _pick_kv_dtype(config: RuntimeConfig, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype: the model's, or int8 (KV_CACHE_DTYPE=int8 / INT8_KV_CACHE=1), which
    runs on a CPU with the paged kernel or the torch reference (kernels/kv_quant.py)."""
    if not config.int8_kv:
        return dtype
    if device.type != "cpu":
        raise ConfigError(f"KV_CACHE_DTYPE=int8 (or INT8_KV_CACHE=1) runs on a CPU; "
                          f"device={device.type} is not supported with it")
    if config.rtpkv_attention in ("flash-attn", "triton"):
        raise ConfigError(f"RTPKV_ATTENTION={config.rtpkv_attention} does not read an int8 KV "
                          "cache (KV_CACHE_DTYPE=int8 / INT8_KV_CACHE=1): use cpu-paged or torch")
    return torch.int8


def _max_seq_len(config: RuntimeConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    if config.max_seq_len and config.max_seq_len > limit:
        raise ConfigError(f"max_seq_len={config.max_seq_len} is invalid: this checkpoint "
                          f"accepts at most {limit} tokens")
    return config.max_seq_len or limit


def _load_module(spec: ModelSpec, files: list[Path], device: torch.device, dtype: torch.dtype,
                 kv_dtype: torch.dtype, config: RuntimeConfig, max_seq_len: int,
                 show_progress: bool, model_dir: Path) -> CausalLM:
    with torch.device("meta"):
        module = CausalLM(spec)
    state = {}
    tensors = iter_tensors(files, show_progress)
    if spec.architecture == qwen.ARCHITECTURE:
        kv_size = spec.num_kv_heads * spec.head_dim
        tensors = qwen.qwen2_tensors(tensors, spec.num_heads * spec.head_dim, kv_size)
    elif spec.architecture == cohere.ARCHITECTURE:
        tensors = cohere.half_rotation_tensors(tensors, spec.head_dim)
    elif spec.architecture == granite.ARCHITECTURE:
        tensors = granite.granite_tensors(tensors, has_experts=spec.moe is not None)
    for name, tensor in checkpoint_tensors(spec.architecture, tensors):
        state[name] = tensor.to(device=device, dtype=dtype)
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(module.state_dict()) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    module.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False,
                           assign=True)
    module.prepare(max_seq_len, attention=config.rtpkv_attention, linear=config.rtpkv_linear,
                   weight_quantization=config.weight_quantization, kv_dtype=kv_dtype)
    return module.eval()


def _load_tokenizer(model_dir: Path) -> Any:
    """QWen's tiktoken tokenizer where the checkpoint has one (its remote code is not run),
    else AutoTokenizer's."""
    if (model_dir / qwen_tokenizer.VOCAB_FILE).exists():
        return qwen_tokenizer.load_qwen_tokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class ModelFactory:
    @staticmethod
    def from_huggingface(model_path_or_name: Union[str, os.PathLike],
                         revision: Union[str, ModelConfig, None] = None,
                         model_config: Optional[ModelConfig] = None,
                         show_progress: bool = True) -> Model:
        """Load a checkpoint of a supported architecture (model_factory/spec.py). rtp-llm's tutorials pass the ModelConfig second:
        a ModelConfig given as `revision` is taken as `model_config`."""
        if isinstance(revision, ModelConfig):
            revision, model_config = None, revision
        model_config = model_config or ModelConfig()
        settings = Settings.from_env()
        config = resolve(settings, model_config)
        model_dir = resolve_model_dir(model_path_or_name, revision)
        config_path = model_dir / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{model_dir}: no config.json")
        spec = ModelSpec.from_config(json.loads(config_path.read_text()), str(config_path))
        device = _pick_device(config.device)
        dtype = _pick_dtype(config.dtype, spec, device, config.weight_quantization)
        kv_dtype = _pick_kv_dtype(config, device, dtype)
        max_seq_len = _max_seq_len(config, spec)
        config = config.replace(max_seq_len=max_seq_len)

        files = weight_files(model_dir)
        try:
            select_isa(config.rtpkv_isa)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        with serial_torch():
            module = _load_module(spec, files, device, dtype, kv_dtype, config, max_seq_len,
                                  show_progress, model_dir)

        # locked: the pipeline's engine thread and the caller's threads share it
        tokenizer = LockedTokenizer(_load_tokenizer(model_dir))
        if (model_dir / qwen_tokenizer.VOCAB_FILE).exists():
            spec = replace(spec, eos_token_ids=qwen_tokenizer.stop_ids(tokenizer))
        # quantized layers give other K/V than the float ones, and an int8 KV cache other
        # blocks: their blocks must never be shared with another setting's
        quantized = config.weight_quantization
        weights = (weight_types.REGISTRY[quantized].fingerprint(module.lm_head) if quantized
                   else "")
        kv = "|kv-int8" if kv_dtype == torch.int8 else ""
        fingerprint = hashlib.sha256(
            f"{spec.architecture}|{weights_digest(files)}|{dtype}{weights}{kv}".encode()
        ).hexdigest()
        log.info("loaded %s from %s (%s%s%s, %s, max_seq_len=%d)", spec.architecture, model_dir,
                 dtype, f", {quantized} linear layers" if quantized else "",
                 ", int8 KV cache" if kv else "", device, max_seq_len)
        return Model(module=module, spec=spec, tokenizer=tokenizer, config=config, path=model_dir,
                     fingerprint=fingerprint, tasks=model_config.tasks, device=device, dtype=dtype,
                     kv_dtype=kv_dtype)
