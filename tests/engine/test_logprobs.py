"""logprobs=k: every generated token's log-probability and its k most likely alternatives,
equal to transformers' log-softmax of the same weights' logits; over HTTP in OpenAI's shapes."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from conftest import hf_reference, load
from rtpkv.pipeline import Pipeline
from rtpkv.server import create_app
from server_helpers import ServerThread, sse_data

PROMPT = [1, 17, 245, 33, 901, 12, 77, 5, 310, 64]
N = 6


def test_logprobs_match_transformers(make_pipeline, hf):
    pipe = make_pipeline()
    tokens, logits = hf_reference(hf, PROMPT, N)
    last = list(pipe(PROMPT, top_k=1, max_new_tokens=N, ignore_eos=True, logprobs=3))[-1]
    assert last.output_ids == tokens and last.logits is None
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert [t.token_id for t in last.logprobs] == tokens
    for i, entry in enumerate(last.logprobs):
        assert entry.logprob == pytest.approx(float(reference[i, tokens[i]]), abs=1e-4)
        top = torch.topk(reference[i], 3)
        assert [t for t, _ in entry.top] == top.indices.tolist()   # greedy: the best is chosen
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    plain = list(pipe(PROMPT, top_k=1, max_new_tokens=N, ignore_eos=True))[-1]
    assert plain.logprobs is None


@pytest.fixture(scope="module")
def server(llama_path):
    model = load(llama_path, kv_cache_max_tokens=4096)
    pipe = Pipeline(model, model.tokenizer)
    with ServerThread(create_app(pipe, "tiny")) as srv:
        yield srv, pipe


def test_completions_logprobs(server):
    srv, _ = server
    res = httpx.post(srv.url + "/v1/completions", json={
        "prompt": "hello there", "max_tokens": N, "ignore_eos": True, "logprobs": 2,
        "temperature": 0}, timeout=60).json()
    lp = res["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == N
    assert all(x <= 0 for x in lp["token_logprobs"])
    # greedy: the chosen token is the most likely (alternatives that decode to the same text
    # share one key of OpenAI's dict, so a key may hold a lesser one)
    assert all(1 <= len(top) <= 2 and max(top.values()) <= chosen + 1e-5
               for top, chosen in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0 and all(isinstance(t, str) for t in lp["tokens"])
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_chat_logprobs_plain_and_streamed(server):
    srv, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": N,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "temperature": 0}
    res = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    content = res["choices"][0]["logprobs"]["content"]
    assert len(content) == N
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode())
               for c in content)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as stream:
        chunks = [json.loads(d) for d in sse_data(stream.iter_lines()) if d != "[DONE]"]
    streamed = [c for chunk in chunks for choice in chunk["choices"]
                if choice.get("logprobs") for c in choice["logprobs"]["content"]]
    assert [c["logprob"] for c in streamed] == [c["logprob"] for c in content]


def test_top_logprobs_without_logprobs_is_refused(server):
    srv, _ = server
    res = httpx.post(srv.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, timeout=60)
    assert res.status_code == 400 and res.json()["error"]["param"] == "top_logprobs"
