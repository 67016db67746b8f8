"""Data-parallel training: `torchrun --nproc_per_node 2` (gloo, 2 CPU processes) on a tiny model.

Both ranks must end with identical weights, and the run must match one process with --grad-accum 2:
step s of the 2-process run uses micro-batches 2s (rank 0) and 2s+1 (rank 1), each with the noise
seeded by its global micro-batch number, and DDP averages the two gradients -- exactly what one
process accumulating micro-batches 2s and 2s+1 with loss / 2 computes (up to float summation order).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from eaglespec.cli import main
from eaglespec.testing import make_tiny_checkpoint

from test_train import write_chats


def ddp_matches_grad_accum(tmp_path, extra: list[str], steps: int) -> str:
    """Train `steps` steps with torchrun (gloo, 2 CPU processes) and with one process and --grad-accum 2:
    both ranks end bit-identical and the two runs match. The torchrun run's card, for more checks."""
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    chats = write_chats(tmp_path / "chats.jsonl", n=40)
    common = ["--model", str(tiny), "--data", str(chats), "--batch-tokens", "256", "--lr", "2e-3", "--warmup-steps", "1",
              "--max-steps", str(steps), "--seed", "2", "--device", "cpu", "--eval-conversations", "2", *extra]
    env = {**os.environ, "EAGLESPEC_TEST_CHECKSUM_DIR": str(tmp_path / "ddp_sums"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "eaglespec.cli", "train", *common, "--out", str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    r0, r1 = (json.loads((tmp_path / "ddp_sums" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["step"] == r1["step"] == steps
    assert r0["sha256"] == r1["sha256"]  # bit-identical weights on both ranks

    os.environ["EAGLESPEC_TEST_CHECKSUM_DIR"] = str(tmp_path / "single_sums")
    try:
        assert main(["train", *common, "--grad-accum", "2", "--out", str(tmp_path / "single")]) == 0
    finally:
        del os.environ["EAGLESPEC_TEST_CHECKSUM_DIR"]
    ddp_log = [json.loads(x) for x in (tmp_path / "ddp" / "train_log.jsonl").read_text().splitlines()]
    one_log = [json.loads(x) for x in (tmp_path / "single" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ddp_log] == [r["step"] for r in one_log] == list(range(1, steps + 1))
    for a, b in zip(ddp_log, one_log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["tokens"] == b["tokens"]
    a = load_file(str(tmp_path / "ddp" / "head" / "model.safetensors"))
    b = load_file(str(tmp_path / "single" / "head" / "model.safetensors"))
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-5) for k in a)
    return (tmp_path / "ddp" / "card.md").read_text()


def test_two_process_ddp_matches_one_process_with_grad_accum(tmp_path):
    card = ddp_matches_grad_accum(tmp_path, [], steps=4)
    assert "torchrun --nproc_per_node 2" in card and "2 process(es)" in card


def test_unrolled_eagle1_ddp_matches_one_process_with_grad_accum(tmp_path):
    """--ttt-steps 3 on an EAGLE-1 head goes through the DDP wrapper's forward (EagleHead.forward(ttt_steps=))."""
    ddp_matches_grad_accum(tmp_path, ["--ttt-steps", "3"], steps=2)


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """A signal that reaches rank 1 alone (rank 0 never sees one) still stops both ranks after the same step,
    rank 0 checkpoints it, and a resume under torchrun finishes with both ranks bit-identical."""
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    chats = write_chats(tmp_path / "chats.jsonl", n=40)
    args = ["--model", str(tiny), "--data", str(chats), "--batch-tokens", "256", "--lr", "2e-3", "--warmup-steps", "1",
            "--max-steps", "6", "--save-every", "10", "--seed", "2", "--device", "cpu", "--eval-conversations", "2",
            "--out", str(tmp_path / "ddp")]
    env = {**os.environ, "EAGLESPEC_TEST_CHECKSUM_DIR": str(tmp_path / "sums"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "eaglespec.cli", "train", *args]
    proc = subprocess.run([*cmd, "--signal-after", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "interrupted (SIGINT) after step 3" in proc.stdout, proc.stderr[-3000:]
    state = torch.load(tmp_path / "ddp" / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 3
    proc = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / "sums" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["step"] == r1["step"] == 6 and r0["sha256"] == r1["sha256"]
    log = [json.loads(x) for x in (tmp_path / "ddp" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 7))
