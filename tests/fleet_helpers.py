"""What the fleet tests share: free loopback ports, prompt texts, a greedy completion through a
router, and which replica served it (its prefix-cache query counter grew)."""

from __future__ import annotations

import random
import socket
from typing import Any, Optional

import httpx

from rtpkv.fleet.launcher import Fleet

B = 16
EVENT_DELAY_S = 1.5   # a replica's events reach the router within milliseconds; this is slack
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def free_base(span: int) -> int:
    """A port p with p .. p+span-1 all free on loopback."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - span)
        socks = []
        try:
            for port in range(base, base + span):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free run of ports")


def text(seed: int, words: int = 80) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def complete(url: str, prompt: str, headers: Optional[dict[str, str]] = None,
             **extra: Any) -> dict[str, Any]:
    """A greedy completion. vllm-router's kv_aware credits cache only to requests without
    fields it does not know, so extras (enable_remote_cache, nvext, ...) are for other tests."""
    body = {"model": "qwen2", "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    res = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert res.status_code == 200, res.text
    return res.json()


def cached(res: dict[str, Any]) -> int:
    return res["usage"]["prompt_tokens_details"]["cached_tokens"]


def queries(fleet: Fleet) -> list[int]:
    """Prompt tokens each replica has looked up (its rtpkv routes): which one served."""
    return [httpx.get(r.url + "/cache_status", timeout=10).json()["queries"]
            for r in fleet.replicas]


def served_by(fleet: Fleet, url: str, prompt: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    """The index of the one replica that served `prompt` sent to `url`, and the answer."""
    before = queries(fleet)
    res = complete(url, prompt, **kw)
    after = queries(fleet)
    grew = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
    assert len(grew) == 1, (before, after)
    return grew[0], res
