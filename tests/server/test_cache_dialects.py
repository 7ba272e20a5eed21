"""Clients' own prompt-cache words over real HTTP, with the unmodified `openai` and `anthropic`
clients: OpenAI's prompt_cache_retention and prompt_cache_key, Anthropic's Messages API with
cache_control breakpoints, tenants from a header and their quotas changed at run time."""

from __future__ import annotations

import contextlib

import anthropic
import httpx
import openai
import pytest

from conftest import load
from rtpkv.cache.manager import common_prefix
from rtpkv.pipeline import Pipeline
from rtpkv.server import create_app
from rtpkv.server.tenants import CacheSwitches
from server_helpers import ServerThread

MODEL = "tiny-llama"
B = 4   # tokens per block


@contextlib.contextmanager
def serving(llama_path, switches: CacheSwitches = CacheSwitches(), **options):
    """A server over its own pipeline (reuse on, 4-token blocks); yields (url, pipeline)."""
    options.setdefault("kv_cache_max_tokens", 2048)
    model = load(llama_path, reuse_cache=True, seq_size_per_block=B, **options)
    pipe = Pipeline(model, model.tokenizer)
    with ServerThread(create_app(pipe, MODEL, switches=switches)) as server:
        yield server.url, pipe
    pipe.check_integrity()


@pytest.fixture(scope="module")
def plain(llama_path):
    with serving(llama_path) as served:
        yield served


@pytest.fixture(scope="module")
def keyed(llama_path):
    """PROMPT_CACHE_KEY_SALT=1 and TENANT_HEADER_SALT=1 (x-tenant-id)."""
    with serving(llama_path, CacheSwitches(prompt_cache_key_salt=True,
                                           tenant_header="x-tenant-id")) as served:
        yield served


def oai(url: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                         default_headers=headers or None)


def by_priority(url: str) -> dict[str, int]:
    return httpx.get(url + "/cache_status").json()["blocks_cached_by_priority"]


def ids(start: int, n: int) -> list[int]:
    return [start + i for i in range(n)]


# ---------------------------------------------------------------------- OpenAI
@pytest.mark.parametrize("word,priority", [("in_memory", "60"), ("24h", "80")])
def test_prompt_cache_retention_holds_the_prompt_at_its_priority(plain, word, priority):
    url, _ = plain
    before = by_priority(url).get(priority, 0)
    prompt = ids(300 + 100 * (word == "24h"), 40) + [5, 6]   # 10 full blocks
    # the client's completions method has no such argument: it goes as the body's field
    res = oai(url).completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                      extra_body={"prompt_cache_retention": word})
    assert res.usage.prompt_tokens == 42
    assert by_priority(url)[priority] - before == 10


def test_prompt_cache_retention_on_chat_and_its_errors(plain):
    url, _ = plain
    client = oai(url)
    messages = [{"role": "user", "content": "keep this one for a day, with the river and the city"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                   prompt_cache_retention="24h", prompt_cache_key="agent-7")
    assert by_priority(url).get("80", 0) > 0
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       prompt_cache_retention="1h")
    assert "prompt_cache_retention" in str(err.value) and "24h" in str(err.value)
    retention = {"token_range_retention_configs": [{"token_start": 0, "priority": 90}]}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       prompt_cache_retention="24h",
                                       extra_body={"kv_cache_retention_config": retention})
    assert "kv_cache_retention_config" in str(err.value)


def test_prompt_cache_key_is_a_hint_unless_the_operator_makes_it_a_salt(plain, keyed):
    prompt = ids(1000, 24) + [7]
    for url, shared in ((plain[0], True), (keyed[0], False)):
        client = oai(url)
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                          extra_body={"prompt_cache_key": "alice"})
        same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                         extra_body={"prompt_cache_key": "alice"})
        other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                          extra_body={"prompt_cache_key": "bob"})
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert same.usage.prompt_tokens_details.cached_tokens == 24
        assert other.usage.prompt_tokens_details.cached_tokens == (24 if shared else 0)
    with pytest.raises(openai.BadRequestError) as err:
        oai(keyed[0]).completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                         extra_body={"prompt_cache_key": "alice",
                                                     "cache_salt": "carol"})
    assert "prompt_cache_key" in str(err.value) and "PROMPT_CACHE_KEY_SALT" in str(err.value)


