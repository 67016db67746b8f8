"""EAGLE-3 heads: the target's three layers from the same forward, the head's layout and checkpoint
format, lossless drafting in every tree kind (greedy token for token, ties excepted; sampling by a
chi-square test), a reduced draft vocabulary, and a head whose drafts get accepted."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from eaglespec.costmodel import CostTable
from eaglespec.engine import Engine
from eaglespec.head import Eagle3Head, EagleHead, load_head, random_eagle3_head, random_head
from eaglespec.loading import load_target
from eaglespec.model import ModelArgs, default_aux_layers
from eaglespec.testing import FAMILIES, eagle3_oracle_pair
from eaglespec.tree import Drafter, TreeConfig
from test_lossless import KINDS, SAMPLING, check_lossless, chi_square_pvalue, exact_continuations, random_prompts, run

# The official EAGLE-3 checkpoint keys (SafeAILab/EAGLE eagle/traineagle3/cnets.py: Model.fc, .midlayer
# = LlamaDecoderLayeremb with hidden_norm/input_layernorm/self_attn/mlp/post_attention_layernorm, .norm,
# .lm_head over draft_vocab_size, buffers d2t/t2d); SpecForge's LlamaForCausalLMEagle3 uses the same names.
OFFICIAL_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def tiny_args(**kw) -> ModelArgs:
    return ModelArgs(**{**dict(vocab_size=320, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512), **kw})


# ---- the target's three layers ---------------------------------------------------------------------

def test_aux_layers_are_the_hidden_states_entering_them(tiny_checkpoint):
    """Checked against transformers' own hidden_states (entry i = the input of layer i); index L is the
    last layer's output, whose final norm is the features. Without aux_layers nothing changes."""
    from transformers import AutoModelForCausalLM
    folder = tiny_checkpoint("llama")
    model, _ = load_target(folder, device="cpu", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 11), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(11)[None].expand(2, -1)
    with torch.inference_mode():
        plain = model(ids, pos)
        feats, logits, aux = model(ids, pos, aux_layers=(1, 0, 2))
        ref = hf(ids, output_hidden_states=True).hidden_states
    assert len(plain) == 2 and torch.equal(plain[0], feats) and torch.equal(plain[1], logits)
    h = model.args.hidden_size
    assert aux.shape == (2, 11, 3 * h)
    assert torch.allclose(aux[..., :h], ref[1], atol=1e-5) and torch.allclose(aux[..., h:2 * h], ref[0], atol=1e-5)
    assert torch.allclose(model.norm(aux[..., 2 * h:]), feats, atol=1e-6)


def test_default_aux_layers_follow_the_official_choice():
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(30) == (2, 15, 27)   # SmolLM2-135M
    assert default_aux_layers(2) == (2, 1, 0)      # clamped into [0, L] for shallow test models


# ---- the head and its checkpoint ---------------------------------------------------------------------

