"""Head checkpoint formats in and out (eaglespec/formats.py, eaglespec/export.py).

In: small checkpoints built in each published layout, with the key names and config fields of the code
that writes them, load unchanged and generate exactly what plain decoding does; a payload that needs
full unpickling is refused in one line; a head that does not fit the target is a one-line error.
Out: `eaglespec export` writes folders whose keys, shapes, dtypes and config fields are what vLLM's and
SGLang's loaders read (their name mapping transcribed below), and loading them back gives the same drafts.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglespec.cli import main
from eaglespec.engine import Engine
from eaglespec.formats import detect_format
from eaglespec.head import Eagle3Head, EagleHead, load_head, random_eagle3_head, random_head
from eaglespec.loading import load_target
from eaglespec.testing import oracle_pair

NEW = 16

# ---- tables transcribed from the public code ------------------------------------------------------

# Official EAGLE-1/2 heads: SafeAILab/EAGLE eagle/model/cnets.py, Model (embed_tokens, fc with `bias`,
# layers[0] = LlamaDecoderLayer without input_layernorm); ea_model.py reads config["bias"] (default True).
EAGLE1_LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "post_attention_layernorm.weight"]
# Official EAGLE-3 heads: eagle/traineagle3/cnets.py, Model (midlayer = LlamaDecoderLayeremb with hidden_norm and
# input_layernorm, fc 3H->H without bias, norm, lm_head over draft_vocab_size, buffers d2t and t2d); SpecForge
# specforge/modeling/draft/llama3_eagle.py LlamaForCausalLMEagle3 has the same names (it also holds
# embed_tokens, which scripts/train_eagle3.py filters out before save_pretrained).
EAGLE3_LAYER = EAGLE1_LAYER + ["input_layernorm.weight", "hidden_norm.weight"]
EAGLE3_TOP = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
# speculators (vllm-project/speculators): src/speculators/models/eagle.py EagleSpeculator (fusion_fc,
# transformer = the decoder layer with an Identity input norm); models/eagle3.py Eagle3Speculator
# (embed_tokens, fc, layers.0, norm, lm_head, d2t, t2d), which convert/eagle/eagle3_converter.py fills from
# an official checkpoint (midlayer.* -> layers.0.*, the verifier's embed_tokens added).

# vLLM's stacked-parameter mapping (vllm/model_executor/models/llama_eagle3.py and llama_eagle.py load_weights)
# and SGLang's (python/sglang/srt/models/llama_eagle3.py, llama_eagle.py): q/k/v -> qkv_proj, gate/up -> gate_up_proj.
STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


def vllm_eagle3_params(h, heads, kv, hd, inter, draft_vocab, target_h):
    """Eagle3LlamaForCausalLM's parameters (name -> shape) for one layer (llama_eagle3.py: qkv_proj reads
    2*hidden_size, fc reads 3*target_hidden_size, lm_head over draft_vocab_size, draft_id_to_target_id)."""
    p = "model.layers.0."
    return {"model.fc.weight": (h, 3 * target_h), p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, 2 * h),
            p + "self_attn.o_proj.weight": (h, heads * hd), p + "mlp.gate_up_proj.weight": (2 * inter, h),
            p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,), "model.norm.weight": (h,),
            "lm_head.weight": (draft_vocab, h), "draft_id_to_target_id": (draft_vocab,)}


def vllm_eagle3_name(name):
    """Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights: t2d dropped, d2t renamed, midlayer. ->
    layers.0., "model." prefixed unless lm_head, stacked names merged. None = skipped."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    name = name.replace("midlayer.", "layers.0.")
    if "lm_head" not in name:
        name = "model." + name
    for param, shard in STACKED:
        if shard in name:
            return name.replace(shard, param)
    return name


def sglang_eagle3_params(h, heads, kv, hd, inter, draft_vocab, target_h):
    """LlamaForCausalLMEagle3's parameters (llama_eagle3.py: self.model.midlayer, fc bias only if config.bias,
    qkv_proj on 2*hidden_size without bias, lm_head over draft_vocab_size; d2t becomes hot_token_id)."""
    p = "model.midlayer."
    return {"model.fc.weight": (h, 3 * target_h), p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, 2 * h),
            p + "self_attn.o_proj.weight": (h, heads * hd), p + "mlp.gate_up_proj.weight": (2 * inter, h),
            p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,), "model.norm.weight": (h,), "lm_head.weight": (draft_vocab, h)}