# ---------------------------------------------------------------------- Anthropic
SYSTEM = ("you are a careful assistant. answer every question about the river, the city, the old "
          "house and the big tree, slowly and in order.")


def claude(url: str, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0,
                               default_headers=headers or None)


def marked(ttl: str = "5m", text: str = SYSTEM) -> list[dict]:
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": ttl}}]


GREEDY_EXTRA = {"ignore_eos": True, "temperature": 0}   # the client sends no sampling


def test_messages_match_the_python_chat_streamed_or_not(plain):
    url, pipe = plain
    question = [{"role": "user", "content": "what's your name?"}]
    expected = None
    for expected in pipe(messages=[{"role": "system", "content": "be brief"}] + question,
                         top_k=1, ignore_eos=True, max_new_tokens=12):
        pass
    client = claude(url)
    msg = client.messages.create(model=MODEL, max_tokens=12, system="be brief", messages=question,
                                 extra_body=GREEDY_EXTRA)
    assert msg.content[0].text == expected.generate_texts[0]
    assert msg.stop_reason == "max_tokens" and msg.role == "assistant" and msg.type == "message"
    assert msg.usage.output_tokens == 12
    assert (msg.usage.input_tokens + msg.usage.cache_read_input_tokens
            + msg.usage.cache_creation_input_tokens) == expected.aux_info["input_len"]
    with client.messages.stream(model=MODEL, max_tokens=12, system="be brief",
                                messages=question, extra_body=GREEDY_EXTRA) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    deltas = [r.generate_texts[0] for r in pipe(
        messages=[{"role": "system", "content": "be brief"}] + question, top_k=1,
        ignore_eos=True, max_new_tokens=12, return_incremental=True)]
    assert pieces == [d for d in deltas if d] and len(pieces) > 1   # the pipeline's deltas
    assert final.content[0].text == "".join(pieces)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    count = client.messages.count_tokens(model=MODEL, system="be brief", messages=question)
    assert count.input_tokens == expected.aux_info["input_len"]


def test_messages_stop_sequence_and_end_turn(plain):
    url, pipe = plain
    client = claude(url)
    free = client.messages.create(model=MODEL, max_tokens=12,
                                  messages=[{"role": "user", "content": "tell me about the cat"}],
                                  extra_body=GREEDY_EXTRA)
    word = free.content[0].text.split()[1]
    msg = client.messages.create(model=MODEL, max_tokens=12, stop_sequences=[word],
                                 messages=[{"role": "user", "content": "tell me about the cat"}],
                                 extra_body=GREEDY_EXTRA)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word


