"""The hashing scheme: stable across processes, distinct across models, block sizes and salts."""

import os
import subprocess
import sys
import time

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


def test_a_weight_file_rewritten_in_place_with_its_mtime_restored_is_hashed_again(
        tmp_path, monkeypatch):
    """Size, mtime, inode and device kept (a rewrite in place, then os.utime back): the
    change time, which no user call can set, still tells the digest cache the file changed."""
    from rtpkv.model_factory.weights import file_sha256

    monkeypatch.setenv("RTPKV_CACHE_DIR", str(tmp_path / "cache"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x01" * 4096)
    before = os.stat(weights)
    first = file_sha256(weights)
    with open(weights, "r+b") as f:          # same inode, same size: 41 bytes negated
        f.seek(100)
        f.write(b"\xfe" * 41)
    for _ in range(200):                     # utime sets the change time to now: past the
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))   # clock's next tick
        after = os.stat(weights)
        if after.st_ctime_ns != before.st_ctime_ns:
            break
        time.sleep(0.005)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == \
        (before.st_size, before.st_mtime_ns, before.st_ino)
    assert file_sha256(weights) != first