def sglang_name(name, params):
    """SGLang's load_weights: d2t -> hot_token_id, t2d skipped, stacked merged, "model." added when the bare name
    is not a parameter; a name matching no parameter is skipped silently (returned as None here)."""
    if "d2t" in name:
        return "hot_token_id"
    if "t2d" in name:
        return None
    for param, shard in STACKED:
        if shard in name:
            name = name.replace(shard, param)
            break
    name = name if name in params else f"model.{name}"
    return name if name in params else None


def vllm_eagle1_params(h, heads, kv, hd, inter, layers=1):
    """EagleLlamaForCausalLM (llama_eagle.py): fc 2H->H with bias=False, config.num_hidden_layers decoder layers,
    layer 0 with an Identity input norm and the others with an RMSNorm; names not among its parameters are
    skipped, embed_tokens shared with the target."""
    out = {"model.fc.weight": (h, 2 * h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, h),
                    p + "self_attn.o_proj.weight": (h, heads * hd), p + "mlp.gate_up_proj.weight": (2 * inter, h),
                    p + "mlp.down_proj.weight": (h, inter), p + "post_attention_layernorm.weight": (h,),
                    **({p + "input_layernorm.weight": (h,)} if i else {})})
    return out


def vllm_eagle1_name(name):
    name = {"fusion_fc.weight": "fc.weight", "fusion_fc.bias": "fc.bias"}.get(name, name)
    if "lm_head" not in name:
        name = "model." + name
    for param, shard in STACKED:
        if shard in name:
            return name.replace(shard, param)
    return name


def sglang_eagle1_params(h, heads, kv, hd, inter, layers=1):
    """SGLang's LlamaForCausalLMEagle (llama_eagle.py): fc = nn.Linear(2H, H) (with a bias), layers as vLLM's
    (layer 0 without an input norm); every name gets "model." unless it holds lm_head."""
    return {**vllm_eagle1_params(h, heads, kv, hd, inter, layers), "model.fc.bias": (h,)}


def vllm_speculators_config(cfg):
    """vLLM's SpeculatorsConfig: validate_speculators_config, then the transformer_layer_config plus
    update_eagle3's fields (vllm/transformers_utils/configs/speculators/{base,algos}.py)."""
    spec = cfg["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] >= 1
    assert spec["verifier"]["name_or_path"]
    assert isinstance(cfg["transformer_layer_config"], dict)
    out = dict(cfg["transformer_layer_config"])
    out["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    out["norm_before_residual"] = cfg.get("norm_before_residual", True)
    out["architectures"] = [{"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}[
        out.get("model_type", "llama")]]
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    return out


# ---- fixtures and helpers ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    """Six layers, so EAGLE-3's default layers (2, 3, 3) lie inside what vLLM and SGLang can capture."""
    folder = tiny_checkpoint("llama", num_hidden_layers=6)
    model, _ = load_target(folder, device="cpu", dtype=torch.float32)
    return model, folder


def layout(cfg_arch, args, **extra):
    """A LlamaConfig-style config.json as the official and SpecForge heads write it."""
    return {"architectures": [cfg_arch], "model_type": "llama", "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size, "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": args.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": args.vocab_size,
            "rms_norm_eps": args.rms_norm_eps, "max_position_embeddings": args.max_position_embeddings,
            "hidden_act": "silu", "pad_token_id": 0, "torch_dtype": "float16", "transformers_version": "4.28.1",
            "use_cache": True, "tie_word_embeddings": False, **extra}


def write(folder, cfg, sd, bin_file=False):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in sd.items()}
    if bin_file:
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def probe_logits(head, model, seed=0):
    """The head's draft logits on fixed random inputs: first step on target features, then one step on its own
    output. Two heads draft identically iff these agree."""
    g = torch.Generator().manual_seed(seed)
    h, t = model.args.hidden_size, 7
    n_feat = 3 if getattr(head, "arch", "eagle") == "eagle3" else 1
    embeds = model.embed_tokens(torch.randint(0, model.args.vocab_size, (1, t), generator=g))
    feats = torch.randn(1, t, n_feat * h, generator=g)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        out1 = head.first(embeds, feats, pos)
        out2 = head.step(embeds, out1, pos)
        ids = head.draft_ids
        rows = model.lm_head.weight if ids is None else model.lm_head.weight[ids]
        return torch.cat([head.draft_logits(out1, rows), head.draft_logits(out2, rows)], dim=1)


def prompts(n=4, seed=5, vocab=320):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 24, (n,), generator=g)]