def test_state_dict_and_config_follow_the_official_layout(tmp_path):
    args = tiny_args(num_hidden_layers=6)
    head = random_eagle3_head(args, seed=1, draft_vocab=torch.arange(0, 320, 4))
    sd = head.state_dict()
    assert set(sd) == OFFICIAL_KEYS
    h = args.hidden_size
    assert sd["fc.weight"].shape == (h, 3 * h) and sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert sd["lm_head.weight"].shape == (80, h) and sd["d2t"].dtype == torch.long and sd["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(80) + sd["d2t"], torch.arange(0, 320, 4)) and int(sd["t2d"].sum()) == 80
    head.save(tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 80 and cfg["vocab_size"] == 320 and cfg["target_hidden_size"] == h
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # entering 2, 3, 3 of 6
    back = load_head(tmp_path / "h", args)
    assert isinstance(back, Eagle3Head) and back.aux_layers == (2, 3, 3)
    assert torch.equal(back.draft_ids, torch.arange(0, 320, 4))
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in (tmp_path / "h").iterdir())  # no pickle


def test_full_vocabulary_head_has_identity_maps_and_no_draft_ids(tmp_path):
    head = random_eagle3_head(tiny_args(), seed=0)
    assert head.draft_ids is None and head.lm_head.weight.shape[0] == 320 and not head.d2t.any()
    head.save(tmp_path / "h")
    assert load_head(tmp_path / "h", tiny_args()).draft_ids is None


def test_load_head_returns_the_class_the_checkpoint_holds(tmp_path):
    args = tiny_args()
    random_head(args).save(tmp_path / "e1")
    random_eagle3_head(args).save(tmp_path / "e3")
    assert type(load_head(tmp_path / "e1", args)) is EagleHead
    assert type(load_head(tmp_path / "e3", args)) is Eagle3Head


def test_an_official_checkpoint_without_our_extras_loads(tmp_path):
    """As released (yuhuili/EAGLE3-*): config without eagle_config/target_hidden_size, weights in
    pytorch_model.bin (read with weights_only), a SpecForge-style embed_tokens.weight to ignore."""
    args = tiny_args(num_hidden_layers=8)
    head = random_eagle3_head(args, seed=2, draft_vocab=torch.arange(1, 320, 2))
    folder = tmp_path / "official"
    folder.mkdir()
    cfg = {k: v for k, v in head.hf_config().items() if k not in ("eagle_config", "target_hidden_size",
                                                                   "norm_before_residual")}
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save({**head.state_dict(), "embed_tokens.weight": torch.zeros(320, 64)}, folder / "pytorch_model.bin")
    back = load_head(folder, args)
    assert isinstance(back, Eagle3Head) and back.aux_layers == (2, 4, 5)  # the official default for L = 8
    x, h = torch.randn(1, 5, 64), torch.randn(1, 5, 192)
    pos = torch.arange(5)[None]
    assert torch.equal(back.draft_logits(back.first(x, h, pos)), head.draft_logits(head.first(x, h, pos)))


@pytest.mark.parametrize("what", ["hidden", "arch-without-midlayer", "aux-out-of-range", "d2t-outside"])
def test_mismatched_checkpoints_are_one_line_errors(tmp_path, what):
    args = tiny_args(num_hidden_layers=6)
    folder = tmp_path / what
    if what == "arch-without-midlayer":
        random_head(args).save(folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLMEagle3"]}))
    else:
        random_eagle3_head(args).save(folder)
    if what == "hidden":
        args = tiny_args(num_hidden_layers=6, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    if what == "aux-out-of-range":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 9]
        (folder / "config.json").write_text(json.dumps(cfg))
    if what == "d2t-outside":
        from safetensors.torch import load_file, save_file
        sd = load_file(str(folder / "model.safetensors"))
        sd["d2t"][-1] = 5
        save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_head(folder, args)
    assert "\n" not in str(e.value)


def test_first_then_step_through_the_cache_equals_one_pass():
    """The cached path the engine drafts with == one causal pass: first() on true layers for a prefix,
    then the same inputs one position at a time."""
    args = tiny_args()
    head = random_eagle3_head(args, seed=4).eval()
    x, h = torch.randn(1, 9, 64), torch.randn(1, 9, 192)
    pos = torch.arange(9)[None]
    with torch.no_grad():
        whole = head.first(x, h, pos)
        head.setup_cache(32)
        part = [head.first(x[:, :5], h[:, :5], pos[:, :5], cache_start=0)]
        for t in range(5, 9):
            part.append(head.first(x[:, t:t + 1], h[:, t:t + 1], pos[:, t:t + 1], cache_start=t))
        assert torch.allclose(torch.cat(part, 1), whole, atol=1e-5)
        # step() takes an H-wide hidden state: the head's own output, not the target's 3H
        assert head.step(x[:, :3], whole[:, :3], pos[:, :3]).shape == (1, 3, 64)


# ---- lossless drafting ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    model, _ = load_target(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32)
    prompts = random_prompts(15, seed=10)
    return model, prompts, [run(Engine(model), p, "vanilla").token_ids for p in prompts]


@pytest.mark.parametrize("kind", KINDS)
def test_random_eagle3_head_is_lossless(kind, llama, same_or_tie):
    model, prompts, vanilla = llama
    for seed in (0, 1, 2):
        engine = Engine(model, head=random_eagle3_head(model.args, seed=seed), tree=TreeConfig(kind=kind))
        check_lossless(engine, prompts[seed::3], vanilla[seed::3], same_or_tie)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_lossless_with_an_eagle3_head(family, tiny_checkpoint, same_or_tie):
    """Three layers captured from qkv-bias, q/k-norm and MoE targets, under tree masks."""
    model, _ = load_target(tiny_checkpoint(family), device="cpu", dtype=torch.float32)
    prompts = random_prompts(4, seed=11)
    vanilla = [run(Engine(model), p, "vanilla").token_ids for p in prompts]
    head = random_eagle3_head(model.args, seed=5, draft_vocab=torch.arange(0, 320, 3))
    check_lossless(Engine(model, head=head), prompts, vanilla, same_or_tie)


@pytest.fixture(scope="module")
def good():
    model, head = eagle3_oracle_pair(noise=0.3, logit_scale=3.0)
    prompts = random_prompts(20, seed=12)
    return model, head, prompts, [run(Engine(model), p, "vanilla").token_ids for p in prompts]


def draft_steps(monkeypatch) -> list[tuple[int, int]]:
    """Records (width of what the head is fed, rows) of every first()/step() call."""
    seen = []
    for name in ("first", "step"):
        real = getattr(Eagle3Head, name)

        def spy(self, embeds, hidden, *a, _real=real, _name=name, **k):
            seen.append((_name, hidden.shape[-1]))
            return _real(self, embeds, hidden, *a, **k)

        monkeypatch.setattr(Eagle3Head, name, spy)
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_good_eagle3_head_accepts_several_tokens_and_is_lossless(kind, good, monkeypatch, same_or_tie):
    model, head, prompts, vanilla = good
    seen = draft_steps(monkeypatch)
    results = check_lossless(Engine(model, head=head, tree=TreeConfig(kind=kind)), prompts, vanilla, same_or_tie)
    tau = sum(r.tau for r in results) / len(results)
    assert tau > 1.5, f"mean tau {tau:.2f}: the head does not draft well enough to test acceptance"
    assert max(max(r.accept_lengths) for r in results) >= 4
    # the target's three layers go into first(); the head's own H-wide outputs into step()
    assert {w for n, w in seen if n == "first"} == {3 * 64} and {w for n, w in seen if n == "step"} == {64}


def test_auto_tree_with_an_eagle3_head_is_lossless(good, same_or_tie):
    """The cost-model tree size (synthetic table), and the calibration's draft call with a 3H input."""
    model, head, prompts, vanilla = good
    table = CostTable({n: 10.0 + n for n in (1, 4, 8, 12, 16)}, 0.5, 0.5, {"mode": "synthetic"})
    engine = Engine(model, head=head, tree=TreeConfig(auto=True, depth=5, total_tokens=16), cost_table=table)
    check_lossless(engine, prompts[:8], vanilla[:8], same_or_tie)
    assert engine.policy is not None and engine.policy.rounds > 0
    engine.time_draft_call("first", 64)
    engine.time_draft_call("step", 64)


def test_reduced_draft_vocabulary_drafts_only_it_and_is_lossless(monkeypatch, same_or_tie):
    ids = torch.arange(0, 320, 2)
    model, head = eagle3_oracle_pair(noise=0.3, logit_scale=3.0, draft_vocab=ids)
    assert head.lm_head.weight.shape[0] == 160
    prompts = random_prompts(8, seed=13)
    vanilla = [run(Engine(model), p, "vanilla").token_ids for p in prompts]
    drafted = []
    real = Drafter.draft

    def spy(self, *a, **k):
        cands = real(self, *a, **k)
        drafted.extend(cands.tokens.tolist())
        return cands

    monkeypatch.setattr(Drafter, "draft", spy)
    for kind in KINDS:
        results = check_lossless(Engine(model, head=head, tree=TreeConfig(kind=kind)), prompts, vanilla, same_or_tie)
        assert max(max(r.accept_lengths) for r in results) >= 3
    assert drafted and all(t % 2 == 0 for t in drafted)


@pytest.mark.parametrize("name,draws,draft_vocab", [("t1", 1500, None), ("t0.7-p0.9-k5", 800, None),
                                                    ("t1", 800, [0, 2, 3, 5, 7])])
def test_eagle3_sampling_follows_the_target(name, draws, draft_vocab):
    """EAGLE-3's first three sampled tokens follow the target's exact joint distribution."""
    params = SAMPLING[name]
    model, head = eagle3_oracle_pair(vocab_size=8, logit_scale=3.0, noise=0.3, draft_vocab=draft_vocab)
    engine = Engine(model, head=head, tree=TreeConfig(top_k=3, depth=3, total_tokens=8))
    prompt = [1, 2, 3]
    expected = exact_continuations(model, prompt, 3, params)
    counts, accepted = Counter(), 0
    for seed in range(draws):
        r = engine.generate(input_ids=prompt, max_new_tokens=3, temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k, seed=seed, ignore_eos=True)
        counts[tuple(r.token_ids)] += 1
        accepted += r.accept_lengths[0] > 1
    assert accepted > draws // 4
    assert chi_square_pvalue(counts, expected) > 1e-3


# ---- training-time test ----------------------------------------------------------------------------------

def test_unroll_matches_drafting_through_the_cache():
    """Step i of the parallel unroll at position t == a draft chain started at t through the head's KV
    cache (first() on the prefix, then step() on its own outputs), as the engine drafts."""
    head = random_eagle3_head(tiny_args(), seed=6).eval()
    torch.manual_seed(0)
    t = 10
    embeds, aux = torch.randn(1, t, 64), torch.randn(1, t, 192)
    with torch.no_grad():
        outs = head(embeds, aux, ttt_steps=4)
        assert torch.allclose(outs[0], head.first(embeds, aux, torch.arange(t)[None]), atol=1e-5)
        for start in (0, 3, t - 4):
            head.setup_cache(32)
            h = head.first(embeds[:, :start + 1], aux[:, :start + 1], torch.arange(start + 1)[None], cache_start=0)
            fed = h[:, -1:]
            assert torch.allclose(outs[0][0, start], fed[0, 0], atol=1e-5)
            for i in range(1, 4):
                slot = start + i  # tree slots after the committed prefix, in feeding order
                mask = torch.ones(1, slot + 1, dtype=torch.bool)
                fed = head.step(embeds[:, start + i:start + i + 1], fed, torch.tensor([[start + i]]), mask=mask,
                                cache_start=slot)
                assert torch.allclose(outs[i][0, start], fed[0, 0], atol=1e-5), (start, i)


def draft_vocab_batch(seed: int):
    """An oracle target, an EAGLE-3 head over the even ids, a 2 x 12 batch with random assistant masks, its
    features and the draft LM-head rows."""
    model, _ = eagle3_oracle_pair(logit_scale=3.0)
    ids_draft = torch.arange(0, 320, 2)
    head = random_eagle3_head(model.args, seed=7, draft_vocab=ids_draft).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 320, (2, 12), generator=g)
    amask = torch.rand(2, 12, generator=g) > 0.3
    with torch.no_grad():
        feats = torch.cat(model(ids, torch.arange(12)[None].expand(2, -1), logits=False, aux_layers=head.aux_layers)[::2], -1)
    return model, head, ids, amask, feats, (model.lm_head.weight[ids_draft].contiguous().detach(), ids_draft)


def test_ttt_losses_match_a_direct_computation():
    """Per step: mean over positions t whose fed token x_{t+1+i} is the assistant's and whose target
    best token is draftable, of CE(softmax over the draft vocabulary of the target's logits at
    t+1+i, the head's step-i distribution at t); hits against the full-vocabulary argmax."""
    import contextlib
    from eaglespec.train import ttt_losses
    model, head, ids, amask, feats, vocab = draft_vocab_batch(3)
    ids_draft = vocab[1]
    with torch.no_grad():
        got = ttt_losses(head, model, ids, amask, feats, 3, contextlib.nullcontext, vocab, depth=4)
        outs = head(model.embed_tokens(torch.nn.functional.pad(ids[:, 1:], (0, 1))), feats[..., 64:], ttt_steps=4)
    final = feats[..., :64]
    torch.set_grad_enabled(False)
    for i in range(4):
        losses, n, hits = [], 0, 0
        for b in range(2):
            for t in range(12):
                s = t + 1 + i
                if s >= 12 or not amask[b, s]:
                    continue
                n += 1
                full = final[b, s] @ model.lm_head.weight.T
                best = int(full.argmax())
                logq = torch.log_softmax(head.draft_logits(outs[i][b, t]), -1)
                hits += int(ids_draft[int(logq.argmax())]) == best
                if best % 2 == 0:  # draftable
                    p = torch.softmax(final[b, s] @ vocab[0].T, -1)
                    losses.append(float(-(p * logq).sum()))
        mean, rows, top1, _top3, scored, feature = got[i]
        assert feature is None  # no feature term unless asked
        assert (rows, top1, scored) == (n, hits, len(losses) if i < 3 else 0), i
        if i < 3:
            assert float(mean) == pytest.approx(sum(losses) / len(losses), rel=1e-5), i
        else:
            assert mean is None  # evaluated beyond the K trained steps: accuracy only
    torch.set_grad_enabled(True)


def test_eagle3_feature_term_is_the_smooth_l1_of_each_steps_normed_output_to_the_targets_next_feature():
    """--eagle3-feature-weight W: each trained step's loss gains W x mean over its rows (every assistant
    position s = t+1+i, draftable or not) of SmoothL1(head.norm(step-i output at t), target feature at s),
    the feature whose LM-head readout is the step's cross-entropy target; steps past K stay accuracy-only."""
    import contextlib
    from eaglespec.train import ttt_losses
    model, head, ids, amask, feats, vocab = draft_vocab_batch(5)
    with torch.no_grad():
        plain = ttt_losses(head, model, ids, amask, feats, 3, contextlib.nullcontext, vocab, depth=4)
        mixed = ttt_losses(head, model, ids, amask, feats, 3, contextlib.nullcontext, vocab, depth=4, feature_weight=0.5)
        outs = head(model.embed_tokens(torch.nn.functional.pad(ids[:, 1:], (0, 1))), feats[..., 64:], ttt_steps=4)
        final = feats[..., :64]
        for i in range(4):
            want = [torch.nn.functional.smooth_l1_loss(head.norm(outs[i][b, t]), final[b, t + 1 + i]).item()
                    for b in range(2) for t in range(12) if t + 1 + i < 12 and amask[b, t + 1 + i]]
            if i < 3:
                assert mixed[i][5] == pytest.approx(sum(want) / len(want), rel=1e-5), i
                assert float(mixed[i][0]) == pytest.approx(float(plain[i][0]) + 0.5 * mixed[i][5], rel=1e-5), i
            else:
                assert mixed[i][0] is None and mixed[i][5] is None
            assert mixed[i][1:5] == plain[i][1:5]  # the counts and hits do not change


def train_on_a_fixed_batch(feature_weight: float = 0.0, steps: int = 20):
    """20 AdamW steps of an EAGLE-3 head (4 TTT steps) on one 4 x 24 batch; returns (head, each step's stats)."""
    import contextlib
    from eaglespec.train import ttt_batch_loss
    model, _ = eagle3_oracle_pair(logit_scale=3.0)
    head = random_eagle3_head(model.args, seed=8, aux_layers=(1, 0, 1))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 320, (4, 24), generator=g)
    amask = torch.ones(4, 24, dtype=torch.bool)
    with torch.no_grad():
        feats = torch.cat(model(ids, torch.arange(24)[None].expand(4, -1), logits=False, aux_layers=head.aux_layers)[::2], -1)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, betas=(0.9, 0.95))
    seen = []
    for _ in range(steps):
        loss, stats = ttt_batch_loss(head, model, ids, amask, feats, steps=4, autocast=contextlib.nullcontext,
                                     feature_weight=feature_weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(stats)
    return head, seen


def test_eagle3_feature_term_trains_the_head_towards_the_targets_features():
    _, seen = train_on_a_fixed_batch(feature_weight=1.0)
    assert seen[0]["feature_loss"] > 0 and seen[-1]["feature_loss"] < 0.7 * seen[0]["feature_loss"]
    # the logged cross-entropy is the first step's alone, not the weighted sum
    assert seen[-1]["ce_loss"] < seen[-1]["loss"] and seen[-1]["ce_loss"] > 0


def test_bf16_autocast_runs_the_step_loss_and_the_targets_argmax_in_bf16(monkeypatch):
    """Under `train --autocast bf16` the head's LM head over the draft vocabulary (forward and backward:
    most of an EAGLE-3 step's arithmetic) and the target's full-vocabulary argmax run in bf16, ~1.5x faster
    a step on a CPU with bf16 instructions; the losses stay within bf16's rounding of the fp32 ones."""
    import contextlib
    from eaglespec import train
    model, _ = eagle3_oracle_pair(logit_scale=3.0)
    ids_draft = torch.arange(0, 320, 2)
    head = random_eagle3_head(model.args, seed=7, draft_vocab=ids_draft)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 320, (2, 12), generator=g)
    amask = torch.rand(2, 12, generator=g) > 0.3
    with torch.no_grad():
        feats = torch.cat(model(ids, torch.arange(12)[None].expand(2, -1), logits=False, aux_layers=head.aux_layers)[::2], -1)
    rows = model.lm_head.weight[ids_draft].contiguous()
    seen = {"lm_head": set(), "best": set()}
    head.lm_head.register_forward_hook(lambda m, i, o: seen["lm_head"].add(o.dtype))
    best = train.target_best
    monkeypatch.setattr(train, "target_best", lambda f, n, w, memo=None: seen["best"].add(w.dtype) or best(f, n, w, memo))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    fp32 = train.ttt_losses(head, model, ids, amask, feats, 3, contextlib.nullcontext, (rows, ids_draft))
    assert seen == {"lm_head": {torch.float32}, "best": {torch.float32}}
    seen["lm_head"].clear(), seen["best"].clear()
    half = train.ttt_losses(head, model, ids, amask, feats, 3, bf16, (rows.to(torch.bfloat16), ids_draft))
    assert seen == {"lm_head": {torch.bfloat16}, "best": {torch.bfloat16}}
    for a, b in zip(fp32, half):
        assert float(b[0]) == pytest.approx(float(a[0]), rel=2e-2)
    sum(0.8 ** i * m for i, (m, *_r) in enumerate(half)).backward()  # the bf16 path trains
    assert head.lm_head.weight.grad is not None and head.lm_head.weight.grad.dtype == torch.float32