@pytest.mark.parametrize("stream", [False, True])
def test_a_breakpoint_is_cached_then_read_in_usage(llama_path, stream):
    with serving(llama_path) as (url, pipe):
        client = claude(url)

        def ask(question: str):
            kwargs = dict(model=MODEL, max_tokens=2, system=marked("5m"),
                          messages=[{"role": "user", "content": question}])
            if not stream:
                return client.messages.create(**kwargs).usage
            with client.messages.stream(**kwargs) as s:
                return s.get_final_message().usage

        first = ask("what is the river called?")
        assert first.cache_read_input_tokens == 0
        assert first.cache_creation_input_tokens >= 20 and first.cache_creation_input_tokens % B == 0
        second = ask("and the city?")   # same system prompt, another question
        assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
        assert second.cache_creation_input_tokens == 0
        # the breakpoint's blocks are held at the 5m priority
        assert by_priority(url)["60"] >= first.cache_creation_input_tokens // B
        # the same prefix through the openai client reports the reuse in its own field
        rendered = pipe.chat_prompt([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": "and the city?"}])
        res = oai(url).completions.create(model=MODEL, prompt=rendered, max_tokens=2)
        assert res.usage.prompt_tokens_details.cached_tokens >= first.cache_creation_input_tokens


def test_reading_a_breakpoint_changes_no_token(plain, make_pipeline):
    url, _ = plain
    alone = make_pipeline(seq_size_per_block=B)   # reuse off
    question = [{"role": "user", "content": "and what about the bridge?"}]
    expected = None
    for expected in alone(messages=[{"role": "system", "content": SYSTEM}] + question,
                          top_k=1, ignore_eos=True, max_new_tokens=8):
        pass
    client = claude(url)
    for _ in range(2):
        msg = client.messages.create(model=MODEL, max_tokens=8, system=marked("1h"),
                                     messages=question, extra_body=GREEDY_EXTRA)
        assert msg.content[0].text == expected.generate_texts[0]
    assert msg.usage.cache_read_input_tokens > 0


def flood(url: str, start: int, requests: int = 12) -> None:
    """Distinct unmarked prompts enough to turn the whole 64-block pool over."""
    for k in range(requests):
        prompt = [(start + 41 * k + 7 * i) % 1000 + 10 for i in range(40)]
        r = httpx.post(url + "/", json={"prompt": prompt,
                                        "generate_config": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text


def test_a_1h_breakpoint_survives_a_flood_that_evicts_an_unmarked_prefix(llama_path):
    with serving(llama_path, kv_cache_max_tokens=256) as (url, pipe):   # 64 blocks
        client = claude(url)
        other = "an unmarked system prompt about the mountain, the lake and the road north."

        def ask(system):
            return client.messages.create(
                model=MODEL, max_tokens=2, system=system,
                messages=[{"role": "user", "content": "go on"}]).usage

        # the two prompts share the chat template's opening, which the held prefix keeps
        shared = common_prefix(*(pipe.chat_prompt([{"role": "system", "content": text},
                                                   {"role": "user", "content": "go on"}])
                                 for text in (SYSTEM, other))) // B * B
        held = ask(marked("1h"))
        unmarked = ask(other)
        assert ask(other).cache_read_input_tokens > shared   # cached before the flood
        flood(url, 1)
        assert pipe.cache_stats()["evictions"] > 0
        assert ask(other).cache_read_input_tokens == shared
        assert ask(marked("1h")).cache_read_input_tokens >= held.cache_creation_input_tokens > 0
        assert unmarked.cache_creation_input_tokens == 0   # no breakpoint: nothing created


def test_a_5m_breakpoint_lapses_after_its_ttl(llama_path):
    with serving(llama_path, kv_cache_max_tokens=256) as (url, pipe):
        now = [1000.0]
        pipe.engine.cache.pool.clock = lambda: now[0]   # the test's clock
        client = claude(url)

        def ask():
            return client.messages.create(
                model=MODEL, max_tokens=2, system=marked("5m"),
                messages=[{"role": "user", "content": "go on"}]).usage

        created = ask().cache_creation_input_tokens
        flood(url, 1)
        assert ask().cache_read_input_tokens >= created > 0   # within its 5 minutes
        now[0] += 299
        flood(url, 2)
        assert ask().cache_read_input_tokens >= created        # still within them
        now[0] += 301
        flood(url, 3)
        assert ask().cache_read_input_tokens == 0              # lapsed to 35, then evicted


@pytest.mark.parametrize("body,where,words", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]},
     "messages[0].content[0].type", ["images"]),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
     "tools", ["tools", "no tool support"]),
    ({"messages": [{"role": "user", "content": marked() * 5}]}, "cache_control", ["at most 4"]),
    ({"messages": [{"role": "user", "content": marked("5m") + marked("1h")}]},
     "messages[0].content[1].cache_control", ["'1h'", "'5m'"]),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]},
     "messages[0].content[0].cache_control", ["ttl", "2h"]),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "I"}]},
     "messages[1]", ["prefill"]),
    ({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled",
                                                                    "budget_tokens": 1024}},
     "thinking", ["thinking"]),
    ({"messages": [{"role": "user", "content": "hi"}], "no_such_option": 1}, None,
     ["no_such_option"]),
])
def test_messages_errors_in_anthropics_shape_name_the_field(plain, body, where, words):
    url, _ = plain
    client = claude(url)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, **{k: v for k, v in body.items()
                                                            if k in ("messages", "tools",
                                                                     "thinking")},
                               extra_body={k: v for k, v in body.items()
                                           if k not in ("messages", "tools", "thinking")})
    raw = err.value.body
    assert raw["type"] == "error" and raw["error"]["type"] == "invalid_request_error"
    for word in words + ([where] if where else []):
        assert word in raw["error"]["message"], raw


