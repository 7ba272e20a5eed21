"""Clients' own prompt-cache words over real HTTP, with the unmodified `openai` and `anthropic`
clients: OpenAI's prompt_cache_retention and prompt_cache_key, Anthropic's Messages API with
cache_control breakpoints, tenants from a header and their quotas changed at run time."""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from conftest import load
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
