"""The hashing scheme: stable across processes, distinct across models, block sizes and salts."""

import os
import subprocess
import sys

from conftest import load
from rtpkv.cache import PrefixIndex


def _key(fingerprint: str, block: int, tokens, salt: bytes = b"") -> bytes:
    index = PrefixIndex(fingerprint, block)
    return index.key(index.root, tokens, salt)


def test_keys_are_equal_in_another_process():
    code = ("from rtpkv.cache import PrefixIndex; i = PrefixIndex('fp', 4); "
            "print(i.key(i.root, [1, 2, 3, 4], b'salt').hex())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == _key("fp", 4, [1, 2, 3, 4], b"salt").hex()


def test_keys_differ_by_model_block_size_salt_and_parent():
    base = _key("fp", 4, [1, 2, 3, 4])
    assert base != _key("other", 4, [1, 2, 3, 4])
    assert base != _key("fp", 8, [1, 2, 3, 4])
    assert base != _key("fp", 4, [1, 2, 3, 4], b"tenant")
    index = PrefixIndex("fp", 4)
    assert index.key(base, [1, 2, 3, 4]) != base
    # length-prefixed extra: salt bytes can never be confused with token bytes
    assert index.key(index.root, [1, 2], b"\x03\x00\x00\x00") != index.key(index.root, [3, 1, 2])


def test_model_fingerprint_covers_weights_and_dtype(checkpoints, llama_path):
    a = load(llama_path)
    assert load(llama_path).fingerprint == a.fingerprint
    assert load(llama_path, dtype="bfloat16").fingerprint != a.fingerprint
    assert load(checkpoints("llama_linear_rope")).fingerprint != a.fingerprint
