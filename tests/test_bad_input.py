"""Bad input ends in one line, never a traceback: the CLI exits non-zero with `eaglespec: error: <msg>`
on stderr, and the Python API raises ValueError with that same message."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eaglespec.cli import main
from eaglespec.engine import Engine
from eaglespec.head import random_head
from eaglespec.loading import load_target
from safetensors.torch import load_file, save_file

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def folders(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                  "vocab_size": 320, "n_embd": 64, "n_layer": 2, "n_head": 4}))
    heads = {}
    for name, overrides in (("narrow", {"hidden_size": 32}), ("big-vocab", {"vocab_size": 400})):
        other, _ = load_target(tiny_checkpoint("llama", **overrides), device="cpu")
        random_head(other.args).save(root / name)
        heads[name] = root / name
    # a reduced-vocabulary head whose d2t points past the target's vocabulary
    model, _ = load_target(tiny_checkpoint("llama"), device="cpu")
    random_head(model.args, draft_vocab=[1, 2, 3]).save(root / "bad-d2t")
    sd = load_file(str(root / "bad-d2t" / "model.safetensors"))
    sd["d2t"][-1] = 10_000
    save_file(sd, str(root / "bad-d2t" / "model.safetensors"))
    heads["bad-d2t"] = root / "bad-d2t"
    return {"model": tiny_checkpoint("llama"), "gpt2": gpt2, "missing": root / "no-such-model", **heads}


def cli_error(capsys, *argv) -> str:
    """Run the CLI in process; return its one stderr line after checking exit code and shape."""
    code = main(list(map(str, argv)))
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert err.startswith("eaglespec: error: "), err
    return err.removeprefix("eaglespec: error: ").rstrip("\n")


def api_error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def tiny_engine(folders, **kw):
    return Engine.load(str(folders["model"]), head="random", device="cpu", **kw)


def test_missing_model(capsys, folders):
    msg = cli_error(capsys, "generate", "--model", folders["missing"], "--device", "cpu", "hi")
    assert str(folders["missing"]) in msg
    assert msg == api_error(lambda: Engine.load(str(folders["missing"]), device="cpu"))


def test_unsupported_architecture(capsys, folders):
    msg = cli_error(capsys, "generate", "--model", folders["gpt2"], "--device", "cpu", "hi")
    assert "GPT2LMHeadModel" in msg and "llama" in msg  # names what it got and what it supports
    assert msg == api_error(lambda: Engine.load(str(folders["gpt2"]), device="cpu"))


@pytest.mark.parametrize("head,key", [("narrow", "hidden_size"), ("big-vocab", "vocab_size"),
                                      ("bad-d2t", "draft vocabulary")])
def test_head_that_does_not_fit_the_target(head, key, capsys, folders):
    msg = cli_error(capsys, "generate", "--model", folders["model"], "--head", folders[head], "--device", "cpu", "hi")
    assert key in msg
    assert msg == api_error(lambda: Engine.load(str(folders["model"]), head=str(folders[head]), device="cpu"))


def test_prompt_longer_than_the_context(capsys, folders):
    msg = cli_error(capsys, "generate", "--model", folders["model"], "--head", "random", "--device", "cpu",
                    "--max-context", 16, "--raw", LONG_PROMPT)
    assert "16" in msg
    assert msg == api_error(lambda: tiny_engine(folders, max_context=16).generate(LONG_PROMPT))


@pytest.mark.parametrize("flag,value,kwarg", [("--temperature", -0.5, "temperature"), ("--top-p", 0, "top_p"),
                                              ("--top-p", 1.5, "top_p")])
def test_bad_sampling_parameters(flag, value, kwarg, capsys, folders):
    msg = cli_error(capsys, "generate", "--model", folders["model"], "--head", "random", "--device", "cpu",
                    "--raw", flag, value, "hi")
    assert kwarg in msg
    assert msg == api_error(lambda: tiny_engine(folders).generate("hi", **{kwarg: value}))


@pytest.mark.parametrize("command,flag,value,kwarg", [
    ("generate", "--max-new-tokens", 0, "max_new_tokens"), ("generate", "--temperature", -1, "temperature"),
    ("generate", "--seed", -1, "seed"), ("chat", "--top-k", -2, "top_k"), ("chat", "--top-p", 2, "top_p")])
def test_bad_arguments_fail_before_the_model_loads(command, flag, value, kwarg, capsys, folders):
    """A missing model would be the error if loading came first: the argument's error must win (and take
    a second, not the tens of seconds a real model takes to load)."""
    argv = [command, "--model", folders["missing"], "--device", "cpu", flag, value] + (["hi"] if command == "generate" else [])
    assert kwarg in cli_error(capsys, *argv)


@pytest.mark.parametrize("kw", [
    dict(prompt="hi", max_new_tokens=0), dict(prompt="hi", method="beam"), dict(prompt="hi", top_k=-1),
    dict(prompt=""), dict(prompt="hi", input_ids=[1]), dict(input_ids=[320]), dict(input_ids=[]),
    dict(messages=[{"role": "user"}]), dict(prompt="hi", stop=""),
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_api_rejects_bad_requests(kw, folders):
    engine = tiny_engine(folders)
    for method in ("eagle", "vanilla"):
        api_error(lambda: engine.generate(**{"method": method, **kw}))


def test_installed_command_exits_cleanly(folders):
    """The real entry point, in a fresh process: exit code 2, one line on stderr."""
    exe = Path(sys.executable).with_name("eaglespec")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "eaglespec.cli"]
    proc = subprocess.run(cmd + ["generate", "--model", str(folders["missing"]), "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("eaglespec: error: model path not found")


def test_compare_needs_at_least_one_pair(capsys, folders):
    msg = cli_error(capsys, "generate", "--model", folders["model"], "--head", "random", "--device", "cpu",
                    "--eager", "--compare", "--repeats", 0, "hi")
    assert "--repeats" in msg


def test_compare_reports_the_median_of_interleaved_pairs(capsys, folders):
    """`generate --compare` (the demo) times `--repeats` pairs, alternating which method goes first, and
    reports the median speed-up of them; greedy outputs are identical."""
    import json
    code = main(["generate", "--model", str(folders["model"]), "--head", "random", "--device", "cpu", "--eager",
                 "--compare", "--repeats", "3", "--json", "--max-new-tokens", "12", "--raw", "hello"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["identical"] and len(out["pairs"]) == 3
    ratios = sorted(p["eagle"] / p["vanilla"] for p in out["pairs"])
    assert out["speedup"] == pytest.approx(ratios[1])
