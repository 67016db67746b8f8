"""What used to mislead a newcomer training a head: a warm-up longer than the run, a resume that
silently re-plans, a --draft-vocab larger than the vocabulary, --max-conversations counting records,
and --head given the run folder."""
from __future__ import annotations

import json

import pytest
import torch

from eaglespec.cli import main
from eaglespec.data import load_conversations
from eaglespec.head import load_head, random_head
from eaglespec.loading import load_target
from eaglespec.testing import make_tiny_checkpoint

from test_train import read_jsonl, write_chats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl", n=24)


def run(tiny, chats, out, *extra) -> int:
    return main([str(a) for a in ["train", "--model", tiny, "--data", chats, "--out", out, "--batch-tokens", 384,
                                  "--lr", 2e-3, "--seed", 1, "--eval-conversations", 2, *extra]])


def last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("eaglespec: error:") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_a_short_run_scales_the_default_warmup_and_reaches_the_peak(tiny, chats, tmp_path, capsys):
    assert run(tiny, chats, tmp_path / "short", "--max-steps", 6) == 0
    out = capsys.readouterr().out
    assert "too few for the default 100 warm-up steps" in out
    lrs = [r["lr"] for r in read_jsonl(tmp_path / "short" / "train_log.jsonl")]
    assert len(lrs) == 6 and max(lrs) == pytest.approx(2e-3)
    assert "warm-up 1 steps" in (tmp_path / "short" / "card.md").read_text()
    # an explicit warm-up is kept, with a warning
    assert run(tiny, chats, tmp_path / "explicit", "--max-steps", 6, "--warmup-steps", 100) == 0
    assert "never reaches --lr" in capsys.readouterr().out
    assert max(r["lr"] for r in read_jsonl(tmp_path / "explicit" / "train_log.jsonl")) < 2e-4


def test_resuming_with_another_plan_needs_replan(tiny, chats, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(tiny, chats, out, "--max-steps", 3, "--warmup-steps", 1) == 0
    before = (out / "head" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert run(tiny, chats, out, "--max-steps", 6, "--warmup-steps", 1, "--resume") == 2
    msg = last_error(capsys)
    assert "--replan" in msg and "total_steps 3 -> 6" in msg
    assert (out / "head" / "model.safetensors").read_bytes() == before  # untouched
    assert run(tiny, chats, out, "--max-steps", 3, "--warmup-steps", 1, "--resume") == 0  # same plan: fine
    assert run(tiny, chats, out, "--max-steps", 6, "--warmup-steps", 1, "--resume", "--replan") == 0
    assert [r["step"] for r in read_jsonl(out / "train_log.jsonl")] == list(range(1, 7))


def test_a_draft_vocabulary_larger_than_the_vocabulary_is_refused(tiny, chats, tmp_path, capsys):
    assert run(tiny, chats, tmp_path / "dv", "--draft-vocab", 400) == 2
    msg = last_error(capsys)
    assert "--draft-vocab 400" in msg and "320" in msg
    assert not (tmp_path / "dv").exists()


def test_max_conversations_counts_conversations_not_records(tmp_path):
    path = tmp_path / "split.jsonl"
    turn = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    recs = [{"id": "a_0", "conversations": turn}, {"id": "a_1", "conversations": turn},
            {"id": "b_0", "conversations": turn}, {"id": "c_0", "conversations": turn}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs, report = load_conversations(str(path), max_conversations=2)
    assert [c.key for c in convs] == ["a", "a", "b"]
    assert report.summary(len(convs), 2).startswith("data: 2 conversations (3 records)")
    # skip counts conversations too: the later part of a grown corpus, the records of a chat kept together
    later, _ = load_conversations(str(path), max_conversations=3, skip=1)
    assert [c.key for c in later] == ["b", "c"] and [c.index for c in later] == [2, 3]
    with pytest.raises(ValueError, match="--skip-conversations 3 leaves none"):
        load_conversations(str(path), skip=3)


def test_head_given_the_run_folder_suggests_its_head(tiny, tmp_path, capsys):
    model, _ = load_target(str(tiny), device="cpu")
    random_head(model.args).save(tmp_path / "run" / "head")
    with pytest.raises(ValueError, match=str(tmp_path / "run" / "head")):
        load_head(tmp_path / "run", model.args)
    assert main(["generate", "--model", str(tiny), "--head", str(tmp_path / "run"), "--device", "cpu", "hi"]) == 2
    assert f"--head {tmp_path / 'run' / 'head'}" in last_error(capsys)
    assert isinstance(load_head(tmp_path / "run" / "head", model.args).fc.weight, torch.Tensor)
