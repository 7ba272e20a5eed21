"""`rtpkv dynamo-worker`: one `Pipeline` as a worker of NVIDIA Dynamo, behind its frontend and
KV router.

Dynamo's frontend tokenizes and templates a request, its KV router picks a worker by the
blocks each one caches against the load each one carries, and the worker gets the token ids.
This module is that worker, on Dynamo's Python backend API (`dynamo.common.backend`): an
`LLMEngine` whose `generate` runs the ids through the pipeline and streams the new ids back.

- Configured as `rtpkv serve` is: CHECKPOINT_PATH (or --model) and every other option from the
  environment. KV_EVENTS_ENDPOINT is where rtpkv publishes its KV events (a free loopback port
  when unset); Dynamo's relay subscribes to it (`ZmqSource`) and hashes each event's
  `token_ids` itself, so nothing is shared but the block size.
- The relay subscribes only after `start()`, so what was published before (the task prompts'
  pinned blocks, a disk tier's records found at a restart) would be lost: each time a consumer
  subscribes, the pool's and the tiers' current contents are announced again.
- A salted chain's first block goes out with folded ids and the salt's digest (never the
  salt, rtpkv.fleet.wire), so the router credits no tenant's blocks to another's text; a
  salted request is routed by load.
- Host-memory and disk blocks are published under the tier names Dynamo maps
  (KV_EVENTS_MEDIUMS=tiers unless set), so its router weighs them with its host and disk
  hit weights rather than as device blocks.
- Registered with the pool's capacity (`total_kv_blocks`), block size, context length,
  CONCURRENCY_LIMIT and the prompt tokens a step takes (MAX_NUM_BATCHED_TOKENS: the router's
  busy and queue thresholds are fractions of it); the frontend reads the tokenizer and chat
  template from a card directory (the checkpoint's own when it has `tokenizer.json` and a template; else one written here
  with rtpkv's fallback template, so the frontend renders a chat as `rtpkv serve` does).
- A request's sampling options, stop conditions, EOS ids, cache salt and max tokens become a
  `GenerateConfig`; what rtpkv cannot honour is refused by name. `cached_tokens` in the usage
  is the request's `reuse_len`. A client that goes away cancels the request in the engine.

Dynamo's own variables choose its planes: discovery through files (DYN_FILE_KV, a directory
the frontend shares), requests over TCP, events over ZeroMQ; `rtpkv fleet --router dynamo`
sets them for a loopback fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any, AsyncGenerator, Optional

from rtpkv.chat import CHATML_TEMPLATE
from rtpkv.errors import ConfigError, RequestError

log = logging.getLogger("rtpkv")

# Dynamo's request fields rtpkv has no counterpart for, refused when they ask for something
# (a value other than the neutral one); each maps to the neutral values it accepts.
UNSUPPORTED_SAMPLING = {"n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0, 0.0),
                        "frequency_penalty": (None, 0, 0.0), "min_p": (None, 0, 0.0),
                        "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
                        "guided_decoding": (None,)}
UNSUPPORTED_STOP = {"max_thinking_tokens": (None,)}
UNSUPPORTED_OUTPUT = {"logprobs": (None,), "prompt_logprobs": (None,)}
FINISH_REASONS = {"eos": "eos", "stop": "stop", "length": "length", "cancelled": "cancelled"}
CARD_FILES = ("config.json", "generation_config.json")
DEFAULT_NAMESPACE = "dynamo"
# Dynamo's relay reads an extra key with this prefix as the block's cache salt (and hashes
# the block as its router hashes a request with that `cache_salt`); any other string is
# metadata of another kind, and a salted prefix would never match.


class RequestRefused(ValueError):
    """A request field rtpkv cannot honour, named."""


def _refuse_unsupported(group: str, given: dict[str, Any],
                        neutral: dict[str, tuple[Any, ...]]) -> None:
    for name, accepted in neutral.items():
        if given.get(name) not in accepted:
            raise RequestRefused(f"{group}.{name}={given[name]!r}: rtpkv does not support it "
                                 f"(accepted: {', '.join(map(repr, accepted))})")


def generate_config(request: dict[str, Any], eos_token_ids: frozenset[int]) -> dict[str, Any]:
    """The rtpkv generate_config of one Dynamo request (its `sampling_options`,
    `stop_conditions`, `output_options`, `eos_token_ids` and `routing`); RequestRefused
    names a field that asks for what rtpkv cannot do."""
    sampling = request.get("sampling_options") or {}
    stop = request.get("stop_conditions") or {}
    output = request.get("output_options") or {}
    _refuse_unsupported("sampling_options", sampling, UNSUPPORTED_SAMPLING)
    _refuse_unsupported("stop_conditions", stop, UNSUPPORTED_STOP)
    _refuse_unsupported("output_options", output, UNSUPPORTED_OUTPUT)
    config: dict[str, Any] = {"return_incremental": True}
    temperature = sampling.get("temperature")
    if temperature is not None:
        config["temperature"] = temperature
        if temperature == 0:
            config["do_sample"] = False
    top_k = sampling.get("top_k")
    if top_k is not None and top_k > 0:   # Dynamo's -1 (and 0): no top-k filter
        config["top_k"] = top_k
    for source, target in (("top_p", "top_p"), ("repetition_penalty", "repetition_penalty"),
                           ("seed", "random_seed")):
        if sampling.get(source) is not None:
            config[target] = sampling[source]
    if stop.get("max_tokens") is not None:
        config["max_new_tokens"] = stop["max_tokens"]
    if stop.get("min_tokens") is not None:
        config["min_new_tokens"] = stop["min_tokens"]
    if stop.get("ignore_eos") is not None:
        config["ignore_eos"] = stop["ignore_eos"]
    if stop.get("stop"):
        config["stop_words_str"] = list(stop["stop"])
    # stop ids beyond the model's own EOS: the request's EOS ids, then its stop ids (the
    # frontend shows or hides each as the request asked)
    extra_ids = [i for i in (request.get("eos_token_ids") or []) if i not in eos_token_ids]
    for group in ("stop_token_ids", "stop_token_ids_visible", "stop_token_ids_hidden"):
        extra_ids += [i for i in (stop.get(group) or [])
                      if i not in eos_token_ids and i not in extra_ids]
    if extra_ids and not config.get("ignore_eos"):
        config["stop_words_list"] = [[i] for i in extra_ids]
    if output.get("skip_special_tokens") is not None:
        config["skip_special_tokens"] = output["skip_special_tokens"]
    salt = cache_salt(request)
    if salt:
        config["cache_salt"] = salt
    return config


def cache_salt(request: dict[str, Any]) -> Optional[str]:
    """The request's cache salt: `routing.cache_salt`, else the OpenAI body's
    `nvext.cache_salt` (which the frontend passes on in `extra_args`)."""
    routing = request.get("routing") or {}
    if routing.get("cache_salt"):
        return str(routing["cache_salt"])
    extra = request.get("extra_args") or {}
    for source in (request.get("nvext"), extra.get("nvext") if isinstance(extra, dict) else None):
        if isinstance(source, dict) and source.get("cache_salt"):
            return str(source["cache_salt"])
    return None


def connectable(endpoint: str) -> str:
    """A bound ZeroMQ endpoint as a local peer connects to it (`tcp://*:p` and
    `tcp://0.0.0.0:p` bind every interface; loopback reaches them)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint


