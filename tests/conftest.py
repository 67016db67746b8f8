"""Shared fixtures: tiny random checkpoints, and a target/head pair whose drafts are usually right."""
from __future__ import annotations

import pytest
import torch

from eaglespec.head import EagleHead, random_head
from eaglespec.model import ModelArgs, Transformer
from eaglespec.testing import make_tiny_checkpoint

# Test models are tiny, so every op is overhead; on a shared 2-core machine a second OpenMP thread
# only spins against the other processes (measured 20-50x slower decoding with 2 threads).
torch.set_num_threads(1)


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


def oracle_pair(vocab_size: int = 320, seed: int = 0, noise: float = 0.0, logit_scale: float = 1.0,
                **arg_overrides) -> tuple[Transformer, EagleHead]:
    """A one-layer target and a head that copies its layer, so the head's drafts are usually right.

    Embedding rows have unit RMS, so the target's input norm is the identity and the head (which has
    no input norm, and reads only the token embedding through fc = [I | 0]) computes the target's
    pre-norm hidden state; the final norm's weight is 1, so both rank tokens alike. What still
    differs: the head never sees the first prompt token, and `noise` perturbs its weights, so drafts
    get rejected now and then and accepted paths vary. `logit_scale` makes the target peakier.
    """
    args = ModelArgs(**{**dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512),
                        **arg_overrides})
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = Transformer(args)
        emb = model.embed_tokens.weight
        emb /= emb.pow(2).mean(-1, keepdim=True).sqrt()
        model.lm_head.weight *= logit_scale
        head = random_head(args, seed=seed)
        h = args.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
        head.fc.bias.zero_()
        for name in ("self_attn", "post_attention_layernorm", "mlp"):
            getattr(head.layers[0], name).load_state_dict(getattr(model.layers[0], name).state_dict())
        for p in head.parameters():
            p += noise * p.std() * torch.randn_like(p)
    return model.eval().requires_grad_(False), head.eval().requires_grad_(False)


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
