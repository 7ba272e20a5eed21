"""The Dynamo worker's parts that need no Dynamo process: a request's fields mapped to a
GenerateConfig (and refused by name), the card directory the frontend reads, the launcher's
commands and policy file, and the announcement that lets a late subscriber (Dynamo's relay)
learn what the pool and the tiers hold."""

from __future__ import annotations

import json
import random
import threading

import pytest

from rtpkv.chat import CHATML_TEMPLATE
from rtpkv.fleet.dynamo_worker import (RequestRefused, card_directory, connectable,
                                       generate_config)
from rtpkv.fleet.launcher import Fleet, Replica
from rtpkv.fleet.view import ReplicaView
from rtpkv.fleet.wire import wire_hash
from rtpkv.generate_config import GenerateConfig
from rtpkv.model_factory import ModelConfig, ModelFactory
from rtpkv.pipeline import Pipeline
from server_helpers import free_port, wait_until

EOS = frozenset({2})


def request(**groups) -> dict:
    """A request as Dynamo's frontend sends it (every field present, most None)."""
    sampling = dict.fromkeys(("n", "best_of", "presence_penalty", "frequency_penalty",
                              "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
                              "use_beam_search", "length_penalty", "seed",
                              "include_stop_str_in_output", "guided_decoding"))
    stop = dict.fromkeys(("max_tokens", "stop", "stop_token_ids", "stop_token_ids_visible",
                          "stop_token_ids_hidden", "min_tokens", "ignore_eos",
                          "max_thinking_tokens"))
    output = dict.fromkeys(("logprobs", "prompt_logprobs", "skip_special_tokens",
                            "formatted_prompt", "return_tokens_as_token_ids"))
    sampling.update(groups.get("sampling", {}))
    stop.update(groups.get("stop", {}))
    output.update(groups.get("output", {}))
    return {"token_ids": [5, 6, 7], "model": "m", "sampling_options": sampling,
            "stop_conditions": stop, "output_options": output,
            "eos_token_ids": groups.get("eos", [2]), "routing": groups.get("routing", {}),
            "extra_args": groups.get("extra_args", {})}


def test_sampling_stop_conditions_and_salt_map_to_a_valid_generate_config():
    config = generate_config(request(
        sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 11,
                  "repetition_penalty": 1.1},
        stop={"max_tokens": 9, "min_tokens": 2, "stop": ["end"], "stop_token_ids_hidden": [2, 9]},
        eos=[2, 7], routing={"dp_rank": 0, "cache_salt": "tenant-a"}), EOS)
    assert config == {"return_incremental": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9,
                      "repetition_penalty": 1.1, "random_seed": 11, "max_new_tokens": 9,
                      "min_new_tokens": 2, "stop_words_str": ["end"],
                      "stop_words_list": [[7], [9]], "cache_salt": "tenant-a"}
    GenerateConfig.build(config, {})


def test_greedy_and_the_defaults_dynamo_sends():
    config = generate_config(request(sampling={"temperature": 0.0, "top_k": -1}), EOS)
    assert config == {"return_incremental": True, "temperature": 0.0, "do_sample": False}
    assert GenerateConfig.build(config, {}).greedy


def test_the_salt_also_comes_from_nvext():
    config = generate_config(request(extra_args={"nvext": {"cache_salt": "b"}}), EOS)
    assert config["cache_salt"] == "b"


@pytest.mark.parametrize("group, field, value", [
    ("sampling", "n", 2), ("sampling", "best_of", 3), ("sampling", "presence_penalty", 0.5),
    ("sampling", "frequency_penalty", 0.1), ("sampling", "min_p", 0.05),
    ("sampling", "use_beam_search", True), ("sampling", "guided_decoding", {"regex": "a"}),
    ("stop", "max_thinking_tokens", 10), ("output", "logprobs", 2),
    ("output", "prompt_logprobs", 1)])