def test_the_targets_best_tokens_are_kept_per_sequence_across_epochs():
    """`target_best` with a memo: the same argmax as without, computed only for sequences it has not
    seen (a changed LM head does not change a kept answer, which shows nothing was recomputed)."""
    from eaglespec.train import target_best
    g = torch.Generator().manual_seed(5)
    w = torch.randn(50, 8, generator=g)
    final = torch.randn(9, 8, generator=g)
    plain = target_best(final, [4, 5], w)
    assert torch.equal(plain, (final @ w.T).argmax(-1))
    cache = {}
    assert torch.equal(target_best(final, [4, 5], w, (cache, ["a", "b"])), plain)
    assert sorted(cache) == ["a", "b"] and cache["a"].numel() == 4
    w2 = torch.randn(50, 8, generator=g)
    swapped = torch.cat([final[4:], final[:4]])
    again = target_best(swapped, [5, 4], w2, (cache, ["b", "a"]))
    assert torch.equal(again, torch.cat([plain[4:], plain[:4]]))
    new = target_best(final[:4], [4], w2, (cache, ["c"]))  # an unseen sequence is computed
    assert torch.equal(new, (final[:4] @ w2.T).argmax(-1))


def test_the_step_loss_is_the_same_kept_or_recomputed(monkeypatch):
    """Small batches keep the log-probabilities for backward; large ones recompute them per chunk."""
    from eaglespec import train
    model, _ = eagle3_oracle_pair(logit_scale=3.0)
    head = random_eagle3_head(model.args, seed=9, draft_vocab=torch.arange(0, 320, 2))
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(1100, 64, generator=g, requires_grad=True)  # three chunks
    p = torch.softmax(torch.randn(1100, 160, generator=g), -1)
    got = []
    for limit in (1 << 27, 0):
        monkeypatch.setattr(train, "CE_KEEP_MAX", limit)
        loss, top = train._step_ce(head, hidden, p)
        grads = torch.autograd.grad(loss, [hidden, head.lm_head.weight])
        got.append((loss.detach(), top, grads))
    (l1, t1, g1), (l2, t2, g2) = got
    assert torch.allclose(l1, l2) and torch.equal(t1, t2)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))


