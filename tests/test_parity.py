"""Our Transformer gives transformers' own logits (fp32, |delta| <= 1e-4) for every supported family:
plain prefill, prefill into the KV cache then one-token decoding, tree attention through the cache,
and a GGUF file written from an HF model (llama.cpp's layout) loads back to the same model."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglespec.loading import load_target, load_tokenizer
from eaglespec.model import ModelArgs, rope_inv_freq
from eaglespec.testing import FAMILIES, tiny_tokenizer
from eaglespec.tree import ancestor_mask

TOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES = {f: (f, {}) for f in FAMILIES} | {"llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE})}


def random_ids(n: int, seed: int = 0, vocab: int = 320) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids).logits[0].float()


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def models(request, tiny_checkpoint):
    family, overrides = CASES[request.param]
    folder = tiny_checkpoint(family, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours, _ = load_target(folder, device="cpu", dtype=torch.float32)
    return request.param, hf, ours


def test_prefill_matches_transformers(models):
    _, hf, ours = models
    ids = random_ids(80)  # past llama3-rope's original context (64), where its scaling shows most
    with torch.inference_mode():
        _, got = ours(ids, torch.arange(ids.shape[1])[None])
    assert (got[0] - hf_logits(hf, ids)).abs().max() <= TOL


def test_cached_decode_matches_transformers(models):
    """Prefill at cache_start=0, then a chunk at cache_start>0 (causal over the cache), then one token a step."""
    _, hf, ours = models
    ids = random_ids(40, seed=1)
    want = hf_logits(hf, ids)
    ours.setup_cache(64)
    got = []
    with torch.inference_mode():
        for start, end in [(0, 20), (20, 28)] + [(t, t + 1) for t in range(28, 40)]:
            _, lg = ours(ids[:, start:end], torch.arange(start, end)[None], cache_start=start)
            got.append(lg[0])
    assert (torch.cat(got) - want).abs().max() <= TOL


def test_tree_attention_matches_each_path(models):
    """Tree nodes written into the cache with an ancestor mask (positions = prefix + depth) get the
    logits of their own root-to-node path, as verification assumes."""
    _, hf, ours = models
    prefix = random_ids(12, seed=2)[0].tolist()
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 7]
    tokens = random_ids(len(parents), seed=3)[0]
    depths = [0] * len(parents)
    for i, p in enumerate(parents):
        depths[i] = depths[p] + 1 if p >= 0 else 0
    ours.setup_cache(64)
    n, cur = len(parents), len(prefix)
    mask = torch.cat([torch.ones(n, cur, dtype=torch.bool), ancestor_mask(torch.tensor(parents))], dim=1)
    with torch.inference_mode():
        ours(torch.tensor([prefix]), torch.arange(cur)[None], cache_start=0)
        _, lg = ours(tokens[None], (cur + torch.tensor(depths))[None], mask=mask, cache_start=cur)
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.insert(0, int(tokens[j]))
            j = parents[j]
        want = hf_logits(hf, torch.tensor([prefix + path]))[-1]
        assert (lg[0, i] - want).abs().max() <= TOL, f"node {i}"


def test_llama3_rope_scaling_is_applied(tiny_checkpoint):
    ours, _ = load_target(tiny_checkpoint("llama", rope_scaling=LLAMA3_ROPE), device="cpu", dtype=torch.float32)
    assert ours.args.rope_scaling["rope_type"] == "llama3"
    plain = rope_inv_freq(ModelArgs(**{**ours.args.to_dict(), "rope_scaling": None}))
    assert not torch.allclose(ours.rotary.inv_freq, plain)  # else the parity above proves nothing about it


# ---- GGUF ----------------------------------------------------------------------------------------

GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's q/k row order: each head's rotate-half halves become interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf, tokenizer, path) -> None:
    """The F32 GGUF llama.cpp would write for `hf`, with a byte-level BPE (gpt2-style) vocabulary."""
    import gguf
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    tokens = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
    assert len(tokens) == cfg.vocab_size
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in tokenizer.all_special_tokens else 1 for t in tokens])  # 3 = control
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    for key, v in hf.state_dict().items():
        v = v.float()
        if key == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            name = "output.weight"
        elif key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, i, *mod, kind = key.split(".")
            mod = ".".join(mod)
            name = f"blk.{i}.{GGUF_LAYER[mod]}.{kind}"
            if mod == "self_attn.q_proj":
                v = llama_cpp_permute(v, cfg.num_attention_heads)
            elif mod == "self_attn.k_proj":
                v = llama_cpp_permute(v, cfg.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(v.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_loads_to_the_same_model(tied, tmp_path, monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path / "cache"))
    folder = tiny_checkpoint("llama", tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = tiny_tokenizer()
    write_llama_gguf(hf, tok, tmp_path / "tiny.gguf")

    ours, converted = load_target(tmp_path / "tiny.gguf", device="cpu", dtype=torch.float32)
    assert converted.is_relative_to(tmp_path / "cache")
    assert ours.args.tie_word_embeddings == tied and ours.args.eos_token_id == [tok.eos_token_id]
    ids = random_ids(50, seed=4)
    with torch.inference_mode():
        _, got = ours(ids, torch.arange(50)[None])
    assert (got[0] - hf_logits(hf, ids)).abs().max() <= TOL

    back = load_tokenizer(converted)
    text = "The quick brown fox: 12 times 7 is 84.<|im_end|>"
    assert back(text).input_ids == tok(text).input_ids
    assert back.eos_token_id == tok.eos_token_id
