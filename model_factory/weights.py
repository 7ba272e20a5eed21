"""Checkpoint files: safetensors (single or sharded), `.bin` only through weights_only loading,
and a cheap identity digest of the weights for the cache's model fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

_SAMPLES = 16          # content samples per file in the identity digest
_SAMPLE_BYTES = 65536  # bytes per sample


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint, in load order."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    bin_index = model_dir / "pytorch_model.bin.index.json"
    if bin_index.exists():
        shards = sorted(set(json.loads(bin_index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single_bin = model_dir / "pytorch_model.bin"
    if single_bin.exists():
        return [single_bin]
    raise FileNotFoundError(
        f"{model_dir}: no weights found (expected model.safetensors, "
        "model.safetensors.index.json or pytorch_model.bin)"
    )


def iter_tensors(files: list[Path], show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, with a progress bar over the files."""
    for path in tqdm(files, desc="Loading weights", unit="file", disable=not show_progress):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            yield from torch.load(path, map_location="cpu", weights_only=True).items()


def weights_digest(files: list[Path]) -> str:
    """Identity of the weights: each file's size, its first 64 KiB (the safetensors header)
    and 16 evenly spaced 64 KiB samples of its content. Cheap on a 14 GB checkpoint, and two
    random initialisations of the same shape never share it."""
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(path.name.encode() + size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            for i in range(_SAMPLES + 1):
                f.seek(0 if i == 0 else (size * i) // (_SAMPLES + 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()