def free_port() -> int:
    """A TCP port free on loopback now (KV_EVENTS_ENDPOINT's default here)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def card_directory(checkpoint: Path, cache_root: Path) -> Path:
    """Where Dynamo's frontend reads the model's tokenizer, chat template and config: the
    checkpoint itself when it has `tokenizer.json` and a chat template; else a directory
    (under `cache_root`, one per checkpoint and tokenizer version) with the tokenizer saved in
    its fast form, rtpkv's fallback chat template (ChatML, after the BOS where the tokenizer
    adds one, as rtpkv renders it) and the checkpoint's config."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    if (checkpoint / "tokenizer.json").exists() and tokenizer.chat_template:
        return checkpoint
    if not tokenizer.is_fast:
        raise ConfigError(f"{checkpoint}: Dynamo's frontend needs tokenizer.json, and this "
                          "tokenizer has no fast form to write it from")
    stamp = hashlib.sha256(str(checkpoint.resolve()).encode())
    for f in sorted(checkpoint.iterdir()):
        if f.name.startswith("tokenizer") or f.name in CARD_FILES or f.suffix in (".txt", ".json"):
            stamp.update(f"{f.name}:{f.stat().st_mtime_ns}".encode())
    target = cache_root / f"{checkpoint.name}-{stamp.hexdigest()[:12]}"
    if (target / "tokenizer.json").exists():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".card-"))
    if not tokenizer.chat_template:
        # rtpkv tokenizes its fallback rendering as a plain prompt (BOS added where the
        # tokenizer adds one); the frontend adds no special token to a rendered chat
        bos = tokenizer.bos_token_id
        adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [bos]
        tokenizer.chat_template = ("{{ bos_token }}" if adds_bos else "") + CHATML_TEMPLATE
    tokenizer.save_pretrained(str(tmp))
    for name in CARD_FILES:
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, tmp / name)
    try:
        os.replace(tmp, target)
    except OSError:   # another worker on the same checkpoint wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtpkv dynamo-worker", add_help=False)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: CHECKPOINT_PATH)")
    p.add_argument("--served-model-name",
                   help="the model's name at the frontend (default: the directory name)")
    p.add_argument("--port", type=int,
                   help="also serve rtpkv's HTTP routes over the same pipeline on this port "
                        "(/health, /cache_status, /metrics, generation: what operators and "
                        "other routers read); none by default")
    p.add_argument("--host", default="127.0.0.1", help="address of --port (default 127.0.0.1)")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                   help="Dynamo namespace the frontend serves (default: dynamo)")
    p.add_argument("--component", default="backend", help="Dynamo component name")
    p.add_argument("--endpoint", default="generate", help="Dynamo endpoint name")
    p.add_argument("--discovery-backend", default="file", choices=("file", "etcd", "kubernetes"),
                   help="how the frontend finds workers (file: the directory DYN_FILE_KV)")
    p.add_argument("--request-plane", default="tcp", choices=("tcp", "nats"))
    p.add_argument("--event-plane", default="zmq", choices=("zmq", "nats"))


