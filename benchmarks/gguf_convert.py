"""llama.cpp's converter (convert_hf_to_gguf.py of a llama.cpp source tree) on a checkpoint whose
byte-level BPE tokenizer was trained on the spot (model_factory/tiny.py), for the benchmarks
that run llama.cpp on the same weights (benchmarks/moe.py).

    python benchmarks/gguf_convert.py LLAMA_CPP_DIR CHECKPOINT OUT.gguf [--outtype f32]

The converter names a BPE tokenizer's pre-tokenizer by a hash of how it splits a fixed text,
known only for published tokenizers, and refuses any other ("BPE pre-tokenizer was not
recognized"). A tiny checkpoint's byte-level tokenizer is loaded as a Qwen2Tokenizer (its
tokenizer_config.json says so), which splits text with Qwen2's pre-tokenizer, so for such a
checkpoint this names that one, "qwen2", where the hash is unknown; any other checkpoint goes
through the converter unchanged.
Decode speed does not depend on the tokenizer: the benchmarks feed token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def qwen2_tokenizer(checkpoint: Path) -> bool:
    """Whether the checkpoint's tokenizer is a Qwen2Tokenizer (so splits as Qwen2's does)."""
    path = checkpoint / "tokenizer_config.json"
    return path.exists() and json.loads(path.read_text()).get("tokenizer_class") == "Qwen2Tokenizer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("llama_cpp", type=Path, help="a llama.cpp source tree")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--outtype", default="f32")
    args = parser.parse_args()
    sys.path[:0] = [str(args.llama_cpp / "gguf-py"), str(args.llama_cpp)]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    if qwen2_tokenizer(args.checkpoint):
        known = TextModel.get_vocab_base_pre

        def pre_tokenizer(self, tokenizer) -> str:
            try:
                return known(self, tokenizer)
            except NotImplementedError:   # a hash of no published tokenizer: Qwen2's splits
                return "qwen2"

        TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = ["convert_hf_to_gguf.py", str(args.checkpoint), "--outtype", args.outtype,
                "--outfile", str(args.out)]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
