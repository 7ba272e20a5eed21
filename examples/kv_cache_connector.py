"""TensorRT-LLM's KV cache connector example, rewritten for rtpkv: a small user connector that
persists KV blocks to a folder, and a second engine instance that loads them instead of
recomputing.

    python examples/kv_cache_connector.py [MODEL_DIR]

What changed from the original (which is "NOT suitable for production"): a block is named by its
chained key (covers the model, the block size, the salt and every token before it; the same in
every process) instead of Python's per-process ``hash`` of one block's tokens; files are rtpkv's
checksummed safetensors records (never a pickle) written to a temporary name and renamed (never
half-written); and a block is loaded only if its record is intact and holds that very key.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rtpkv.cache.connector import ConnectorRequest, ConnectorStep, KvCacheConnector
from rtpkv.cache.tiers import BlockMeta, RecordError, decode_record, encode_record

CONNECTOR_CACHE_FOLDER_KEY = "CONNECTOR_CACHE_FOLDER"


@dataclass
class FolderConnectorMetadata:
    load: list[tuple[Path, int]] = field(default_factory=list)
    save: list[tuple[Path, BlockMeta, int]] = field(default_factory=list)


class FolderKvCacheConnector(KvCacheConnector):
    """Scheduler side: which blocks the folder holds and where they go. Worker side: the copies."""

    def __init__(self, context=None):
        super().__init__(context)
        self.folder = Path(os.environ.get(CONNECTOR_CACHE_FOLDER_KEY, "./connector_cache"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.kv_cache_tensor = None

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        matched = 0
        for key in request.block_keys:          # a chain: stop at the first block not stored
            if not self._path(key).exists():
                break
            matched += 1
        print(f"KV CONNECTOR: matched {matched} blocks for request {request.request_id}")
        return matched * self.context.layout.block_size, False

    def build_connector_meta(self, step: ConnectorStep) -> FolderConnectorMetadata:
        metadata = FolderConnectorMetadata()
        for t in step.load:
            metadata.load.append((self._path(t.key), t.block_id))
        for t in step.save:
            path = self._path(t.key)
            if not path.exists():               # already saved by an earlier run
                metadata.save.append((path, BlockMeta(t.key, b"", t.tokens), t.block_id))
        return metadata

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_cache_tensor) -> None:
        assert self.kv_cache_tensor is None, "KV cache tensor already registered"
        self.kv_cache_tensor = kv_cache_tensor

    def start_load_kv(self) -> None:
        for path, block_id in self._metadata.load:      # synchronous, block by block
            try:
                meta, payload = decode_record(path.read_bytes(), self.context.layout)
            except (OSError, RecordError) as exc:
                raise RuntimeError(f"{path}: {exc}") from exc   # rtpkv: logged, a miss
            if meta.key.hex() != path.stem:
                raise RuntimeError(f"{path} holds another block")
            self.kv_cache_tensor[block_id].copy_(payload)

    def wait_for_save(self) -> None:
        for path, meta, block_id in self._metadata.save:
            data = encode_record(meta, self.kv_cache_tensor[block_id], self.context.layout)
            temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            temp.write_bytes(data)
            os.replace(temp, path)

    def _path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.safetensors"


def main() -> None:
    from example_args import model_path
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline

    model_name = model_path(__doc__)
    test_text = (
        "Nvidia Corporation is an American technology company headquartered in Santa Clara, California."
        "Founded in 1993 by Jensen Huang, Chris Malachowsky, and Curtis Priem, it develops graphics processing units (GPUs), "
        "system on a chips (SoCs), and application programming interfaces (APIs) for data science, high-performance computing, "
        "and mobile and automotive applications. Tell me about the company.")
    generate_config = {"top_k": 1, "max_new_tokens": 32}

    with tempfile.TemporaryDirectory() as folder:
        os.environ[CONNECTOR_CACHE_FOLDER_KEY] = folder
        outputs = []
        for run in ("First", "Second"):
            config = ModelConfig(kv_connector=FolderKvCacheConnector, reuse_cache=True)
            model = ModelFactory.from_huggingface(model_name, config, show_progress=False)
            pipeline = Pipeline(model, model.tokenizer)
            for res in pipeline(test_text, generate_config=generate_config):
                pass
            pipeline.stop()                     # saves of the blocks still on device
            outputs.append(res.batch_response[0])
            print(f"{run} output: {outputs[-1]!r}  reuse_len={res.aux_info['reuse_len']} "
                  f"connector_reuse_len={res.aux_info.get('connector_reuse_len', 0)}")
            if run == "First":
                print("Loading new pipeline instance...")
        print("files in the folder:", len(list(Path(folder).glob("*.safetensors"))))
        assert outputs[0] == outputs[1]


if __name__ == "__main__":
    main()
