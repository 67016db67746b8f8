"""`eaglespec train` / `eaglespec features` on tiny models: the objective's maths, the unrolled
evaluation against real drafting, learning, checkpoints, resume, precomputed features, bad input."""
from __future__ import annotations

import contextlib
import json
import random
import signal

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eaglespec.cli import main
from eaglespec.head import load_head, random_head
from eaglespec.loading import load_target, load_tokenizer
from eaglespec.testing import make_tiny_checkpoint
from eaglespec.train import SoftCrossEntropy, batch_loss, shift_inputs
from eaglespec.features import FeatureStore

WORDS = ("the quick brown fox jumps over a lazy dog while speculative decoding drafts tokens cheaply and the "
         "target model verifies them").split()


def write_chats(path, n=48, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            u = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30)))
            if i % 2:
                rec = {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}
            else:
                rec = {"id": f"chat{i}_0", "conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": a},
                                                            {"from": "human", "value": "and then?"},
                                                            {"from": "gpt", "value": a[::-1]}]}
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


@pytest.fixture(scope="module")
def target(tiny):
    model, _ = load_target(str(tiny), device="cpu")
    return model


def cli(*argv) -> int:
    return main([str(a) for a in argv])


def common(tiny, chats, out, *extra):
    return ["train", "--model", tiny, "--data", chats, "--out", out, "--batch-tokens", 384, "--lr", 2e-3,
            "--warmup-steps", 2, "--seed", 1, *extra]


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ---- maths -------------------------------------------------------------------------------------------

def test_soft_cross_entropy_matches_autograd(monkeypatch):
    import eaglespec.train as tr
    monkeypatch.setattr(tr, "CE_CHUNK", 7)  # several chunks
    torch.manual_seed(0)
    w = torch.randn(50, 16)
    pred = torch.randn(20, 16, requires_grad=True)
    tgt = torch.randn(20, 16)
    loss, hits = SoftCrossEntropy.apply(pred, tgt, w, None)
    loss.backward()
    ref_pred = pred.detach().clone().requires_grad_()
    p = torch.softmax(tgt @ w.T, -1)
    ref = -(p * torch.log_softmax(ref_pred @ w.T, -1)).sum(-1).mean()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5)
    assert torch.allclose(pred.grad, ref_pred.grad, atol=1e-6)
    best = (tgt @ w.T).argmax(-1)
    top = (pred @ w.T).topk(3, -1).indices
    assert int(hits[0]) == int((top[:, 0] == best).sum())
    assert int(hits[1]) == int((top == best[:, None]).any(-1).sum())


def test_soft_cross_entropy_over_a_draft_vocabulary(monkeypatch):
    """With a reduced draft vocabulary: p is the target's distribution renormalised over it, and
    hits are counted in target ids against the argmax over the whole vocabulary."""
    import eaglespec.train as tr
    from eaglespec.train import soft_ce
    monkeypatch.setattr(tr, "CE_CHUNK", 7)
    torch.manual_seed(1)
    full = torch.randn(50, 16)
    ids = torch.tensor([0, 3, 4, 9, 17, 20, 33, 41, 49])
    pred, tgt = torch.randn(20, 16, requires_grad=True), torch.randn(20, 16)
    loss, _ = SoftCrossEntropy.apply(pred, tgt, full[ids].contiguous(), ids)
    loss.backward()
    ref_pred = pred.detach().clone().requires_grad_()
    ref = -(torch.softmax(tgt @ full[ids].T, -1) * torch.log_softmax(ref_pred @ full[ids].T, -1)).sum(-1).mean()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5) and torch.allclose(pred.grad, ref_pred.grad, atol=1e-6)
    _, hits, best, _ = soft_ce(pred.detach(), tgt, full[ids].contiguous(), want_grad=False, draft_ids=ids, full_weight=full)
    assert torch.equal(best, (tgt @ full.T).argmax(-1))
    guess = ids[(pred.detach() @ full[ids].T).argmax(-1)]
    assert int(hits[0]) == int((guess == best).sum())


def test_shift_inputs_masks_by_the_fed_token():
    ids = torch.tensor([[5, 6, 7, 8, 0]])
    amask = torch.tensor([[False, False, True, True, False]])  # right-padded: last is a pad
    feats = torch.arange(5.0)[None, :, None].expand(1, 5, 2)
    tok_in, counted, target = shift_inputs(ids, amask, feats)
    assert tok_in.tolist() == [[6, 7, 8, 0, 0]]
    assert counted.tolist() == [[False, True, True, False, False]]
    assert target[0, :, 0].tolist() == [1, 2, 3, 4, 0]


