"""The `rtpkv` command as a new user meets it: --version, -v anywhere, --generate-config checked
before the weights load, greedy and one-line output from `generate`, Ctrl-C, and the demo."""

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import run
from rtpkv import __version__
from rtpkv.cli import build_parser, generate_config_option, main
from rtpkv.model_factory.tiny import DEMO_CHECKPOINT

PROMPT = "hello, what's your name"


def _exit_code(argv) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


def test_version(capsys):
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out == f"rtpkv {__version__}\n"
    out = subprocess.run([sys.executable, "-m", "rtpkv", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out == f"rtpkv {__version__}\n"


@pytest.mark.parametrize("argv,verbose", [
    (["generate", "x"], False), (["-v", "generate", "x"], True), (["generate", "x", "-v"], True),
    (["demo", "--verbose"], True)])
def test_verbose_before_or_after_the_subcommand(argv, verbose):
    assert getattr(build_parser().parse_args(argv), "verbose", False) is verbose


@pytest.mark.parametrize("config,message", [
    ("{bad", "--generate-config is not valid JSON: "),
    ("[1, 2]", "--generate-config must be a JSON object of generate_config keys, got a JSON list"),
    ('{"num_beams": 4}', "num_beams: 4 is not supported; num_beams: 1 is"),
    ('{"top_kk": 4}', "unknown generate_config key(s) ['top_kk']"),
])
def test_generate_config_is_checked_before_the_weights_load(tmp_path, capsys, config, message):
    argv = ["generate", PROMPT, "--model", str(tmp_path / "missing"), "--generate-config", config]
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rtpkv: error: ") and message in err and "Traceback" not in err
    # a good config gets as far as the model, which does not exist
    assert _exit_code(argv[:-1] + ['{"top_k": 1}']) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_is_greedy_unless_sampling_keys_are_given():
    assert generate_config_option(None, 5) == {"max_new_tokens": 5, "do_sample": False}
    assert "do_sample" not in generate_config_option('{"temperature": 0.7}', 5)


def _generated_text(capsys, argv) -> str:
    main(argv)
    out = capsys.readouterr().out
    assert "aux_info:" in out and re.search(r"cost_time +[\d.]+ ms", out)
    return out.split("\naux_info:")[0]


def test_generate_output(make_pipeline, llama_path, capsys):
    argv = ["generate", PROMPT, "--model", str(llama_path), "--max-new-tokens", "24"]
    text = _generated_text(capsys, argv)
    assert _generated_text(capsys, argv) == text, "greedy: the same text twice"
    expected = run(make_pipeline(), PROMPT, max_new_tokens=24, ignore_eos=False).batch_response[0]
    assert text == expected
    incremental = _generated_text(capsys, argv + ["--generate-config", '{"return_incremental": true}'])
    assert incremental == text and "\n" not in incremental


def test_ctrl_c_exits_130_with_one_line(llama_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "rtpkv", "generate", PROMPT, "--model", str(llama_path),
         "--max-new-tokens", "1000", "--generate-config", '{"ignore_eos": true}'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.read(1), "no streamed text"
        # at once: on a host with the fused decoder the 1,000 tokens take a fraction of a
        # second, and a SIGINT after the last one lands in the interpreter's shutdown
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and err.endswith("\nrtpkv: interrupted\n")


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("rtpkv-cache")


def test_demo(demo_cache, monkeypatch, capsys):
    monkeypatch.setenv("RTPKV_CACHE_DIR", str(demo_cache))
    main(["demo", "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert "random weights, so its text is meaningless by design" in out
    assert re.search(r"reuse_len +8 tokens = 2 blocks of 4 of 14 prompt tokens", out)
    assert re.search(r"first_token_cost_time +[\d.]+ ms", out)
    assert re.search(r"hit_rate +[\d.]+ %", out) and re.search(r"queries +22 prompt tokens", out)
    (checkpoint,) = demo_cache.glob("demo-*")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    assert vocab == len(AutoTokenizer.from_pretrained(str(checkpoint))) == DEMO_CHECKPOINT["vocab_size"]


def test_generate_chat_goes_through_the_chat_template(make_pipeline, llama_path, capsys):
    argv = ["generate", PROMPT, "--model", str(llama_path), "--max-new-tokens", "12", "--chat"]
    text = _generated_text(capsys, argv)
    pipe = make_pipeline()
    deltas = [res.batch_response[0] for res in pipe(
        messages=[{"role": "user", "content": PROMPT}], top_k=1, max_new_tokens=12,
        return_incremental=True)]
    assert text == "".join(deltas)
    plain = [res.batch_response[0] for res in pipe(PROMPT, top_k=1, max_new_tokens=12,
                                                   return_incremental=True)]
    assert text != "".join(plain)


@pytest.mark.parametrize("example", ["reuse_cache.py", "multi_task_prompt.py",
                                     "kv_cache_connector.py"])
def test_examples_answer_help_instead_of_loading_it_as_a_model(example):
    script = Path(__file__).resolve().parents[2] / "examples" / example
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "MODEL_DIR" in done.stdout