def test_fused_chain_attention_equals_the_written_out_one():
    """The unroll's steps 1.. on CPU: the fused kernel plus the chain's log-sum-exp merge gives the
    same output and gradients as the (B, heads, T, T) computation."""
    import math
    from eaglespec.head import chain_attention, chain_attention_reference
    g = torch.Generator().manual_seed(8)
    b, h, t, d, i = 2, 3, 9, 8, 3
    x = [torch.randn(*s, generator=g, requires_grad=True) for s in [(b, h, t, d)] * 3 + [(b, h, t, i, d)] * 2]
    w = torch.randn(b, h, t, d, generator=g)
    res = []
    for f in (chain_attention, chain_attention_reference):
        y = f(*x, 1 / math.sqrt(d))
        res.append((y,) + torch.autograd.grad((y * w).sum(), x))
    for a, r in zip(*res):
        assert torch.allclose(a, r, atol=1e-5), (a - r).abs().max()


def test_ttt_training_reduces_the_loss_on_a_fixed_batch():
    head, seen = train_on_a_fixed_batch()
    losses, stats = [s["loss"] for s in seen], seen[-1]
    assert stats["n"] == 4 * 23 and stats["feature_loss"] == 0.0
    assert all(p.grad is not None for p in head.parameters())  # lm_head and norm are trained too
    assert losses[-1] < 0.85 * losses[0] and losses == sorted(losses, reverse=True), losses


