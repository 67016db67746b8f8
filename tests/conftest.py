"""Shared fixtures: tiny random checkpoints, and a target/head pair whose drafts are usually right."""
from __future__ import annotations

import os

import pytest
import torch

from eaglespec.model import Transformer
from eaglespec.testing import make_tiny_checkpoint, oracle_pair

# Test models are tiny, so every op is overhead; on a shared 2-core machine a second OpenMP thread
# only spins against the other processes (measured 20-50x slower decoding with 2 threads).
torch.set_num_threads(1)

# The CLI compiles by default (the fast path); on tiny test models a compile only costs time, so CLI
# tests run eager unless they pass --compile. tests/test_compiled.py and test_cli_defaults cover compiling.
os.environ.setdefault("EAGLESPEC_EAGER", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family, **hf_overrides) -> HF folder, built once per session."""
    made = {}

    def get(family: str = "llama", **overrides):
        key = (family, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family, **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def make_oracle_pair():
    return oracle_pair


def first_divergence(model: Transformer, prompt: list[int], got: list[int], want: list[int]) -> str | None:
    """None if `got` == `want`; otherwise check that the first differing step is a genuine tie of the
    target (top-2 logits within 1e-4 by a plain full forward of prompt + common prefix, both tokens
    among the tied) and describe it, else fail."""
    if got == want:
        return None
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert i is not None, f"same tokens but different lengths: {len(got)} vs {len(want)}"
    seq = torch.tensor([prompt + want[:i]])
    with torch.inference_mode():
        _, logits = model(seq, torch.arange(seq.shape[1])[None])
    row = logits[0, -1].float()
    top2 = row.topk(2).values
    gap = float(top2[0] - top2[1])
    both_top = float(row.max() - row[got[i]]) < 1e-4 and float(row.max() - row[want[i]]) < 1e-4
    assert gap < 1e-4 and both_top, (f"outputs diverge at new token {i} ({got[i]} vs {want[i]}) where the target's "
                                     f"top-2 logits differ by {gap:.3g}: not a tie, a real mismatch")
    return f"tie at step {i} (gap {gap:.2g})"


@pytest.fixture(scope="session")
def same_or_tie():
    return first_divergence