def assert_lossless(model, head, same_or_tie, n=4):
    plain, spec = Engine(model), Engine(model, head=head)
    taus = []
    for p in prompts(n):
        want = plain.generate(input_ids=p, method="vanilla", max_new_tokens=NEW, ignore_eos=True).token_ids
        r = spec.generate(input_ids=p, method="eagle", max_new_tokens=NEW, ignore_eos=True)
        assert r.new_tokens == NEW
        same_or_tie(model, p, r.token_ids, want)
        taus.append(r.tau)
    return sum(taus) / len(taus)


def official_eagle1(head, embed, bias_key=True):
    """EagleHead's tensors as SafeAILab/EAGLE's Model state dict: embed_tokens, fc, layers.0.* (no input norm)."""
    sd = {k: v.clone() for k, v in head.state_dict().items()}
    sd["embed_tokens.weight"] = embed.clone()
    if not bias_key:
        sd.pop("fc.bias", None)
    return sd


# ---- in: every published layout loads and generates losslessly -----------------------------------

def test_official_eagle1_pytorch_model_bin_loads_and_accepts_drafts(tmp_path, same_or_tie):
    """A Vicuna-style head: pytorch_model.bin (weights_only), fc with bias, an embed_tokens copy ignored."""
    model, head = oracle_pair(noise=0.3, logit_scale=3.0)
    cfg = layout("LlamaForCausalLM", model.args, bias=True)
    folder = write(tmp_path / "eagle1", cfg, official_eagle1(head, model.embed_tokens.weight), bin_file=True)
    loaded = load_head(folder, model.args)
    assert isinstance(loaded, EagleHead) and loaded.bias
    assert torch.equal(probe_logits(loaded, model), probe_logits(head, model))
    assert assert_lossless(model, loaded, same_or_tie, n=6) > 1.3  # drafts accepted: the weights are the head's


def test_official_eagle1_without_bias_loads_from_safetensors(tmp_path, target, same_or_tie):
    """A LLaMA3-style head: "bias": false, no fc.bias, model.safetensors."""
    model, _ = target
    head = random_head(model.args, seed=3, bias=False)
    folder = write(tmp_path / "eagle1", layout("LlamaForCausalLM", model.args, bias=False),
                   official_eagle1(head, model.embed_tokens.weight, bias_key=False))
    loaded = load_head(folder, model.args)
    assert not loaded.bias and detect_format(json.loads((folder / "config.json").read_text()),
                                             load_file(str(folder / "model.safetensors"))) == "eagle"
    assert torch.equal(probe_logits(loaded, model), probe_logits(head, model))
    assert_lossless(model, loaded, same_or_tie)


def official_eagle3(head):
    """Eagle3Head's tensors in the official layout, asserted against the table (not just passed through)."""
    sd = {k: v.clone() for k, v in head.state_dict().items()}
    assert set(sd) == set(EAGLE3_TOP) | {"midlayer." + k for k in EAGLE3_LAYER}
    return sd