def test_output_layer_started_as_the_targets_reproduces_its_logits_on_a_final_hidden_state(tiny_checkpoint):
    """--eagle3-output-init target: the head's norm + lm_head are the target's, restricted to the draft ids,
    so a pre-norm hidden state from the target's last layer yields exactly the target's logits on them."""
    from types import SimpleNamespace
    from eaglespec.train import new_head
    model, _ = load_target(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32)
    ids = torch.tensor([0, 3, 7, 50, 120, 301])
    make = lambda init: new_head(SimpleNamespace(seed=0, eagle3_output_init=init), model, ids,  # noqa: E731
                                 default_aux_layers(model.args.num_hidden_layers))
    copied, fresh = make("target"), make("random")
    x = torch.randn(2, 5, model.args.hidden_size)
    want = model.lm_head(model.norm(x))[..., ids]
    torch.testing.assert_close(copied.lm_head(copied.norm(x)), want)
    assert not torch.allclose(fresh.lm_head(fresh.norm(x)), want)  # the official random start differs
    assert torch.equal(copied.midlayer.mlp.up_proj.weight, fresh.midlayer.mlp.up_proj.weight)  # the rest is as before


# ---- the command ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def e3(tmp_path_factory):
    """A tiny target, chats, and one complete `train --arch eagle3` run (8 steps, 3 TTT steps)."""
    from test_train import write_chats
    from eaglespec.cli import main
    from eaglespec.testing import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("e3")
    tiny, chats = make_tiny_checkpoint(root / "m"), write_chats(root / "chats.jsonl", n=24)
    common = ["train", "--model", tiny, "--data", chats, "--batch-tokens", 384, "--lr", 3e-3, "--warmup-steps", 2,
              "--seed", 1, "--arch", "eagle3", "--ttt-steps", 3, "--draft-vocab", 100, "--max-steps", 8,
              "--save-every", 3, "--eval-every", 4]
    cli = lambda *a: main([str(x) for x in a])  # noqa: E731
    out = root / "run"
    assert cli(*common, "--out", out) == 0
    return tiny, chats, common, cli, out


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_eagle3_run_reports_held_out_accuracies_and_its_head_generates_losslessly(e3):
    tiny, _, _, _, out = e3
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [4, 8]
    assert {"top1", "top3", "top1_depth2", "top1_depth3", "top1_depth4", "loss", "tokens"} <= set(metrics[-1])
    assert metrics[-1]["loss"] < metrics[0]["loss"] and metrics[-1]["feature_loss"] == 0.0
    log = read_jsonl(out / "train_log.jsonl")
    assert log[-1]["loss"] < log[0]["loss"] and log[-1]["top1"] is not None
    card = (out / "card.md").read_text()
    assert "training-time test" in card and "unrolled 3 steps" in card and "top-1 at depth 4" in card
    model, tok = load_target(str(tiny), device="cpu")
    head = load_head(out / "head", model.args)
    assert isinstance(head, Eagle3Head) and head.aux_layers == (2, 1, 0) and head.draft_ids.numel() == 100
    fresh = random_eagle3_head(model.args, seed=1)
    assert not torch.equal(head.midlayer.mlp.up_proj.weight, fresh.midlayer.mlp.up_proj.weight)
    engine = Engine.load(str(tiny), head=str(out / "head"), device="cpu")
    for text in ("the quick brown fox", "speculative decoding drafts"):
        msgs = [{"role": "user", "content": text}]
        r = engine.generate(messages=msgs, max_new_tokens=24, ignore_eos=True)
        plain = engine.generate(messages=msgs, max_new_tokens=24, ignore_eos=True, method="vanilla")
        assert r.token_ids == plain.token_ids