@pytest.mark.parametrize("layers", (1, 2))
def test_unroll_matches_drafting_with_the_cache(target, layers):
    """Step k of the parallel unroll at position p == a k-step chain drafted through the head's KV cache
    (with two layers, each keeps its own cache and the second normalises its input)."""
    head = random_head(target.args, seed=3, layers=layers).eval()
    torch.manual_seed(0)
    t = 12
    ids = torch.randint(3, target.args.vocab_size, (1, t))
    with torch.no_grad():
        feats, _ = target(ids, torch.arange(t)[None], logits=False)
        tok_in = F.pad(ids[:, 1:], (0, 1))
        embeds = target.embed_tokens(tok_in)
        outs = head.unroll(embeds, feats, 4)
        direct = head(embeds, feats, torch.arange(t)[None])
        assert torch.allclose(outs[0], direct, atol=1e-5)
        for k in (2, 3, 4):
            for p in (k - 1, 7, t - 2):
                start = p - k + 1  # the chain's first step sits here, on the true feature f_start
                head.setup_cache(64)
                h = head(embeds[:, : start + 1], feats[:, : start + 1], torch.arange(start + 1)[None], cache_start=0)
                fed = h[:, -1:]
                for i in range(2, k + 1):
                    pos = start + i - 1
                    fed = head(embeds[:, pos:pos + 1], fed, torch.tensor([[pos]]), cache_start=pos)
                assert torch.allclose(outs[k - 1][0, p], fed[0, 0], atol=1e-5), (k, p)


def test_a_few_steps_on_a_fixed_batch_reduce_the_loss(target, tiny):
    tok = load_tokenizer(tiny)
    from eaglespec.data import encode_conversation
    from eaglespec.features import pad_batch, target_features
    convs = [[{"role": "user", "content": "add two numbers"}, {"role": "assistant", "content": "def add(a, b): return a + b"}],
             [{"role": "user", "content": "a fox?"}, {"role": "assistant", "content": "The quick brown fox jumps."}]]
    enc = [encode_conversation(tok, c, 64) for c in convs]
    ids = pad_batch([e[0] for e in enc])
    amask = pad_batch([e[1] for e in enc], False, torch.bool)
    with torch.no_grad():
        feats = target_features(target, ids)
    head = random_head(target.args, seed=0)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, betas=(0.9, 0.95))
    losses = []
    for _ in range(8):
        loss, stats = batch_loss(head, target, ids, amask, feats, noise=0.0, weights=(1.0, 0.1), generator=None,
                                 autocast=contextlib.nullcontext)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(stats["loss"])
    assert stats["n"] == int(amask[:, 1:].sum())
    assert losses[-1] < 0.9 * losses[0], losses


def test_unrolled_loss_is_each_steps_loss_decayed(target):
    """batch_loss(steps=K): sum over k of 0.8^k x (SmoothL1 + 0.1 CE) of EagleHead.unroll's step k + 1, each over
    the counted positions p >= k (a chain of k + 1 steps starts at p - k), against the same next feature; its
    statistics (but the loss) are step 1's, as with steps=1; gradients reach the head through every step."""
    from eaglespec.features import target_features
    from eaglespec.train import TTT_DECAY
    torch.manual_seed(0)
    ids = torch.randint(3, target.args.vocab_size, (2, 10))
    amask = torch.zeros(2, 10, dtype=torch.bool)
    amask[0, 3:], amask[1, 5:9] = True, True
    with torch.no_grad():
        feats = target_features(target, ids)
    head = random_head(target.args, seed=4)
    one, s1 = batch_loss(head, target, ids, amask, feats, noise=0.0, weights=(1.0, 0.1), generator=None,
                         autocast=contextlib.nullcontext)
    three, s3 = batch_loss(head, target, ids, amask, feats, noise=0.0, weights=(1.0, 0.1), generator=None,
                           autocast=contextlib.nullcontext, steps=3)
    tok_in, counted, tgt = shift_inputs(ids, amask, feats)
    with torch.no_grad():
        outs = head.unroll(target.embed_tokens(tok_in), feats, 3)
    pos = torch.arange(10)[None].expand(2, -1)
    want = 0.0
    for k in range(3):
        sel = counted.bool() & (pos >= k)
        p, t = outs[k][sel], tgt[sel]
        fl = F.smooth_l1_loss(p, t, reduction="none").mean(-1).mean()
        ce = -(torch.softmax(t @ target.lm_head.weight.T, -1) * torch.log_softmax(p @ target.lm_head.weight.T, -1)).sum(-1).mean()
        want = want + TTT_DECAY ** k * (fl + 0.1 * ce)
        if k == 0:
            assert one.item() == pytest.approx(float(fl + 0.1 * ce), rel=1e-5)
    assert three.item() == pytest.approx(float(want), rel=1e-5) and three.item() > one.item()
    assert s3["loss"] == pytest.approx(three.item()) and s1["loss"] == pytest.approx(one.item())
    assert {k: s3[k] for k in ("feature_loss", "ce_loss", "top1", "top3", "n")} == \
        {k: s1[k] for k in ("feature_loss", "ce_loss", "top1", "top3", "n")}
    three.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


# ---- the command --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tiny, chats, tmp_path_factory):
    """One complete in-loop run: 2 epochs, evaluation every 4 steps, checkpoints every 3."""
    out = tmp_path_factory.mktemp("run") / "out"
    assert cli(*common(tiny, chats, out, "--epochs", 2, "--eval-every", 4, "--save-every", 3)) == 0
    return out