def test_messages_unknown_model_and_route_errors(plain):
    url, _ = plain
    with pytest.raises(anthropic.NotFoundError) as err:
        claude(url).messages.create(model="claude-opus", max_tokens=4,
                                    messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "not_found_error"
    res = httpx.post(url + "/v1/messages", json={"model": MODEL, "messages": []})
    assert res.status_code == 400 and res.json()["type"] == "error"


# ---------------------------------------------------------------------- tenants
def test_two_tenants_by_header_share_nothing(keyed):
    url, _ = keyed
    prompt = ids(500, 32) + [3]
    acme, beta = oai(url, **{"x-tenant-id": "acme"}), oai(url, **{"x-tenant-id": "beta"})
    acme.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = acme.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    other = beta.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # a client that names the tenant as its own salt, without the header, is not the tenant
    posing = oai(url).completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                         extra_body={"cache_salt": "acme"})
    assert posing.usage.prompt_tokens_details.cached_tokens == 0
    # the same through the anthropic client: a breakpoint one tenant cached is not the other's
    ask = dict(model=MODEL, max_tokens=2, system=marked("1h"),
               messages=[{"role": "user", "content": "go on"}])
    first = claude(url, **{"x-tenant-id": "acme"}).messages.create(**ask).usage
    assert claude(url, **{"x-tenant-id": "acme"}).messages.create(**ask).usage \
        .cache_read_input_tokens >= first.cache_creation_input_tokens > 0
    assert claude(url, **{"x-tenant-id": "beta"}).messages.create(**ask).usage \
        .cache_read_input_tokens == 0
    res = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                     headers={"x-tenant-id": "acme corp"})
    assert res.status_code == 400 and "x-tenant-id" in res.json()["error"]["message"]


ADMIN = "admin-key-for-tests"


