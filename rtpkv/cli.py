"""The `rtpkv` command: `demo` runs rtp-llm's ReuseCache scenario on a tiny built-in checkpoint
(or on --model PATH); `generate` streams one prompt; `serve` runs the HTTP server."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Optional

from rtpkv import __version__

DEMO_PROMPTS = ["hello, what's your name", "hello, what's your name? how old are you?"]
RANDOM_WEIGHTS_NOTE = (
    "The built-in demo model has random weights, so its text is meaningless by design: the demo\n"
    "shows the cache. The second prompt starts with the first, and the whole KV blocks of that\n"
    "common prefix are reused instead of computed again (reuse_len).")
# generate_config keys that ask for sampling; without any, `rtpkv generate` is greedy
SAMPLING_KEYS = {"do_sample", "top_k", "top_p", "temperature", "random_seed"}


def _pipeline(model: Optional[str], defaults: dict[str, Any]):
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.model_factory.tiny import model_or_demo
    from rtpkv.pipeline import Pipeline

    # The demo's defaults apply only where the environment says nothing.
    options = {k: v for k, v in defaults.items() if k.upper() not in os.environ}
    loaded = ModelFactory.from_huggingface(model_or_demo(model), ModelConfig(**options))
    return Pipeline(loaded, loaded.tokenizer)


def _stream(pipeline, prompt: str, config: dict[str, Any], chat: bool = False) -> None:
    """Print the stream of `prompt` (with `chat`, the one user message of a chat, through the
    checkpoint's chat template), then its aux_info."""
    from rtpkv.report import aux_table

    res = None
    request = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    # a terminal shows deltas: printed text is never taken back
    for res in pipeline(generate_config={**config, "return_incremental": True}, **request):
        sys.stdout.write(res.batch_response[0])
        sys.stdout.flush()
    print()
    if res is not None:
        print("aux_info:")
        print(aux_table(res.aux_info, pipeline.config.seq_size_per_block))


def demo(args: argparse.Namespace) -> None:
    from rtpkv.report import stats_table

    if not args.model:
        print(RANDOM_WEIGHTS_NOTE)
    pipeline = _pipeline(args.model, {"reuse_cache": True, "seq_size_per_block": 4})
    with pipeline:
        block = pipeline.config.seq_size_per_block
        print(f"reuse_cache: {pipeline.config.reuse_cache}, SEQ_SIZE_PER_BLOCK: {block}")
        for prompt in DEMO_PROMPTS:
            print(f"\n>>> {prompt}")
            _stream(pipeline, prompt, {"top_k": 1, "max_new_tokens": args.max_new_tokens})
        print("\ncache_stats:")
        print(stats_table(pipeline.cache_stats()))


def generate_config_option(text: Optional[str], max_new_tokens: int) -> dict[str, Any]:
    """--generate-config parsed and validated (before any weights load); greedy unless it
    asks for sampling."""
    from rtpkv.errors import ConfigError
    from rtpkv.generate_config import GenerateConfig

    config: Any = {}
    if text:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--generate-config is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ConfigError("--generate-config must be a JSON object of generate_config keys, "
                              f"got a JSON {type(config).__name__}")
    config.setdefault("max_new_tokens", max_new_tokens)
    if not SAMPLING_KEYS & set(config):
        config["do_sample"] = False
    GenerateConfig.build(config, {})
    return config


def generate(args: argparse.Namespace) -> None:
    config = generate_config_option(args.generate_config, args.max_new_tokens)
    pipeline = _pipeline(args.model, {})
    with pipeline:
        _stream(pipeline, args.prompt, config, chat=args.chat)


def serve(args: argparse.Namespace) -> None:
    from rtpkv.server import serve as run_server

    run_server(model=args.model, host=args.host, port=args.port,
               served_model_name=args.served_model_name, shutdown_timeout=args.shutdown_timeout,
               log_level="debug" if args.verbose else "info", access_log=args.access_log)


def build_parser() -> argparse.ArgumentParser:
    # -v is accepted before and after the subcommand
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log at INFO level; show tracebacks")
    parser = argparse.ArgumentParser(prog="rtpkv", description=__doc__, parents=[verbose])
    parser.add_argument("--version", action="version", version=f"rtpkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", parents=[verbose],
                       help="the ReuseCache scenario on a tiny built-in checkpoint")
    p.add_argument("--model", help="a checkpoint directory or hub id instead of the built-in one")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.set_defaults(func=demo)
    p = sub.add_parser("generate", parents=[verbose], help="stream one prompt (greedy by default)")
    p.add_argument("prompt")
    p.add_argument("--model", help="a checkpoint directory or hub id (default: the demo one)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the chat template")
    p.add_argument("--generate-config",
                   help='JSON object of generate_config keys, e.g. \'{"top_k": 50, "temperature": 0.8}\'')
    p.set_defaults(func=generate)
    p = sub.add_parser("serve", parents=[verbose],
                       help="HTTP server: rtp-llm's POST / and OpenAI's /v1 routes "
                            "(model from CHECKPOINT_PATH, port START_PORT, host HOST)")
    p.add_argument("--model", help="a checkpoint directory or hub id (default: CHECKPOINT_PATH)")
    p.add_argument("--host", help="address to listen on (default: HOST, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: START_PORT, else 8088)")
    p.add_argument("--served-model-name", help="the model id of /v1 (default: the directory name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM (default 30)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="do not log one line per HTTP request (logged by default, as uvicorn does)")
    p.set_defaults(func=serve)
    from rtpkv.fleet.launcher import add_parser as add_fleet_parser

    add_fleet_parser(sub, [verbose])
    from rtpkv.fleet.dynamo_worker import add_parser as add_dynamo_worker_parser

    add_dynamo_worker_parser(sub, [verbose])
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    args.verbose = getattr(args, "verbose", False)
    # the server logs at INFO by default: a container operator's only view of what it does
    logging.basicConfig(level=logging.INFO if args.verbose or args.command in ("serve",
                                                                             "dynamo-worker")
                        else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except KeyboardInterrupt:
        print("rtpkv: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # one clear line for users; -v shows the traceback
        if args.verbose:
            raise
        print(f"rtpkv: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