def test_train_writes_the_documented_layout(trained):
    for name in ("head/config.json", "head/model.safetensors", "checkpoint/state.pt", "checkpoint/head/model.safetensors",
                 "metrics.jsonl", "train_log.jsonl", "card.md"):
        assert (trained / name).is_file(), name
    log = read_jsonl(trained / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, len(log) + 1))
    epochs = [r["epoch"] for r in log]
    assert epochs == sorted(epochs) and epochs[0] == 0 and epochs[-1] == 1
    assert {"loss", "feature_loss", "ce_loss", "lr", "tok_s", "tokens_seen"} <= set(log[0])
    metrics = read_jsonl(trained / "metrics.jsonl")
    assert {m["at"] for m in metrics} >= {"step", "epoch"}
    assert {"top1", "top3", "top1_depth2", "top1_depth3", "top1_depth4", "tokens"} <= set(metrics[-1])
    assert metrics[-1]["tokens"] > 0 and 0 <= metrics[-1]["top1"] <= metrics[-1]["top3"] <= 1
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it learns on held-out data too
    card = (trained / "card.md").read_text()
    assert "Tokens seen" in card and "top-1 at depth 4" in card and "eaglespec train" in card
    state = torch.load(trained / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == log[-1]["step"] and state["epoch"] == 2


def test_saved_head_loads_and_drafts_identically(trained, tiny):
    from eaglespec.engine import Engine
    loaded = Engine.load(str(tiny), head=str(trained / "head"), device="cpu")
    model, _ = load_target(str(tiny), device="cpu")
    head = load_head(trained / "checkpoint" / "head", model.args)
    sd = load_file(str(trained / "head" / "model.safetensors"))
    assert all(torch.equal(sd[k], v) for k, v in head.state_dict().items())
    direct = Engine(model, load_tokenizer(tiny), head.eval().requires_grad_(False))
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    a = loaded.generate(messages=msgs, max_new_tokens=24, ignore_eos=True)
    b = direct.generate(messages=msgs, max_new_tokens=24, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths


def test_draft_vocabulary_run_saves_loads_and_refuses_another_on_resume(tiny, chats, tmp_path, capsys):
    """--draft-vocab: the head stores EAGLE-3's d2t/t2d, loads back drafting only those tokens, and a
    resume with another vocabulary size is refused in one line."""
    from eaglespec.engine import Engine
    out = tmp_path / "dv"
    assert cli(*common(tiny, chats, out, "--draft-vocab", 100, "--max-steps", 3)) == 0
    cfg = json.loads((out / "head" / "config.json").read_text())
    sd = load_file(str(out / "head" / "model.safetensors"))
    assert cfg["draft_vocab_size"] == 100 and sd["d2t"].shape == (100,) and int(sd["t2d"].sum()) == 100
    model, _ = load_target(str(tiny), device="cpu")
    head = load_head(out / "head", model.args)
    ids = head.draft_ids
    assert torch.equal(ids, torch.arange(100) + sd["d2t"]) and bool((ids[1:] > ids[:-1]).all())
    assert torch.equal(sd["t2d"].nonzero()[:, 0], ids)
    assert "Draft vocabulary: 100 most frequent" in (out / "card.md").read_text()
    metrics = read_jsonl(out / "metrics.jsonl")
    assert metrics and 0 <= metrics[-1]["top1"] <= metrics[-1]["top3"] <= 1
    engine = Engine.load(str(tiny), head=str(out / "head"), device="cpu")
    r = engine.generate(messages=[{"role": "user", "content": "the quick brown fox"}], max_new_tokens=24,
                        ignore_eos=True)
    plain = engine.generate(messages=[{"role": "user", "content": "the quick brown fox"}], max_new_tokens=24,
                            ignore_eos=True, method="vanilla")
    assert r.token_ids == plain.token_ids
    capsys.readouterr()
    msg = one_line_error(capsys, *common(tiny, chats, out, "--draft-vocab", 50, "--max-steps", 5, "--resume"))
    assert "another vocabulary" in msg


def test_resume_after_a_kill_continues_on_the_same_curve(tiny, chats, tmp_path, trained):
    out = tmp_path / "killed"
    args = common(tiny, chats, out, "--epochs", 2, "--eval-every", 4, "--save-every", 3)
    assert cli(*args, "--stop-after", 5) == 0  # dies after step 5; the last checkpoint is step 3
    first = read_jsonl(out / "train_log.jsonl")
    assert first[-1]["step"] == 5
    assert cli(*args) == 2  # an existing run is never overwritten without --resume
    assert cli(*args, "--resume") == 0
    log = read_jsonl(out / "train_log.jsonl")  # steps 4 and 5 were redone from the checkpoint and logged once
    ref = read_jsonl(trained / "train_log.jsonl")
    assert [r["step"] for r in log] == [r["step"] for r in ref]
    for r, s in zip(first + log[5:], ref):
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-5, abs=1e-6), r["step"]
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [m["step"] for m in read_jsonl(trained / "metrics.jsonl")]
    a = load_file(str(out / "head" / "model.safetensors"))
    b = load_file(str(trained / "head" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_signal_saves_at_the_step_and_resume_continues_the_same_curve(tiny, chats, tmp_path, trained, capsys):
    """Ctrl-C or SIGTERM mid-run: the step in progress finishes, a checkpoint is written at it (not at the last
    --save-every mark), the exit code says which signal, and --resume continues on the uninterrupted curve."""
    out = tmp_path / "signalled"
    args = common(tiny, chats, out, "--epochs", 2, "--eval-every", 4, "--save-every", 3)
    before = signal.getsignal(signal.SIGINT)
    assert cli(*args, "--signal-after", 4) == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # the handler is the caller's again
    msg = capsys.readouterr().out.strip().splitlines()[-1]
    assert msg.startswith("train: interrupted (SIGINT) after step 5") and "--resume" in msg
    first = read_jsonl(out / "train_log.jsonl")
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=True)
    assert first[-1]["step"] == state["step"] == 5  # the signal arrived in step 5; saved there, not at step 3
    assert cli(*args, "--resume") == 0
    log, ref = read_jsonl(out / "train_log.jsonl"), read_jsonl(trained / "train_log.jsonl")
    assert [r["step"] for r in log] == [r["step"] for r in ref]
    for r, s in zip(log, ref):
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-5, abs=1e-6), r["step"]
    a = load_file(str(out / "head" / "model.safetensors"))
    b = load_file(str(trained / "head" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_compiled_features_equal_eager_ones(tiny, chats, tmp_path):
    """`features` compiles the target's forward by default (one dynamic-shape graph over padded batches of
    many lengths); what it stores must be what the eager forward stores, to fp16 rounding."""
    argv = ["--model", tiny, "--data", chats, "--shard-size", 16, "--batch-tokens", 512, "--max-conversations", 16]
    assert cli("features", *argv, "--out", tmp_path / "eager", "--eager") == 0
    assert cli("features", *argv, "--out", tmp_path / "compiled", "--compile") == 0
    a = load_file(str(tmp_path / "eager" / "shard-00000.safetensors"))
    b = load_file(str(tmp_path / "compiled" / "shard-00000.safetensors"))
    assert torch.equal(a["input_ids"], b["input_ids"]) and len(set(a["offsets"].diff().tolist())) > 3
    assert torch.allclose(a["features"].float(), b["features"].float(), atol=2e-3, rtol=2e-3)


def test_features_then_train_from_disk(tiny, chats, tmp_path, trained, capsys):
    feats = tmp_path / "feats"
    argv = ["features", "--model", tiny, "--data", chats, "--out", feats, "--shard-size", 10, "--batch-tokens", 512]
    assert cli(*argv) == 0
    manifest = json.loads((feats / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 5 and manifest["n_conversations"] == 48
    shard = load_file(str(feats / "shard-00001.safetensors"))
    assert shard["features"].dtype == torch.float16 and shard["features"].shape == (shard["input_ids"].numel(), 64)
    assert shard["offsets"][-1] == shard["input_ids"].numel() == manifest["shards"][1]["tokens"]
    # the stored features are the target's
    model, _ = load_target(str(tiny), device="cpu")
    a, b = int(shard["offsets"][0]), int(shard["offsets"][1])
    with torch.no_grad():
        f, _ = model(shard["input_ids"][a:b].long()[None], torch.arange(b - a)[None], logits=False)
    assert torch.allclose(shard["features"][a:b].float(), f[0], atol=2e-2)
    # an interrupted run resumes: a missing shard is recomputed, the others are kept
    before = (feats / "shard-00000.safetensors").stat().st_mtime_ns
    (feats / "shard-00003.safetensors").unlink()
    assert cli(*argv) == 0
    assert (feats / "shard-00003.safetensors").is_file()
    assert (feats / "shard-00000.safetensors").stat().st_mtime_ns == before
    assert torch.equal(load_file(str(feats / "shard-00001.safetensors"))["features"], shard["features"])
    # other settings into the same folder are refused
    assert cli(*argv[:-2], "--max-len", 32) == 2
    # training from disk follows the in-loop curve (fp16 features: close, not equal)
    out = tmp_path / "from_disk"
    assert cli("train", "--features-dir", feats, "--out", out, "--batch-tokens", 384, "--lr", 2e-3, "--warmup-steps", 2,
               "--seed", 1, "--epochs", 2, "--model", tiny) == 0
    ours, ref = read_jsonl(out / "train_log.jsonl"), read_jsonl(trained / "train_log.jsonl")
    assert len(ours) == len(ref)
    for r, s in zip(ours, ref):
        assert r["loss"] == pytest.approx(s["loss"], rel=2e-2)
    # a learning curve's point: the first 10 conversations of the same store, against the same held-out split
    small = tmp_path / "small"
    assert cli("train", "--features-dir", feats, "--out", small, "--batch-tokens", 384, "--seed", 1, "--max-steps", 2,
               "--max-conversations", 10, "--model", tiny) == 0
    printed = capsys.readouterr().out
    assert "training on the first 10 train rows" in printed and "train: 10 records" in printed
    assert read_jsonl(small / "metrics.jsonl")[-1]["tokens"] == read_jsonl(out / "metrics.jsonl")[-1]["tokens"]


def test_features_of_a_later_part_of_the_corpus(tiny, chats, tmp_path, capsys):
    """`--skip-conversations` stores what a store of the first N lacks, byte for byte what a store of all
    of them holds for those conversations; the setting is part of what a resume must match."""
    argv = ["features", "--model", tiny, "--data", chats, "--shard-size", 8, "--batch-tokens", 512, "--eager"]
    assert cli(*argv, "--max-conversations", 16, "--out", tmp_path / "all") == 0
    assert cli(*argv, "--max-conversations", 16, "--skip-conversations", 8, "--out", tmp_path / "later") == 0
    later = json.loads((tmp_path / "later" / "manifest.json").read_text())
    assert later["skip_conversations"] == 8 and later["n_conversations"] == 8
    a = load_file(str(tmp_path / "all" / "shard-00001.safetensors"))
    b = load_file(str(tmp_path / "later" / "shard-00000.safetensors"))
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["offsets"], b["offsets"])
    assert torch.allclose(a["features"].float(), b["features"].float(), atol=2e-3)
    assert FeatureStore(tmp_path / "later").keys == FeatureStore(tmp_path / "all").keys[8:]
    assert cli(*argv, "--max-conversations", 16, "--out", tmp_path / "later") == 2  # not the same run
    assert "skip_conversations" in capsys.readouterr().err
    assert cli(*argv, "--max-conversations", 8, "--skip-conversations", 8, "--out", tmp_path / "none") == 2
    assert "--skip-conversations 8 leaves nothing of --max-conversations 8" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_bf16_autocast_features_and_training_follow_fp32(tiny, chats, tmp_path):
    """`--autocast bf16` (opt-in on a CPU: about 2x faster where the CPU has bf16 instructions) stores features
    within bf16's rounding of the fp32 ones, records the choice (a store never mixes the two), and training
    with it follows the fp32 run's loss curve."""
    argv = ["features", "--model", tiny, "--data", chats, "--shard-size", 16, "--batch-tokens", 512,
            "--max-conversations", 16, "--eager"]
    assert cli(*argv, "--out", tmp_path / "fp32") == 0
    assert cli(*argv, "--out", tmp_path / "bf16", "--autocast", "bf16") == 0
    assert "autocast" not in json.loads((tmp_path / "fp32" / "manifest.json").read_text())  # older stores still resume
    assert json.loads((tmp_path / "bf16" / "manifest.json").read_text())["autocast"] == "bf16"
    a = load_file(str(tmp_path / "fp32" / "shard-00000.safetensors"))["features"].float()
    b = load_file(str(tmp_path / "bf16" / "shard-00000.safetensors"))["features"].float()
    rel = (a - b).norm(dim=-1) / a.norm(dim=-1)
    assert 1e-3 < rel.median() < 3e-2, rel.median()  # it took effect, and it is only rounding
    assert cli(*argv, "--out", tmp_path / "bf16") == 2  # resumed at fp32: refused
    runs = {}
    for name, extra in (("fp32", ()), ("bf16", ("--autocast", "bf16"))):
        out = tmp_path / f"train-{name}"
        assert cli("train", "--features-dir", tmp_path / "fp32", "--out", out, "--batch-tokens", 384, "--lr", 2e-3,
                   "--warmup-steps", 2, "--seed", 1, "--max-steps", 6, "--model", tiny, *extra) == 0
        runs[name] = read_jsonl(out / "train_log.jsonl")
    assert len(runs["fp32"]) == len(runs["bf16"]) == 6
    assert runs["fp32"][-1]["loss"] < runs["fp32"][0]["loss"]
    for r, s in zip(runs["bf16"], runs["fp32"]):
        assert r["loss"] == pytest.approx(s["loss"], rel=5e-2)
    assert [r["loss"] for r in runs["bf16"]] != [s["loss"] for s in runs["fp32"]]


def test_in_loop_features_follow_autocast(tiny, chats, target, tmp_path):
    """`train --data D --autocast bf16` runs the target's forward in bf16 too, as `features --autocast bf16`
    does (on a CPU that forward is most of an in-loop step); its held-out yardstick stays fp32."""
    from eaglespec.cli import build_parser
    from eaglespec.features import target_features
    from eaglespec.train import run_data
    tokenizer = load_tokenizer(tiny)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    feats = {}
    for choice in ("auto", "bf16"):
        args = build_parser().parse_args(["train", "--model", str(tiny), "--data", str(chats), "--out",
                                          str(tmp_path / choice), "--max-conversations", "16", "--autocast", choice])
        data = run_data(args, target, tokenizer, None, None, 0, 1, lambda *a, **k: None)
        ids, _, feats[choice] = data.train_src.batch([0, 1])
        eval_ids, _, eval_feats = data.eval_src.batch([0])
        with torch.no_grad():
            assert torch.equal(eval_feats, target_features(target, eval_ids))  # fp32 either way
            with bf16():
                ref16 = target_features(target, ids).float()
            ref32 = target_features(target, ids)
        assert feats[choice].dtype == torch.float32
        assert torch.equal(feats[choice], ref16 if choice == "bf16" else ref32)
    rel = (feats["bf16"] - feats["auto"]).norm(dim=-1) / feats["auto"].norm(dim=-1)
    assert 1e-3 < rel.median() < 3e-2, rel.median()  # it took effect, and it is only rounding


def test_features_grow_with_more_conversations(tiny, chats, tmp_path):
    """Rerunning with a larger --max-conversations keeps the shards that hold the same conversations."""
    feats = tmp_path / "grow"
    argv = ["features", "--model", tiny, "--data", chats, "--out", feats, "--shard-size", 10, "--batch-tokens", 512]
    assert cli(*argv, "--max-conversations", 25) == 0
    stamps = {i: (feats / f"shard-0000{i}.safetensors").stat().st_mtime_ns for i in range(3)}
    first = load_file(str(feats / "shard-00001.safetensors"))
    assert cli(*argv) == 0
    manifest = json.loads((feats / "manifest.json").read_text())
    assert manifest["complete"] and manifest["n_conversations"] == 48 and len(manifest["shards"]) == 5
    assert all((feats / f"shard-0000{i}.safetensors").stat().st_mtime_ns == stamps[i] for i in (0, 1))
    assert (feats / "shard-00002.safetensors").stat().st_mtime_ns != stamps[2]  # held 5 conversations, now 10
    assert torch.equal(load_file(str(feats / "shard-00001.safetensors"))["features"], first["features"])
    assert len(FeatureStore(feats)) == 48


# ---- bad input: one line, exit 2, no traceback --------------------------------------------------------

def one_line_error(capsys, *argv) -> str:
    rc = cli(*argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err and err[-1].startswith("eaglespec: error:") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_bad_input_gives_one_line_errors(tiny, chats, tmp_path, trained, capsys):
    msg = one_line_error(capsys, "train", "--model", tiny, "--data", tmp_path / "nope.jsonl", "--out", tmp_path / "o1")
    assert "not found" in msg
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "no usable conversations" in one_line_error(capsys, "train", "--model", tiny, "--data",
                                                       tmp_path / "empty.jsonl", "--out", tmp_path / "o2")
    assert "no features" in one_line_error(capsys, "train", "--model", tiny, "--features-dir", tmp_path / "nofeats",
                                           "--out", tmp_path / "o3")
    assert "--lr" in one_line_error(capsys, *common(tiny, chats, tmp_path / "o4"), "--lr", -1)
    # resuming with a target the checkpoint's head does not fit
    other = make_tiny_checkpoint(tmp_path / "wide", hidden_size=96)
    out = tmp_path / "o5"
    for p in ("checkpoint", "head"):
        __import__("shutil").copytree(trained / p, out / p)
    msg = one_line_error(capsys, *common(other, chats, out), "--epochs", 2, "--resume")
    assert "does not fit the target" in msg and "hidden_size" in msg


def test_expected_acceptance_is_what_the_rejection_rules_accept():
    """The three depth-1 acceptances at T = 1, checked against the rules run on samples, with a draft
    vocabulary (q is zero outside it, p is the target's distribution over the whole vocabulary):
    sum min(p, q) for a token sampled from q and accepted with min(1, p/q); for q's top-1 and top-3 as
    deterministic candidates, `verify`'s rule (accept x with p(x), else drop it and renormalise)."""
    from eaglespec.train import expected_acceptance
    g = torch.Generator().manual_seed(0)
    full = torch.randn(40, 8, generator=g)
    ids = torch.tensor([0, 3, 5, 7, 11, 13, 17, 19, 23, 29])
    pred, tgt = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    sampled, top1, top3 = expected_acceptance(pred, tgt, full[ids].contiguous(), ids, full).tolist()
    q = torch.softmax(pred @ full[ids].T, -1)
    p_full = torch.softmax(tgt @ full.T, -1)
    p = p_full[:, ids]
    n = 200_000
    x = torch.multinomial(q, n, replacement=True, generator=g)
    accepted = torch.rand(x.shape, generator=g) < (p.gather(1, x) / q.gather(1, x)).clamp(max=1)
    assert sampled == pytest.approx(float(accepted.float().mean(1).sum()), abs=0.01)
    cands = ids[q.topk(3, -1).indices]  # target-vocabulary ids of q's top 3
    trials, first, any_ = 4000, 0, 0
    for row in range(3):
        for _ in range(trials):
            left = p_full[row].clone()
            for j, c in enumerate(cands[row].tolist()):
                if float(torch.rand((), generator=g)) < float(left[c]):
                    first += j == 0
                    any_ += 1
                    break
                left[c] = 0.0
                left /= left.sum()
    assert top1 == pytest.approx(first / trials, abs=0.04)
    assert top3 == pytest.approx(any_ / trials, abs=0.05)
    assert top3 == pytest.approx(float(p_full.gather(1, cands).sum()), abs=1e-5)
    # the target's mass outside the draft vocabulary is never accepted; a draft equal to the target always is
    assert sampled <= float(p.sum()) + 1e-6 and float(p.sum()) < 3 - 0.1
    assert expected_acceptance(tgt, tgt, full)[0] == pytest.approx(3.0, abs=1e-5)


def test_evaluate_scores_a_head_on_the_held_out_split_as_train_did(trained, tiny, chats, tmp_path, capsys):
    """`eaglespec evaluate` rebuilds train's held-out split and evaluation: on the run's own data it gives
    the run's last held-out numbers, so it can score any head on any corpus with the same yardstick."""
    out = tmp_path / "ev.json"
    assert cli("evaluate", "--model", tiny, "--head", trained / "head", "--data", chats, "--batch-tokens", 384,
               "--seed", 1, "--eval-conversations", 32, "--json", out) == 0
    got, last = json.loads(out.read_text()), read_jsonl(trained / "metrics.jsonl")[-1]
    acc = ("accept_t1_sampled", "accept_t1_top1", "accept_t1_top3")
    for k in ("top1", "top3", "top1_depth2", "top1_depth3", "top1_depth4", *acc, "tokens"):
        assert got[k] == pytest.approx(last[k], abs=1e-4), k
    assert 0 < got["accept_t1_top1"] < got["accept_t1_top3"] < 1 and 0 < got["accept_t1_sampled"] < 1
    assert "held-out" in capsys.readouterr().out
    # a random head scores lower on the same positions: the numbers measure the head
    rnd = tmp_path / "rnd"
    model, _ = load_target(str(tiny), device="cpu")
    random_head(model.args, seed=3).save(rnd)
    assert cli("evaluate", "--model", tiny, "--head", rnd, "--data", chats, "--batch-tokens", 384, "--seed", 1,
               "--eval-conversations", 32, "--json", out) == 0
    rnd_res = json.loads(out.read_text())
    assert rnd_res["top1"] < got["top1"] and all(rnd_res[k] < got[k] for k in acc)
    # --answer-tokens: the same head on each answer's first 4 tokens only: fewer positions, other numbers
    assert cli("evaluate", "--model", tiny, "--head", trained / "head", "--data", chats, "--batch-tokens", 384,
               "--seed", 1, "--eval-conversations", 32, "--answer-tokens", 4, "--json", out) == 0
    first = json.loads(out.read_text())
    assert first["answer_tokens"] == 4 and 0 < first["tokens"] < got["tokens"]
    assert "first 4 tokens of each answer" in capsys.readouterr().out
    # bad input: one line, exit 2
    assert cli("evaluate", "--model", tiny, "--head", trained / "head", "--data", chats, "--answer-tokens", 0) == 2
    assert "--answer-tokens must be >= 1" in capsys.readouterr().err
    capsys.readouterr()
    assert cli("evaluate", "--model", tiny, "--head", tmp_path / "nope", "--data", chats) == 2
    err = capsys.readouterr().err.strip()
    assert "head not found" in err and len(err.splitlines()) == 1


def test_init_head_fine_tunes_a_trained_head(trained, tiny, chats, tmp_path, capsys):
    """--init-head starts from a trained head's weights (its loss starts where that run ended, far below
    a fresh head's) and keeps that head's draft vocabulary; another --arch is refused in one line."""
    out = tmp_path / "ft"
    assert cli(*common(tiny, chats, out, "--init-head", trained / "head", "--max-steps", 2)) == 0
    first = read_jsonl(out / "train_log.jsonl")[0]["loss"]
    ref = read_jsonl(trained / "train_log.jsonl")
    assert first < ref[0]["loss"] and first == pytest.approx(ref[-1]["loss"], rel=0.5)
    assert "eaglespec train" in (out / "card.md").read_text() and "--init-head" in (out / "card.md").read_text()
    capsys.readouterr()
    assert cli(*common(tiny, chats, tmp_path / "ft3", "--init-head", trained / "head", "--arch", "eagle3")) == 2
    err = capsys.readouterr().err.strip()
    assert "--init-head" in err and len(err.splitlines()) == 1


def test_unrolled_eagle1_training_runs_records_its_objective_and_keeps_it_on_resume(trained, tiny, chats, tmp_path, capsys):
    """train --ttt-steps 3 on an EAGLE-1 head: it learns, its card and plan say so, and a resume with another
    depth is refused in one line (another objective)."""
    out = tmp_path / "unrolled"
    assert cli(*common(tiny, chats, out, "--ttt-steps", 3, "--max-steps", 6, "--save-every", 3)) == 0
    log = read_jsonl(out / "train_log.jsonl")
    assert len(log) == 6 and log[-1]["loss"] < log[0]["loss"]
    assert "at each of 3 steps unrolled" in (out / "card.md").read_text()
    assert "unrolled" not in (trained / "card.md").read_text()
    capsys.readouterr()
    assert cli(*common(tiny, chats, out, "--ttt-steps", 2, "--max-steps", 6, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert "ttt_steps 3 -> 2" in err and "Traceback" not in err


def test_init_head_grows_to_more_layers_and_starts_where_it_was(trained, tiny, chats, tmp_path, capsys):
    """--init-head H --head-layers 2: the one-layer head grows a second layer that starts as the identity, so the
    run's first loss is the one-layer head's on the same batch (--max-steps 1 twice, same seed); the saved head
    has two layers and says so in its config and card; resuming with another layer count, --head-layers with
    --arch eagle3, and shrinking are one-line errors."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli(*common(tiny, chats, one, "--init-head", trained / "head", "--max-steps", 1, "--noise", 0)) == 0
    assert cli(*common(tiny, chats, two, "--init-head", trained / "head", "--max-steps", 2, "--noise", 0,
                       "--head-layers", 2)) == 0
    first = [read_jsonl(d / "train_log.jsonl")[0] for d in (one, two)]
    assert first[1]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5) and first[1]["top1"] == first[0]["top1"]
    assert read_jsonl(two / "train_log.jsonl")[1]["loss"] != pytest.approx(first[1]["loss"], rel=1e-6)  # it learns
    assert json.loads((two / "head" / "config.json").read_text())["num_hidden_layers"] == 2
    assert "2 decoder layer(s)" in (two / "card.md").read_text()
    fast = tmp_path / "fast"  # the grown layer on its own, higher learning rate: it moves further from the identity
    assert cli(*common(tiny, chats, fast, "--init-head", trained / "head", "--max-steps", 2, "--noise", 0,
                       "--head-layers", 2, "--grown-lr", 2e-2)) == 0
    moved = [load_file(d / "head" / "model.safetensors")["layers.1.self_attn.o_proj.weight"].abs().max()
             for d in (two, fast)]
    assert 0 < moved[0] < moved[1] / 3, moved
    assert read_jsonl(fast / "train_log.jsonl")[0]["loss"] == pytest.approx(first[0]["loss"], rel=1e-5)
    capsys.readouterr()
    for argv in ((two, "--init-head", trained / "head", "--max-steps", 3, "--noise", 0, "--resume", "--replan"),
                 (fast, "--init-head", trained / "head", "--max-steps", 2, "--noise", 0, "--head-layers", 2,
                  "--grown-lr", 1e-2, "--resume"),
                 (tmp_path / "nolayers", "--init-head", trained / "head", "--grown-lr", 1e-2),
                 (tmp_path / "e3", "--arch", "eagle3", "--head-layers", 2),
                 (tmp_path / "shrink", "--init-head", two / "head", "--head-layers", 1),
                 (tmp_path / "zero", "--head-layers", 0)):
        assert cli(*common(tiny, chats, *argv)) == 2, argv
        err = capsys.readouterr().err.strip()  # a progress bar may precede the error line
        assert "Traceback" not in err and ("layer" in err.splitlines()[-1] or "grown_lr" in err), (argv, err)


def test_init_head_with_draft_vocab_chooses_the_vocabulary_again(trained, tiny, chats, tmp_path, capsys):
    """--init-head with --draft-vocab N (EAGLE-1): the head keeps its weights (its loss starts near where its
    run ended) and drafts from the N most frequent assistant tokens of this run's data; resuming keeps that
    vocabulary. An EAGLE-3 head cannot (its LM head is over its own vocabulary): one line."""
    from safetensors.torch import load_file
    out = tmp_path / "ftv"
    assert cli(*common(tiny, chats, out, "--init-head", trained / "head", "--draft-vocab", 60, "--max-steps", 2)) == 0
    first = read_jsonl(out / "train_log.jsonl")[0]["loss"]
    ref = read_jsonl(trained / "train_log.jsonl")
    assert first < ref[0]["loss"]
    sd = load_file(out / "head" / "model.safetensors")
    assert sd["d2t"].shape == (60,) and int(sd["t2d"].sum()) == 60
    assert "60" in capsys.readouterr().out  # the log names the new vocabulary and its coverage
    assert cli(*common(tiny, chats, out, "--init-head", trained / "head", "--draft-vocab", 60, "--max-steps", 3,
                       "--resume", "--replan")) == 0
    assert load_file(out / "head" / "model.safetensors")["d2t"].shape == (60,)
    h3 = tmp_path / "e3"
    assert cli(*common(tiny, chats, h3, "--arch", "eagle3", "--max-steps", 1)) == 0
    capsys.readouterr()
    assert cli(*common(tiny, chats, tmp_path / "e3ft", "--arch", "eagle3", "--init-head", h3 / "head",
                       "--draft-vocab", 60)) == 2
    err = capsys.readouterr().err.strip()
    assert "--draft-vocab" in err and len(err.splitlines()) == 1


def test_with_draft_vocab_changes_nothing_but_the_vocabulary():
    from eaglespec.head import random_head
    from eaglespec.model import ModelArgs
    from eaglespec.train import with_draft_vocab
    args = ModelArgs(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    head = random_head(args, seed=1, draft_vocab=torch.arange(0, 200, 2))
    new = with_draft_vocab(head, torch.tensor([1, 5, 7, 250]))
    assert new.draft_ids.tolist() == [1, 5, 7, 250] and int(new.t2d.sum()) == 4
    a, b = head.state_dict(), new.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a if k not in ("d2t", "t2d"))


def test_first_of_each_answer_keeps_each_answers_first_tokens():
    from eaglespec.train import first_of_each_answer
    m = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 1, 1], [1, 1, 0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    want = torch.tensor([[0, 1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(first_of_each_answer(m, 2), want)
    assert torch.equal(first_of_each_answer(m, 99), m)


def test_split_seed_keeps_the_held_out_conversations_while_the_seed_changes(tiny, chats, tmp_path):
    """--seed 2 --split-seed 1: another initial head and batch order, scored on --seed 1's held-out split, so
    `evaluate --seed 1` reproduces the run's own held-out numbers; without it the split moves with --seed."""
    out = tmp_path / "s2"
    argv = common(tiny, chats, out, "--max-steps", 2, "--eval-every", 2, "--split-seed", 1)
    argv[argv.index("--seed") + 1] = 2
    assert cli(*argv) == 0
    card = (out / "card.md").read_text()
    assert "seed 1); " in card
    ev = tmp_path / "ev.json"
    assert cli("evaluate", "--model", tiny, "--head", out / "head", "--data", chats, "--batch-tokens", 384,
               "--seed", 1, "--eval-conversations", 32, "--json", ev) == 0
    got, last = json.loads(ev.read_text()), read_jsonl(out / "metrics.jsonl")[-1]
    assert got["tokens"] == last["tokens"] and got["top1"] == pytest.approx(last["top1"], abs=1e-4)
    from eaglespec.data import split
    keys = [str(i) for i in range(400)]
    assert split(keys, 1, 0.05)[1] != split(keys, 2, 0.05)[1]  # the split itself does depend on its seed