def test_what_rtpkv_cannot_honour_is_refused_by_name(group, field, value):
    with pytest.raises(RequestRefused, match=f"{field}={value!r}: rtpkv does not support it"):
        generate_config(request(**{group: {field: value}}), EOS)


def test_neutral_values_of_unsupported_fields_pass():
    generate_config(request(sampling={"n": 1, "presence_penalty": 0.0, "length_penalty": 1.0}),
                    EOS)


def test_a_wildcard_endpoint_is_reached_on_loopback():
    assert connectable("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert connectable("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert connectable("tcp://10.1.2.3:9") == "tcp://10.1.2.3:9"


def test_the_card_directory_has_the_fast_tokenizer_and_rtpkvs_chat_template(checkpoints,
                                                                           tmp_path):
    from transformers import AutoTokenizer

    checkpoint = checkpoints("qwen2")
    assert not (checkpoint / "tokenizer.json").exists()
    card = card_directory(checkpoint, tmp_path)
    assert card != checkpoint and (card / "tokenizer.json").exists()
    assert json.loads((card / "config.json").read_text()) == \
        json.loads((checkpoint / "config.json").read_text())
    ours, theirs = (AutoTokenizer.from_pretrained(str(p)) for p in (checkpoint, card))
    assert theirs.chat_template == CHATML_TEMPLATE
    text = "hello, what's your name? 123 tell me about the river"
    assert theirs(text)["input_ids"] == ours(text)["input_ids"]
    assert card_directory(checkpoint, tmp_path) == card          # built once
    assert card_directory(card, tmp_path / "other") == card      # complete: used as it is


def test_the_card_renders_a_chat_to_the_ids_rtpkv_renders(checkpoints, tmp_path):
    """Dynamo's frontend renders the card's template and adds no special token (a Llama
    tokenizer's BOS: tests/fleet/test_dynamo.py, with the frontend itself)."""
    from transformers import AutoTokenizer

    from rtpkv.chat import render_chat

    checkpoint = checkpoints("qwen2")
    card = card_directory(checkpoint, tmp_path)
    ours, theirs = (AutoTokenizer.from_pretrained(str(p)) for p in (checkpoint, card))
    messages = [{"role": "system", "content": "tell me about the river"},
                {"role": "user", "content": "hello, what's your name?"}]
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert theirs(text, add_special_tokens=False)["input_ids"] == render_chat(ours, messages)


def fleet_with_two(tmp_path) -> Fleet:
    fleet = Fleet("/models/m", 2, replica_port=9000, events_port=9100, router_port=9200,
                  block_size=32, log_dir=str(tmp_path), dynamo=True)
    fleet.replicas = [Replica(i, f"http://127.0.0.1:{9000 + i}", f"tcp://127.0.0.1:{9100 + 2 * i}",
                              f"tcp://127.0.0.1:{9101 + 2 * i}", None, tmp_path / "log")
                      for i in range(2)]
    return fleet


def test_the_frontend_gets_the_router_mode_discovery_and_the_policy_file(tmp_path):
    fleet = fleet_with_two(tmp_path)
    argv = fleet.router_command("dynamo", "kv", dynamo_policy={"overlap_score_credit": 0.5,
                                                               "router_temperature": 0.2})
    pairs = list(zip(argv, argv[1:]))
    assert argv[:3][1:] == ["-m", "dynamo.frontend"]
    for pair in (("--router-mode", "kv"), ("--discovery-backend", "file"),
                 ("--http-host", "127.0.0.1"), ("--http-port", "9200"),
                 ("--kv-cache-block-size", "32")):
        assert pair in pairs
    policy = (tmp_path / "dynamo-policy.yaml").read_text()
    assert ("--router-policy-config", str(tmp_path / "dynamo-policy.yaml")) in pairs
    assert "type: dynamo-default-cost-fn" in policy and "aggregated: rtpkv-fleet" in policy
    assert "overlap_score_credit: 0.5" in policy and "router_temperature: 0.2" in policy
    assert "--router-policy-config" not in fleet.router_command("dynamo", "kv")


def test_dynamo_workers_share_one_discovery_directory_on_loopback(tmp_path):
    fleet = fleet_with_two(tmp_path)
    envs = [fleet.replica_env(i) for i in range(2)]
    assert envs[0]["DYN_FILE_KV"] == envs[1]["DYN_FILE_KV"] == str(tmp_path / "discovery")
    for name in ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST"):
        assert envs[1][name] == "127.0.0.1"
    assert fleet.replica_command(9001)[2:4] == ["rtpkv", "dynamo-worker"]
    assert ("--port", "9001") in zip(fleet.replica_command(9001), fleet.replica_command(9001)[1:])


def test_knobs_are_checked_and_belong_to_dynamo(tmp_path):
    fleet = fleet_with_two(tmp_path)
    with pytest.raises(ValueError, match="unknown parameter.*overlap_weight.*accepted: "
                                         "overlap_score_credit"):
        fleet.router_command("dynamo", "kv", dynamo_policy={"overlap_weight": 1})
    with pytest.raises(ValueError, match="dynamo_policy is Dynamo's router's"):
        fleet.router_command("vllm", "kv_aware", dynamo_policy={"overlap_score_credit": 1})
    serve_fleet = Fleet("/models/m", 1, log_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs Dynamo workers"):
        serve_fleet.router_command("dynamo", "kv")


def test_a_late_subscriber_learns_the_pool_and_the_tiers_from_the_announcement(checkpoints,
                                                                            tmp_path):
    """What Dynamo's relay sees: it subscribes after the task prompt was pinned and after
    blocks moved to host memory and disk. Each subscription announces the current contents,
    so its view equals what the replica holds, in each medium, pinned blocks included."""
    B = 4
    model = ModelFactory.from_huggingface(checkpoints("qwen2"), ModelConfig())
    block_bytes = model.spec.num_layers * 2 * model.spec.num_kv_heads * B * model.spec.head_dim * 4
    rng = random.Random(3)
    prefixes = [[rng.randrange(5, 500) for _ in range(12)] for _ in range(6)]
    pub = f"tcp://127.0.0.1:{free_port()}"
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=96,
                  concurrency_limit=2, enable_memory_cache=True,
                  host_cache_size=10 * block_bytes, enable_memory_cache_disk=True,
                  memory_cache_disk_paths=str(tmp_path), write_cache_sync=True,
                  kv_events_endpoint=pub,
                  tasks=[{"task_id": "t", "prompt": "hello what's your name how old are you"}]
                  ) as pipeline:
        for _ in range(20):
            for _ in pipeline(rng.choice(prefixes) + [rng.randrange(5, 500) for _ in range(5)],
                              generate_config={"max_new_tokens": 2, "top_k": 1}):
                pass
        pipeline.kv_event_publisher.add_subscribe_listener(lambda: threading.Thread(
            target=pipeline.engine.announce_contents).start())
        cache = pipeline.engine.cache
        tiers = {tier.name: tier for tier in cache.ladder.tiers}
        held = {"GPU": {wire_hash(k) for k, _ in cache.index.items()},
                "CPU": {wire_hash(k) for k in tiers["memory"]._slots},
                "DISK": {wire_hash(k) for k in tiers["disk"]._sizes}}
        assert all(held.values()) and cache.pool.num_pinned > 0
        late = ReplicaView(pub)

        def caught_up() -> bool:
            late.poll(0.05)
            return {m: late.blocks[m] for m in held} == held
        assert wait_until(caught_up, 15), {m: len(b) for m, b in late.blocks.items()}
        late.close()


def test_the_fleet_command_refuses_dynamos_knobs_for_another_router(capsys):
    from rtpkv.cli import main

    with pytest.raises(SystemExit):
        main(["fleet", "--router", "vllm", "--router-temperature", "0.5", "--duration", "1"])
    assert "--router vllm has none" in capsys.readouterr().err
