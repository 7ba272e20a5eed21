"""TensorRT-LLM's KV cache offloading demo on rtpkv: a device KV pool that holds one request,
prompts A, B, A, B. Without a host tier B evicts A and the second A is recomputed; with one
(--enable_offloading) A's blocks move to host memory and come back.

    python examples/kv_cache_offloading.py [--enable_offloading] [--model MODEL_DIR]
"""

from __future__ import annotations

import argparse
import logging

from rtpkv.model_factory import ModelConfig, ModelFactory
from rtpkv.model_factory.tiny import model_or_demo
from rtpkv.pipeline import Pipeline


def main(args: argparse.Namespace) -> None:
    prompt_a = ("Returns the per-iterations statistics computed since last call to this method. "
                "Contains at most iter_stats_max_iterations iterations.")
    prompt_b = ("Use for skipping decoding step for non generation model, "
                "and return the batch_output (such as mm_embeddings)")
    # As in TensorRT-LLM's demo, max_seq_len equals the device pool and each request generates up
    # to max_seq_len: a request fills the whole pool, so B evicts every block of A.
    max_seq_len = 128
    kv_cache_max_tokens = 128
    kv_cache_page_size = 16
    model_dir = model_or_demo(args.model)
    host_cache_size = 2 ** 30 if args.enable_offloading else 0   # 1 GiB of host memory, or none

    model = ModelFactory.from_huggingface(model_dir, ModelConfig(
        reuse_cache=True, seq_size_per_block=kv_cache_page_size, max_seq_len=max_seq_len,
        kv_cache_max_tokens=kv_cache_max_tokens, host_cache_size=host_cache_size),
        show_progress=False)
    with Pipeline(model, model.tokenizer) as pipeline:
        config = {"top_k": 1, "ignore_eos": True}   # up to max_seq_len
        for round_name, prompts in (("First", (prompt_a, prompt_b)), ("Second", (prompt_a, prompt_b))):
            print(f"--- {round_name} Round ---")
            for prompt in prompts:
                for res in pipeline(prompt, generate_config=config):
                    pass
                aux = res.aux_info
                print(f"Prompt: {prompt[:40]!r}..., reuse_len={aux['reuse_len']} "
                      f"(local {aux['local_reuse_len']}, memory {aux['memory_reuse_len']}), "
                      f"generated: {res.batch_response[0][:40]!r}...")
        stats = pipeline.cache_stats()
        print(f"device pool: {stats['blocks_total']} blocks of {kv_cache_page_size} tokens, "
              f"cache hit rate {stats['hit_rate']:.2f}")
        if args.enable_offloading:
            print(f"host tier: {stats['memory_blocks_used']}/{stats['memory_blocks_total']} blocks used, "
                  f"offloaded {stats['memory_offloaded_blocks']}, onboarded {stats['memory_onboarded_blocks']}, "
                  f"hit rate {stats['memory_hit_rate']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--enable_offloading", action="store_true",
                        help="give the KV cache 1 GiB of host memory to offload to")
    parser.add_argument("--model", help="checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--verbose", action="store_true", help="log the engine's start-up lines")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    main(args)