@pytest.mark.parametrize("writer", ["official-bin", "specforge"])
def test_official_and_specforge_eagle3_heads_load_and_are_lossless(writer, tmp_path, target, same_or_tie):
    model, _ = target
    ids = torch.arange(0, model.args.vocab_size, 3)
    head = random_eagle3_head(model.args, seed=4, draft_vocab=ids)
    sd = official_eagle3(head)
    if writer == "official-bin":  # the released yuhuili/EAGLE3-* heads: pytorch_model.bin, config as below
        cfg = layout("LlamaForCausalLMEagle3", model.args, draft_vocab_size=ids.numel())
        folder = write(tmp_path / writer, cfg, sd, bin_file=True)
    else:  # SpecForge's save_pretrained: safetensors, its draft config (configs/*-eagle3.json), eagle_config
        aux = list(head.aux_layers)
        cfg = layout("LlamaForCausalLMEagle3", model.args, draft_vocab_size=ids.numel(), torch_dtype="bfloat16",
                     eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                                   "use_aux_hidden_state": True})
        folder = write(tmp_path / writer, cfg, {k: (v.bfloat16() if v.is_floating_point() else v)
                                                for k, v in sd.items()})
        head = head.to(torch.bfloat16).float()  # compare with what the bf16 file holds
    loaded = load_head(folder, model.args)
    assert isinstance(loaded, Eagle3Head) and loaded.aux_layers == head.aux_layers
    assert torch.equal(loaded.draft_ids, ids)
    assert torch.equal(probe_logits(loaded, model), probe_logits(head, model))
    assert_lossless(model, loaded, same_or_tie)