def test_a_quota_changed_at_run_time_takes_effect_on_the_next_eviction(llama_path):
    switches = CacheSwitches(tenant_header="x-tenant-id", admin_api_key=ADMIN)
    with serving(llama_path, switches, kv_cache_max_tokens=256,   # 64 blocks
                 cache_salt_quota_blocks=1000) as (url, pipe):
        admin = {"authorization": f"Bearer {ADMIN}"}

        def send(tenant: str, start: int, n: int) -> int:
            res = httpx.post(url + "/", headers={"x-tenant-id": tenant}, json={
                "prompt": [(start + 7 * i) % 1000 + 10 for i in range(n)],
                "generate_config": {"max_new_tokens": 1}}, timeout=60)
            assert res.status_code == 200, res.text
            return res.json()["aux_info"]["reuse_len"]

        def tenant(name: str) -> dict:
            res = httpx.get(url + f"/cache/tenants/{name}", headers=admin)
            assert res.status_code == 200, res.text
            return res.json()

        send("beta", 1, 32)          # 8 blocks, the oldest: plain LRU would evict them first
        send("acme", 2, 80)          # 20 blocks
        before = tenant("beta")["cached_blocks"]
        assert tenant("acme")["cached_blocks"] >= 20 and tenant("acme")["quota_blocks"] == 1000
        assert httpx.get(url + "/cache/tenants/acme").status_code == 401
        changed = httpx.put(url + "/cache/tenants/acme", json={"quota_blocks": 2}, headers=admin)
        assert changed.status_code == 200, changed.text
        now = changed.json()
        assert now["quota_blocks"] == 2 and now["over_quota"] and now["quota_evictions"] == 0
        k = 3
        while pipe.cache_stats()["evictions"] == 0:    # the next evictions
            send("gamma", k, 40)
            k += 1
        after = tenant("acme")
        assert after["quota_evictions"] > 0 and after["cached_blocks"] < now["cached_blocks"]
        assert tenant("beta")["cached_blocks"] == before       # the LRU victim was spared
        assert send("beta", 1, 32) == 28                         # and still serves its prefix
        back = httpx.put(url + "/cache/tenants/acme", json={"quota_blocks": None}, headers=admin)
        assert back.json()["quota_blocks"] == 1000
        for bad in ({"quota_blocks": -1}, {"quota_blocks": "2"}, {"quota": 2}):
            res = httpx.put(url + "/cache/tenants/acme", json=bad, headers=admin)
            assert res.status_code == 400 and "quota_blocks" in res.json()["message"]


def test_quotas_off_at_start_cannot_be_changed(plain):
    url, _ = plain
    res = httpx.put(url + "/cache/tenants/acme", json={"quota_blocks": 2})
    assert res.status_code == 400 and "CACHE_SALT_QUOTA_BLOCKS" in res.json()["message"]
    assert httpx.get(url + "/cache/tenants/acme").json()["quota_blocks"] is None


def test_tenant_metrics_have_a_bounded_label_set(keyed, monkeypatch):
    from rtpkv.server import metrics

    url, _ = keyed
    monkeypatch.setattr(metrics, "MAX_TENANT_LABELS", 2)
    for k, name in enumerate(("t1", "t2", "t3", "t4")):
        httpx.post(url + "/", headers={"x-tenant-id": name},
                   json={"prompt": ids(600 + 40 * k, 40 * (k + 1)),
                         "generate_config": {"max_new_tokens": 1}}, timeout=60)
    text = httpx.get(url + "/metrics").text
    labels = [line.split('"')[1] for line in text.splitlines()
              if line.startswith("rtpkv_cache_tenant_blocks{")]
    assert len(labels) == 3 and labels[-1] == "other" and "t4" not in text
    from rtpkv.cache.tenants import tenant_label
    assert tenant_label(b"t4") in labels   # the tenant holding the most blocks, by its digest


def test_the_switches_come_from_the_environment(monkeypatch):
    from rtpkv.config import Settings
    from rtpkv.errors import ConfigError

    assert CacheSwitches.from_settings(Settings.from_env()) == CacheSwitches()
    monkeypatch.setenv("PROMPT_CACHE_KEY_SALT", "1")
    monkeypatch.setenv("TENANT_HEADER", "x-org")
    monkeypatch.setenv("ADMIN_API_KEY", "s3cret-admin")
    off = CacheSwitches.from_settings(Settings.from_env())
    assert off == CacheSwitches(True, None, "s3cret-admin")   # the header needs its switch
    monkeypatch.setenv("TENANT_HEADER_SALT", "on")
    assert CacheSwitches.from_settings(Settings.from_env()).tenant_header == "x-org"
    monkeypatch.setenv("TENANT_HEADER", "x org")
    with pytest.raises(ConfigError, match="TENANT_HEADER='x org' is invalid"):
        Settings.from_env()
    monkeypatch.setenv("TENANT_HEADER", "x-org")
    monkeypatch.setenv("ADMIN_API_KEY", "short")
    with pytest.raises(ConfigError, match=r"ADMIN_API_KEY='\*\*\*' is invalid") as err:
        Settings.from_env()
    assert "short" not in str(err.value)