def test_eagle3_resume_after_a_kill_continues_on_the_same_curve(e3, tmp_path):
    tiny, chats, common, cli, ref = e3
    out = tmp_path / "killed"
    assert cli(*common, "--out", out, "--stop-after", 5) == 0  # the last checkpoint is step 3
    first = read_jsonl(out / "train_log.jsonl")
    assert cli(*common, "--out", out, "--resume") == 0
    log, want = read_jsonl(out / "train_log.jsonl"), read_jsonl(ref / "train_log.jsonl")
    assert [r["step"] for r in log] == [r["step"] for r in want]
    for r, s in zip(first + log[5:], want):
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-5, abs=1e-6), r["step"]
    from safetensors.torch import load_file
    a, b = load_file(str(out / "head" / "model.safetensors")), load_file(str(ref / "head" / "model.safetensors"))
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)


def test_eagle3_resume_as_another_arch_is_refused(e3, tmp_path, capsys):
    tiny, chats, common, cli, ref = e3
    import shutil
    out = tmp_path / "other"
    for p in ("checkpoint", "head"):
        shutil.copytree(ref / p, out / p)
    argv = [a for a in common if a not in ("--arch", "eagle3")]
    capsys.readouterr()
    assert cli(*argv, "--out", out, "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "eagle3 head" in err[-1] and "--arch" in err[-1] and "Traceback" not in "\n".join(err)
    # another unroll depth is another plan: refused unless --replan
    argv = [str(a) for a in common]
    argv[argv.index("--ttt-steps") + 1] = "5"
    assert cli(*argv, "--out", out, "--resume") == 2
    assert "ttt_steps 3 -> 5" in capsys.readouterr().err


def test_eagle3_feature_weight_run_logs_its_feature_loss_and_keeps_it_in_the_plan(e3, tmp_path, capsys):
    tiny, chats, common, cli, ref = e3
    argv = [str(a) for a in common]
    argv[argv.index("--max-steps") + 1] = "3"
    out = tmp_path / "fw"
    assert cli(*argv, "--out", out, "--eagle3-feature-weight", 0.5) == 0
    log = read_jsonl(out / "train_log.jsonl")
    assert all(r["feature_loss"] > 0 for r in log)
    assert "0.5 x SmoothL1(norm(output), target feature)" in (out / "card.md").read_text()
    capsys.readouterr()  # the weight is part of the plan: resuming with another is refused
    assert cli(*argv, "--out", out, "--resume", "--eagle3-feature-weight", 1) == 2
    assert "eagle3_feature_weight 0.5 -> 1.0" in capsys.readouterr().err
    assert cli(*argv, "--out", tmp_path / "neg", "--eagle3-feature-weight", -1) == 2
    assert "--eagle3-feature-weight must be >= 0" in capsys.readouterr().err


def test_eagle3_features_then_train_from_disk(e3, tmp_path, capsys):
    from safetensors.torch import load_file
    tiny, chats, common, cli, ref = e3
    feats = tmp_path / "f3"
    assert cli("features", "--model", tiny, "--data", chats, "--out", feats, "--shard-size", 8, "--arch", "eagle3") == 0
    manifest = json.loads((feats / "manifest.json").read_text())
    assert manifest["arch"] == "eagle3" and manifest["aux_layers"] == [2, 1, 0]
    shard = load_file(str(feats / "shard-00000.safetensors"))
    n = shard["input_ids"].numel()
    assert shard["features"].shape == (n, 64) and shard["aux_features"].shape == (n, 192)
    model, _ = load_target(str(tiny), device="cpu")
    a, b = int(shard["offsets"][0]), int(shard["offsets"][1])
    with torch.no_grad():
        f, _, aux = model(shard["input_ids"][a:b].long()[None], torch.arange(b - a)[None], logits=False,
                          aux_layers=(2, 1, 0))
    assert torch.allclose(shard["aux_features"][a:b].float(), aux[0], atol=2e-2)
    assert torch.allclose(shard["features"][a:b].float(), f[0], atol=2e-2)
    # training from disk follows the in-loop curve (fp16 features: close, not equal)
    disk = [x for x in common if x not in ("--data", chats)]
    out = tmp_path / "disk"
    capsys.readouterr()
    assert cli(*disk, "--features-dir", feats, "--out", out, "--noise", 0.3) == 0  # EAGLE-1's noise: noted, unused
    assert "--noise do(es) not apply to --arch eagle3" in capsys.readouterr().out
    for r, s in zip(read_jsonl(out / "train_log.jsonl"), read_jsonl(ref / "train_log.jsonl")):
        assert r["loss"] == pytest.approx(s["loss"], rel=2e-2)
    # --autocast bf16 runs the unrolled steps (bf16 projections beside fp32 ones into the fused chain
    # attention) and follows the fp32 curve within bf16's rounding
    half = tmp_path / "bf16"
    assert cli(*disk, "--features-dir", feats, "--out", half, "--autocast", "bf16") == 0
    for r, s in zip(read_jsonl(half / "train_log.jsonl"), read_jsonl(out / "train_log.jsonl")):
        assert r["loss"] == pytest.approx(s["loss"], rel=5e-2)
    # an EAGLE-1 run reads the same store (its first H columns); an EAGLE-1 store cannot train EAGLE-3
    assert cli("train", "--model", tiny, "--features-dir", feats, "--out", tmp_path / "e1", "--max-steps", 2,
               "--batch-tokens", 384) == 0
    plain = tmp_path / "f1"
    assert cli("features", "--model", tiny, "--data", chats, "--out", plain, "--shard-size", 8) == 0
    capsys.readouterr()
    assert cli(*disk, "--features-dir", plain, "--out", tmp_path / "bad") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no EAGLE-3 layers" in err[-1] and "Traceback" not in "\n".join(err)


def test_eagle3_two_process_ddp_matches_one_process_with_grad_accum(tmp_path):
    """torchrun (gloo, 2 CPU processes) through the unrolled forward: both ranks end identical, and
    the run equals one process with --grad-accum 2 (test_ddp's check, for EAGLE-3)."""
    from test_ddp import ddp_matches_grad_accum
    ddp_matches_grad_accum(tmp_path, ["--arch", "eagle3", "--ttt-steps", "3", "--draft-vocab", "100"], steps=3)


def test_compiled_engine_with_an_eagle3_head_matches_eager_greedy(same_or_tie):
    """The static-shape compiled target (three layers out), catch-up (first) and expand (step) calls."""
    model, head = eagle3_oracle_pair(noise=0.3, logit_scale=3.0)
    compiled = Engine(model, head=head, tree=TreeConfig(total_tokens=8), max_context=256, compile="default")
    accepted = 0
    for seed in range(2):
        prompt = torch.randint(3, 320, (10 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = run(Engine(model), prompt, "vanilla").token_ids
        r = run(compiled, prompt)
        same_or_tie(model, prompt, r.token_ids, want)
        accepted += max(r.accept_lengths) > 2
    assert accepted >= 1


def test_engine_load_builds_a_random_eagle3_head(tiny_checkpoint, same_or_tie):
    """`--head random-eagle3` (Engine.load's "random-eagle3"): an untrained EAGLE-3 head on the official
    layers, e.g. to time EAGLE-3 drafting before any head is trained; greedy output is plain decoding's."""
    engine = Engine.load(str(tiny_checkpoint("llama")), head="random-eagle3", device="cpu")
    assert isinstance(engine.head, Eagle3Head) and engine.head_source == "random-eagle3"
    assert engine.head.aux_layers == default_aux_layers(engine.model.args.num_hidden_layers)
    prompt = [3, 17, 5, 9]
    want = engine.generate(input_ids=prompt, method="vanilla", max_new_tokens=20, ignore_eos=True).token_ids
    got = engine.generate(input_ids=prompt, method="eagle", max_new_tokens=20, ignore_eos=True).token_ids
    same_or_tie(engine.model, prompt, got, want)