@pytest.mark.parametrize("names", ["speculators", "vllm"])
def test_speculators_eagle3_checkpoint_loads_and_is_lossless(names, tmp_path, target, same_or_tie):
    """speculators' keys; "vllm": with d2t under vLLM's name draft_id_to_target_id and t2d dropped, as vLLM does."""
    model, _ = target
    head = random_eagle3_head(model.args, seed=6, draft_vocab=torch.arange(0, model.args.vocab_size, 2))
    sd = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in official_eagle3(head).items()}
    sd["embed_tokens.weight"] = model.embed_tokens.weight.clone()
    if names == "vllm":
        sd["draft_id_to_target_id"] = sd.pop("d2t")
        del sd["t2d"]
    a = model.args
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
           "draft_vocab_size": int(head.d2t.numel()), "norm_before_residual": False, "target_hidden_size": None,
           "transformer_layer_config": {"model_type": "llama", "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
                                        "intermediate_size": a.intermediate_size, "num_hidden_layers": 1,
                                        "num_attention_heads": a.num_attention_heads,
                                        "num_key_value_heads": a.num_key_value_heads, "rms_norm_eps": a.rms_norm_eps,
                                        "max_position_embeddings": a.max_position_embeddings,
                                        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                  "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    loaded = load_head(write(tmp_path / "spec3", cfg, sd), model.args)
    assert isinstance(loaded, Eagle3Head)
    assert torch.equal(probe_logits(loaded, model), probe_logits(head, model))
    assert_lossless(model, loaded, same_or_tie)


def test_speculators_eagle1_checkpoint_loads_and_is_lossless(tmp_path, target, same_or_tie):
    model, _ = target
    head = random_head(model.args, seed=7)
    sd = {("fusion_fc." + k[3:] if k.startswith("fc.") else "transformer." + k[9:]): v.clone()
          for k, v in head.state_dict().items()}
    cfg = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
           "transformer_layer_architecture": "LlamaDecoderLayer", "layernorms": False, "fusion_bias": True,
           "transformer_layer_config": {"model_type": "llama", **{k: getattr(model.args, k) for k in (
               "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "rms_norm_eps")}, "num_hidden_layers": 1},
           "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                  "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    loaded = load_head(write(tmp_path / "spec1", cfg, sd), model.args)
    assert isinstance(loaded, EagleHead) and loaded.bias
    assert torch.equal(probe_logits(loaded, model), probe_logits(head, model))
    assert_lossless(model, loaded, same_or_tie)


class _Payload:
    """What a malicious pytorch_model.bin pickles: unpickling it would call open(marker, "w")."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_only_payload_is_refused_without_running_it(tmp_path, target, capsys):
    model, _ = target
    head = random_head(model.args)
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(layout("LlamaForCausalLM", model.args)))
    marker = tmp_path / "ran"
    torch.save({**head.state_dict(), "extra": _Payload(str(marker))}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError) as info:
        load_head(folder, model.args)
    msg = str(info.value)
    assert "\n" not in msg and "full unpickling" in msg and "pytorch_model.bin" in msg
    assert not marker.exists()
    # and through the CLI: one line, exit 2
    code = main(["export", str(folder), "--format", "eagle", "--out", str(tmp_path / "o"), "--model",
                 str(target[1])])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "full unpickling" in err and not marker.exists()


def test_heads_that_do_not_fit_are_one_line_errors(tmp_path, target, tiny_checkpoint):
    model, _ = target
    narrow, _ = load_target(tiny_checkpoint("llama", hidden_size=32), device="cpu")
    cases = {}
    # an EAGLE-3 head for a narrower target: its config and fc say hidden 32
    cases["hidden"] = (write(tmp_path / "h", layout("LlamaForCausalLMEagle3", narrow.args),
                             official_eagle3(random_eagle3_head(narrow.args))), "head hidden_size 32 != target 64")
    # right hidden size, t2d over another vocabulary
    sd = official_eagle3(random_eagle3_head(model.args))
    sd["t2d"] = torch.ones(400, dtype=torch.bool)
    cases["vocab"] = (write(tmp_path / "v", layout("LlamaForCausalLMEagle3", model.args), sd),
                      "head vocab_size (t2d length) 400 != target 320")
    # an EAGLE-1 fc (2H wide) under an EAGLE-3 config
    sd = official_eagle3(random_eagle3_head(model.args))
    sd["fc.weight"] = sd["fc.weight"][:, :128]
    cases["fc"] = (write(tmp_path / "f", layout("LlamaForCausalLMEagle3", model.args), sd),
                   "fc.weight input width")
    # speculators HASS variant: extra norms our head does not have
    cases["hass"] = (write(tmp_path / "s", {"speculators_model_type": "eagle", "layernorms": True,
                                            "transformer_layer_config": {"hidden_size": 64}},
                           {"fusion_fc.weight": torch.zeros(64, 128)}), "HASS")
    for name, (folder, want) in cases.items():
        with pytest.raises(ValueError) as info:
            load_head(folder, model.args)
        assert "\n" not in str(info.value) and want in str(info.value), (name, str(info.value))


# ---- out: export, conformance with the loaders, round trip -----------------------------------------

def export(tmp_path, head_folder, fmt, model_folder, *extra):
    out = tmp_path / f"out-{fmt}"
    code = main(["export", str(head_folder), "--format", fmt, "--out", str(out), "--model", str(model_folder),
                 *map(str, extra)])
    assert code == 0
    return out, json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def covered(sd, name_map, params):
    """Map every exported tensor onto the engine's parameters; return {param: [tensors]} (shape-checked)."""
    hits = {}
    for k, v in sd.items():
        name = name_map(k)
        if name is None or name in ("hot_token_id",):
            continue
        assert name in params, f"{k} -> {name} is not a parameter of the engine's model"
        hits.setdefault(name, []).append(tuple(v.shape))
    for name, shapes in hits.items():
        want = params[name]
        if len(shapes) == 1:
            assert shapes[0] == want, (name, shapes, want)
        else:  # stacked: rows add up, widths agree
            assert sum(s[0] for s in shapes) == want[0] and all(s[1:] == want[1:] for s in shapes), (name, shapes)
    return hits


@pytest.fixture(scope="module")
def eagle3_head_folder(target, tmp_path_factory):
    model, _ = target
    head = random_eagle3_head(model.args, seed=8, draft_vocab=torch.arange(1, model.args.vocab_size, 4))
    folder = tmp_path_factory.mktemp("e3") / "head"
    head.save(folder)
    return head, folder


def test_eagle3_export_is_what_sglang_and_vllm_load(tmp_path, target, eagle3_head_folder):
    model, model_folder = target
    head, folder = eagle3_head_folder
    out, cfg, sd = export(tmp_path, folder, "eagle3", model_folder)
    a, dv = model.args, int(head.d2t.numel())
    dims = (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.intermediate_size, dv,
            a.hidden_size)
    # keys: the official layout, which SGLang needs by name (it skips layers.0.* silently)
    assert set(sd) == set(EAGLE3_TOP) | {"midlayer." + k for k in EAGLE3_LAYER}
    sg = sglang_eagle3_params(*dims)
    assert set(covered(sd, lambda k: sglang_name(k, sg), sg)) == set(sg)
    vl = vllm_eagle3_params(*dims)
    assert set(covered(sd, vllm_eagle3_name, vl)) == set(vl)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["fc.weight"].dtype == torch.float32
    # config fields as the loaders read them
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == dv and cfg["vocab_size"] == a.vocab_size and cfg["num_hidden_layers"] == 1
    assert cfg["bias"] is False and cfg["attention_bias"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["norm_before_residual"] is False and cfg["target_hidden_size"] == a.hidden_size
    assert cfg["head_dim"] == a.head_dim and cfg["rms_norm_eps"] == a.rms_norm_eps
    # the three layers: vLLM's top-level ids are entered layers, SGLang's nested ids + 1 are
    assert tuple(cfg["eagle_aux_hidden_state_layer_ids"]) == head.aux_layers
    assert tuple(i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == head.aux_layers
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    # round trip: the same drafts
    back = load_head(out, model.args)
    assert torch.equal(probe_logits(back, model), probe_logits(head, model))


def test_speculators_export_is_what_vllm_loads(tmp_path, target, eagle3_head_folder):
    model, model_folder = target
    head, folder = eagle3_head_folder
    out, cfg, sd = export(tmp_path, folder, "speculators", model_folder, "--verifier", "org/tiny",
                          "--speculative-tokens", 3)
    a, dv = model.args, int(head.d2t.numel())
    assert set(sd) == set(EAGLE3_TOP) | {"layers.0." + k for k in EAGLE3_LAYER} | {"embed_tokens.weight"}
    assert torch.equal(sd["embed_tokens.weight"], model.embed_tokens.weight)
    vl = {**vllm_eagle3_params(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                               a.intermediate_size, dv, a.hidden_size),
          "model.embed_tokens.weight": (a.vocab_size, a.hidden_size)}
    assert set(covered(sd, vllm_eagle3_name, vl)) == set(vl)
    pre = vllm_speculators_config(cfg)
    assert pre["architectures"] == ["Eagle3LlamaForCausalLM"] and pre["draft_vocab_size"] == dv
    assert pre["norm_before_residual"] is False  # written: vLLM would default a missing one to True
    assert tuple(pre["eagle_aux_hidden_state_layer_ids"]) == head.aux_layers
    assert pre["hidden_size"] == a.hidden_size and pre["vocab_size"] == a.vocab_size
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    back = load_head(out, model.args)
    assert torch.equal(probe_logits(back, model), probe_logits(head, model))


def test_eagle1_export_is_what_vllm_and_sglang_load(tmp_path, target, capsys):
    model, model_folder = target
    head = random_head(model.args, seed=9, draft_vocab=torch.arange(0, model.args.vocab_size, 2))
    head.save(tmp_path / "head")
    out, cfg, sd = export(tmp_path, tmp_path / "head", "eagle", model_folder)
    err = capsys.readouterr().err
    assert "non-zero bias" in err and "vLLM" in err and "draft vocabulary" in err
    a = model.args
    dims = (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.intermediate_size)
    assert set(sd) == {"fc.weight", "fc.bias"} | {"layers.0." + k for k in EAGLE1_LAYER}
    vl = vllm_eagle1_params(*dims)
    assert set(covered({k: v for k, v in sd.items() if k != "fc.bias"}, vllm_eagle1_name, vl)) == set(vl)  # vLLM skips fc.bias
    sg = sglang_eagle1_params(*dims)
    assert set(covered(sd, lambda k: sglang_name(k, sg), sg)) == set(sg)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"]
    # `bias` is the attention bias for both engines' Llama layers: must be false
    assert cfg["bias"] is False and cfg["attention_bias"] is False and cfg["qkv_bias"] is False
    back = load_head(out, model.args)  # the full-vocabulary version of the same head
    full = EagleHead(head.args, bias=True)
    full.load_state_dict({k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")})
    assert torch.equal(probe_logits(back, model), probe_logits(full, model))


def test_a_two_layer_eagle1_head_loads_exports_and_is_lossless(tmp_path, target, capsys, same_or_tie):
    """A head of two layers (train --head-layers 2) in the official layout (layers.1 with an input norm, config
    num_hidden_layers 2): it loads, generates losslessly, exports with every tensor mapped onto vLLM's and SGLang's
    two-layer parameters, and loads back drafting the same. A config that names another layer count is refused."""
    model, model_folder = target
    head = random_head(model.args, seed=4, layers=2)
    with torch.no_grad():
        head.layers[1].input_layernorm.weight.uniform_(0.5, 1.5)  # not the identity, so a dropped norm would show
    head.save(tmp_path / "head")
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    loaded = load_head(tmp_path / "head", model.args)
    assert len(loaded.layers) == 2 and torch.equal(probe_logits(loaded, model), probe_logits(head, model))
    assert_lossless(model, loaded, same_or_tie)
    out, cfg, sd = export(tmp_path, tmp_path / "head", "eagle", model_folder)
    capsys.readouterr()
    a = model.args
    dims = (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.intermediate_size)
    assert cfg["num_hidden_layers"] == 2
    vl = vllm_eagle1_params(*dims, layers=2)
    assert set(covered({k: v for k, v in sd.items() if k != "fc.bias"}, vllm_eagle1_name, vl)) == set(vl)
    sg = sglang_eagle1_params(*dims, layers=2)
    assert set(covered(sd, lambda k: sglang_name(k, sg), sg)) == set(sg)
    assert torch.equal(probe_logits(load_head(out, model.args), model), probe_logits(head, model))
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers 1.*2 layers"):
        load_head(out, model.args)


def test_eagle1_export_of_a_head_without_fc_bias_gives_sglang_zeros(tmp_path, target, capsys):
    model, model_folder = target
    random_head(model.args, seed=2, bias=False).save(tmp_path / "head")
    _, _, sd = export(tmp_path, tmp_path / "head", "eagle", model_folder)
    assert torch.equal(sd["fc.bias"], torch.zeros(model.args.hidden_size))
    assert "warning" not in capsys.readouterr().err


def test_bfloat16_export_keeps_maps_exact(tmp_path, target, eagle3_head_folder):
    model, model_folder = target
    head, folder = eagle3_head_folder
    _, cfg, sd = export(tmp_path, folder, "eagle3", model_folder, "--dtype", "bfloat16")
    assert cfg["torch_dtype"] == "bfloat16" and sd["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["d2t"], head.d2t) and torch.equal(sd["t2d"], head.t2d)


def test_export_refuses_what_the_engines_cannot_serve(tmp_path, target, tiny_checkpoint, eagle3_head_folder,
                                                      capsys):
    model, model_folder = target
    random_head(model.args).save(tmp_path / "e1")
    shallow = tiny_checkpoint("llama")  # two layers: EAGLE-3's defaults clamp to (2, 1, 0)
    shallow_model, _ = load_target(shallow, device="cpu")
    random_eagle3_head(shallow_model.args).save(tmp_path / "shallow")
    cases = [(tmp_path / "e1", "eagle3", model_folder, "use --format eagle"),
             (tmp_path / "e1", "speculators", model_folder, "use --format eagle"),
             (eagle3_head_folder[1], "eagle", model_folder, "use --format eagle3"),
             (tmp_path / "shallow", "eagle3", shallow, "cannot be served")]
    capsys.readouterr()  # building the shallow checkpoint printed progress bars
    for head_folder, fmt, mf, want in cases:
        code = main(["export", str(head_folder), "--format", fmt, "--out", str(tmp_path / f"x-{fmt}"),
                     "--model", str(mf)])
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1 and want in err, err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    code = main(["export", str(eagle3_head_folder[1]), "--format", "eagle3", "--out", str(tmp_path / "full"),
                 "--model", str(model_folder)])
    assert code == 2 and "not empty" in capsys.readouterr().err


def test_exported_eagle3_head_generates_losslessly(tmp_path, target, eagle3_head_folder, same_or_tie):
    model, model_folder = target
    out, _, _ = export(tmp_path, eagle3_head_folder[1], "speculators", model_folder)
    assert_lossless(model, load_head(out, model.args), same_or_tie)


def test_sharded_checkpoint_with_model_prefix_loads(tmp_path, target):
    """save_pretrained of a bigger head: model.safetensors.index.json over shards, keys under `model.`."""
    model, _ = target
    head = random_head(model.args, seed=11)
    sd = {"model." + k: v.clone() for k, v in head.state_dict().items()}
    folder = tmp_path / "sharded"
    folder.mkdir()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (folder / "config.json").write_text(json.dumps(layout("LlamaForCausalLMEagle", model.args, bias=True)))
    assert torch.equal(probe_logits(load_head(folder, model.args), model), probe_logits(head, model))


@pytest.mark.parametrize("fmt", ["eagle3", "eagle"])
def test_exported_config_reads_as_the_engines_read_it(fmt, tmp_path, target, eagle3_head_folder):
    """vLLM and SGLang read a draft folder's config through transformers' AutoConfig: it must parse to a
    LlamaConfig that keeps the fields they look up as attributes."""
    from transformers import AutoConfig, LlamaConfig
    model, model_folder = target
    if fmt == "eagle3":
        folder = eagle3_head_folder[1]
    else:
        folder = tmp_path / "e1"
        random_head(model.args).save(folder)
    out, _, _ = export(tmp_path, folder, fmt, model_folder)
    cfg = AutoConfig.from_pretrained(str(out))
    assert isinstance(cfg, LlamaConfig) and cfg.hidden_size == model.args.hidden_size
    assert cfg.num_hidden_layers == 1 and cfg.head_dim == model.args.head_dim and not cfg.tie_word_embeddings
    assert getattr(cfg, "attention_bias", False) is False and getattr(cfg, "bias", None) is False
    if fmt == "eagle3":
        assert cfg.draft_vocab_size == int(eagle3_head_folder[0].d2t.numel())
        assert cfg.eagle_config["use_aux_hidden_state"] is True and cfg.norm_before_residual is False
        assert list(cfg.eagle_aux_hidden_state_layer_ids) == list(eagle3_head_folder[0].aux_layers)


def test_head_rope_comes_from_its_own_config(tmp_path, target):
    """The draft layer's RoPE is what the head's config says, LlamaConfig's defaults where it says nothing (as
    the official code, vLLM and SGLang build it), not the target's; transformers 5's rope_parameters count."""
    import dataclasses
    model, _ = target
    args = dataclasses.replace(model.args, rope_theta=100000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    sd = official_eagle3(random_eagle3_head(args))
    silent = load_head(write(tmp_path / "silent", layout("LlamaForCausalLMEagle3", args), sd), args)
    assert silent.args.rope_theta == 10000.0 and silent.args.rope_scaling is None
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    v5 = load_head(write(tmp_path / "v5", layout("LlamaForCausalLMEagle3", args, rope_parameters=llama3), sd), args)
    assert v5.args.rope_theta == 500000.0 and v5.args.rope_scaling["rope_type"] == "llama3"
    assert not torch.equal(v5.rotary.inv_freq, silent.rotary.inv_freq)
    random_head(args).save(tmp_path / "ours")  # our own heads write both fields: the target's
    ours = load_head(tmp_path / "ours", args)
    assert ours.args.rope_theta == 100000.0 and ours.args.rope_scaling == args.rope_scaling


def test_full_vocabulary_eagle3_head_without_maps_loads(tmp_path, target, same_or_tie):
    """draft_vocab_size == vocab_size (e.g. the Vicuna EAGLE-3 heads): the official loader deletes d2t/t2d
    (ea_model.py), so a checkpoint may lack them; the head then drafts over the whole vocabulary."""
    model, _ = target
    head = random_eagle3_head(model.args, seed=12)
    sd = {k: v for k, v in official_eagle3(head).items() if k not in ("d2t", "t2d")}
    cfg = layout("LlamaForCausalLMEagle3", model.args, draft_vocab_size=model.args.vocab_size)
    loaded = load_head(write(tmp_path / "full", cfg, sd, bin_file=True), model.args)
    assert loaded.draft_ids is None
    assert torch.equal(probe_logits(loaded, model), probe_logits(head, model))
    assert_lossless(model, loaded, same_or_tie, n=2)
    # a reduced lm_head without the map saying which tokens it drafts is refused
    sd["lm_head.weight"] = sd["lm_head.weight"][:100]
    with pytest.raises(ValueError, match="no d2t map"):
        load_head(write(tmp_path / "nomap", {**cfg, "draft_vocab_size": 100}, sd), model.args)
