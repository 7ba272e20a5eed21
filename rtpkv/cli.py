"""The `rtpkv` command: `demo` runs rtp-llm's ReuseCache scenario on a tiny built-in checkpoint
(or on --model PATH); `generate` streams one prompt; `serve` runs the HTTP server."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Optional

DEMO_CHECKPOINT = dict(architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=256,
                       intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=4,
                       max_position_embeddings=2048, tokenizer_vocab_size=2000)
DEMO_PROMPTS = ["hello, what's your name", "hello, what's your name? how old are you?"]


def _model_path(model: Optional[str]) -> str:
    if model:
        return model
    from rtpkv.model_factory.tiny import cached_tiny_checkpoint

    return str(cached_tiny_checkpoint("demo", **DEMO_CHECKPOINT))


def _pipeline(model: Optional[str], defaults: dict[str, Any]):
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline

    # The demo's defaults apply only where the environment says nothing.
    options = {k: v for k, v in defaults.items() if k.upper() not in os.environ}
    loaded = ModelFactory.from_huggingface(_model_path(model), ModelConfig(**options))
    return Pipeline(loaded, loaded.tokenizer)


def _stream(pipeline, prompt: str, config: dict[str, Any]) -> None:
    shown = ""
    res = None
    for res in pipeline(prompt, generate_config=config):
        text = res.batch_response[0]
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else "\n" + text)
        sys.stdout.flush()
        shown = text
    print()
    if res is not None:
        aux = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.aux_info.items()}
        print("aux_info:", json.dumps(aux))


def demo(args: argparse.Namespace) -> None:
    pipeline = _pipeline(args.model, {"reuse_cache": True, "seq_size_per_block": 4})
    with pipeline:
        block = pipeline.config.seq_size_per_block
        print(f"reuse_cache: {pipeline.config.reuse_cache}, SEQ_SIZE_PER_BLOCK: {block}")
        for prompt in DEMO_PROMPTS:
            print(f"\n>>> {prompt}")
            _stream(pipeline, prompt, {"top_k": 1, "max_new_tokens": args.max_new_tokens})
        print("\ncache_stats:", json.dumps(pipeline.cache_stats()))


def generate(args: argparse.Namespace) -> None:
    pipeline = _pipeline(args.model, {})
    with pipeline:
        config = json.loads(args.generate_config) if args.generate_config else {}
        config.setdefault("max_new_tokens", args.max_new_tokens)
        _stream(pipeline, args.prompt, config)


def serve(args: argparse.Namespace) -> None:
    from rtpkv.server import serve as run_server

    run_server(model=args.model, host=args.host, port=args.port,
               served_model_name=args.served_model_name, shutdown_timeout=args.shutdown_timeout,
               log_level="info" if args.verbose else "warning")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="rtpkv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the ReuseCache scenario on a tiny built-in checkpoint")
    p.add_argument("--model", help="a checkpoint directory or hub id instead of the built-in one")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.set_defaults(func=demo)
    p = sub.add_parser("generate", help="stream one prompt")
    p.add_argument("prompt")
    p.add_argument("--model", help="a checkpoint directory or hub id (default: the demo one)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--generate-config", help="JSON object of generate_config keys")
    p.set_defaults(func=generate)
    p = sub.add_parser("serve", help="HTTP server: rtp-llm's POST / and OpenAI's /v1 routes "
                                     "(model from CHECKPOINT_PATH, port START_PORT, host HOST)")
    p.add_argument("--model", help="a checkpoint directory or hub id (default: CHECKPOINT_PATH)")
    p.add_argument("--host", help="address to listen on (default: HOST, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: START_PORT, else 8088)")
    p.add_argument("--served-model-name", help="the model id of /v1 (default: the directory name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM (default 30)")
    p.set_defaults(func=serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except Exception as exc:  # one clear line for users; -v shows the traceback
        if args.verbose:
            raise
        print(f"rtpkv: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