def _engine_class() -> type:
    """RtpkvEngine, built on first use: Dynamo is imported only by this command."""
    from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
    from dynamo.common.backend.publisher import ZmqSource
    from dynamo.llm import ModelInput
    from dynamo.llm.exceptions import InvalidArgument

    class RtpkvEngine(LLMEngine):
        """A Pipeline behind Dynamo's worker API (see the module docstring)."""

        def __init__(self, args: argparse.Namespace, checkpoint: Path, card: Path, name: str):
            self.args, self.checkpoint, self.card, self.name = args, checkpoint, card, name
            self.pipeline: Any = None
            self.http: Optional[Any] = None       # uvicorn server of --port
            self._http_thread: Optional[threading.Thread] = None
            self._streams: dict[str, Any] = {}   # context id -> the request's ResponseStream

        @classmethod
        async def from_args(cls, argv: Optional[list[str]] = None
                            ) -> "tuple[RtpkvEngine, WorkerConfig]":
            return await cls.create(build_parser().parse_args(argv))

        @classmethod
        async def create(cls, args: argparse.Namespace) -> "tuple[RtpkvEngine, WorkerConfig]":
            from rtpkv.config import Settings
            from rtpkv.user_cache import user_cache_dir

            path = args.model or Settings.from_env().checkpoint_path
            if not path:
                raise ConfigError("no model: set CHECKPOINT_PATH or pass --model")
            checkpoint = Path(path)
            name = args.served_model_name or checkpoint.name
            card = await asyncio.to_thread(card_directory, checkpoint,
                                           user_cache_dir() / "dynamo-cards")
            engine = cls(args, checkpoint, card, name)
            config = WorkerConfig(namespace=args.namespace, component=args.component,
                                  endpoint=args.endpoint, model_name=str(card),
                                  served_model_name=name, model_input=ModelInput.Tokens,
                                  discovery_backend=args.discovery_backend,
                                  request_plane=args.request_plane, event_plane=args.event_plane)
            return engine, config

        async def start(self, worker_id: int) -> "EngineConfig":
            self.pipeline = await asyncio.to_thread(self._load)
            if self.args.port:
                self._serve_http()
            config = self.pipeline.config
            return EngineConfig(
                model=str(self.card), served_model_name=self.name,
                llm=LlmRegistration(context_length=config.max_seq_len,
                                    kv_cache_block_size=config.seq_size_per_block,
                                    total_kv_blocks=self.pipeline.engine.num_blocks,
                                    max_num_seqs=config.concurrency_limit,
                                    max_num_batched_tokens=config.max_num_batched_tokens))

        def _load(self) -> Any:
            from rtpkv.config import Settings
            from rtpkv.model_factory import ModelConfig, ModelFactory
            from rtpkv.pipeline import Pipeline
            from rtpkv.server.main import warm_up

            loaded = ModelFactory.from_huggingface(str(self.checkpoint), ModelConfig())
            options: dict[str, Any] = {} if loaded.config.kv_events_endpoint else {
                "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}"}
            if "KV_EVENTS_MEDIUMS" not in os.environ:   # the names Dynamo maps to its tiers
                options["kv_events_mediums"] = "tiers"
            pipeline = Pipeline(loaded, loaded.tokenizer, **options)
            if Settings.from_env().warm_up:
                log.info("warm-up done in %.1f s", warm_up(pipeline))
            log.info("model %r from %s: %d KV blocks of %d tokens, events on %s", self.name,
                     self.checkpoint, pipeline.engine.num_blocks,
                     pipeline.config.seq_size_per_block, pipeline.kv_event_publisher.endpoint)
            return pipeline

        def _serve_http(self) -> None:
            """rtpkv's app over the same pipeline, on its own thread and event loop (uvicorn
            installs no signal handler off the main thread: the Rust worker keeps them)."""
            import uvicorn

            from rtpkv.server.app import create_app
            from rtpkv.server.main import bind

            sock = bind(self.args.host, self.args.port)
            app = create_app(self.pipeline, self.name, stop_pipeline_on_shutdown=False)
            self.http = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                      access_log=False))
            self._http_thread = threading.Thread(target=self.http.run, kwargs={"sockets": [sock]},
                                                 name="rtpkv-http", daemon=True)
            self._http_thread.start()
            log.info("rtpkv routes on http://%s:%d", self.args.host, self.args.port)

        async def kv_event_sources(self) -> list:
            publisher = self.pipeline.kv_event_publisher
            engine = self.pipeline.engine
            # on the publisher's thread: hand the announcement to a thread of its own (it waits
            # for the engine's lock while a step runs)
            publisher.add_subscribe_listener(lambda: threading.Thread(
                target=engine.announce_contents, name="rtpkv-announce", daemon=True).start())
            return [ZmqSource(endpoint=connectable(publisher.endpoint),
                              topic=self.pipeline.config.kv_events_topic)]

        async def generate(self, request: dict[str, Any], context: Any
                           ) -> AsyncGenerator[dict[str, Any], None]:
            try:
                config = generate_config(request, self.pipeline.eos_token_ids)
            except RequestRefused as exc:
                raise InvalidArgument(str(exc)) from None
            token_ids = list(request["token_ids"])
            try:
                # on the event loop, not a thread: token ids are not tokenized and submitting
                # takes no lock a step holds, and the hop cost ~1 ms of each request's TTFT
                stream = self.pipeline.pipeline_async(token_ids, config)
            except (RequestError, ConfigError) as exc:   # out of range, a prompt too long, ...
                raise InvalidArgument(str(exc)) from None
            key = context.id()
            self._streams[key] = stream
            sent, last = 0, None
            try:
                async for res in stream:
                    last = res
                    chunk: dict[str, Any] = {"token_ids": res.output_ids[sent:], "index": 0}
                    sent = len(res.output_ids)
                    if res.finished:
                        aux = res.aux_info
                        chunk["finish_reason"] = FINISH_REASONS.get(aux.get("finish_reason"),
                                                                    "stop")
                        prompt = aux.get("input_len", len(token_ids)) + aux.get("prefix_len", 0)
                        chunk["completion_usage"] = {
                            "prompt_tokens": prompt, "completion_tokens": sent,
                            "total_tokens": prompt + sent,
                            "prompt_tokens_details": {"cached_tokens": aux.get("reuse_len", 0)}}
                    yield chunk
            finally:
                self._streams.pop(key, None)
                stream.close()   # the client left (or the request ended): free its blocks
            if last is None:
                raise RuntimeError("the pipeline answered nothing")

        async def abort(self, context: Any) -> None:
            stream = self._streams.pop(context.id(), None)
            if stream is not None:
                stream.close()

        async def cleanup(self) -> None:
            if self.http is not None:
                self.http.should_exit = True
                await asyncio.to_thread(self._http_thread.join, 10)
                self.http = None
            if self.pipeline is not None:
                await asyncio.to_thread(self.pipeline.stop)
                self.pipeline = None

    return RtpkvEngine


def main(args: argparse.Namespace) -> None:
    """`rtpkv dynamo-worker`: run the worker until Dynamo's runtime stops it (SIGTERM/SIGINT)."""
    from dynamo.common.backend.run import run

    engine = _engine_class()
    run(engine, engine_factory=lambda _argv: engine.create(args))


def add_parser(sub: "argparse._SubParsersAction", parents: list) -> None:
    p = sub.add_parser("dynamo-worker", parents=parents,
                       help="serve the model as a worker of NVIDIA Dynamo (its frontend and KV "
                            "router in front; model from CHECKPOINT_PATH or --model)")
    add_arguments(p)
    p.set_defaults(func=main)
