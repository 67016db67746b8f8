"""The EAGLE draft head: fc(cat(embed(next token), feature)) -> one decoder layer -> predicted feature.

The head owns no embedding and no LM head: it borrows the target's, frozen. Its state-dict keys and
config.json follow the released EAGLE heads (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...,
LlamaConfig with `num_hidden_layers: 1` and `bias`), so official heads load unchanged and ours load
in vLLM / SGLang.

A head may draft from a reduced vocabulary (EAGLE-3's `d2t`/`t2d` buffers): the LM head rows of the
most frequent tokens only. On a CPU the draft LM head is most of a draft step's cost. Which tokens are
drafted never affects the output: verification only needs candidate tokens, not their probabilities.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .model import DecoderLayer, KVCache, ModelArgs, Rotary, causal_mask


def head_args(target: ModelArgs) -> ModelArgs:
    """A draft layer shaped like the target's attention, with a dense Llama MLP and no q/k norm."""
    return dataclasses.replace(target, num_hidden_layers=1, num_local_experts=0, num_experts_per_tok=0,
                               qk_norm=False, tie_word_embeddings=False)


class EagleHead(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool = True, draft_vocab: torch.Tensor | None = None):
        """draft_vocab: the target token ids the head drafts from, ascending (None: all of them)."""
        super().__init__()
        self.args = args
        self.bias = bias
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bias)
        self.layers = nn.ModuleList([DecoderLayer(args, 0, input_norm=False)])
        self.rotary = Rotary(args)
        self.cache: KVCache | None = None
        if draft_vocab is not None:
            ids = check_draft_vocab(torch.as_tensor(draft_vocab, dtype=torch.long), args.vocab_size)
            self.register_buffer("d2t", ids - torch.arange(ids.numel()))  # EAGLE-3: target id = index + d2t
            t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            self.register_buffer("t2d", t2d)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """Target ids of the draft vocabulary, or None when the head drafts from the whole vocabulary."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else d2t + torch.arange(d2t.numel(), device=d2t.device)

    def setup_cache(self, max_len: int, batch: int = 1):
        w = self.fc.weight
        self.cache = KVCache(1, batch, self.args.num_key_value_heads, max_len, self.args.head_dim, w.dtype, w.device)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache_start: int | None = None) -> torch.Tensor:
        """token_embeds, features: (B, T, H); returns the predicted next features (B, T, H).

        Position t holds embed(token[t+1]) and feature[t]; see `Transformer.forward` for mask/cache.
        """
        x = self.fc(torch.cat((token_embeds, features.to(token_embeds.dtype)), dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        cache = self.cache if cache_start is not None else None
        mask = causal_mask(x.shape[1], cache_start, x.device) if cache is not None and mask is None else mask
        return self.layers[0](x, cos, sin, mask, cache, 0 if cache_start is None else cache_start)

    # ---- checkpoint format ----------------------------------------------------------------------

    def hf_config(self) -> dict:
        a = self.args
        return {
            "architectures": ["LlamaForCausalLMEagle"],
            "model_type": "llama",
            "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size,
            "num_attention_heads": a.num_attention_heads,
            "num_key_value_heads": a.num_key_value_heads,
            "head_dim": a.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": a.rope_scaling,
            "max_position_embeddings": a.max_position_embeddings,
            "hidden_act": "silu",
            "bias": self.bias,
            "qkv_bias": a.qkv_bias,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            **({"draft_vocab_size": int(self.d2t.numel())} if self.draft_ids is not None else {}),
        }

    def save(self, folder: str | Path, extra_config: dict | None = None) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        sd = {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous()
              for k, v in self.state_dict().items()}
        tmp = folder / "model.safetensors.tmp"
        save_file(sd, str(tmp), metadata={"format": "pt"})
        tmp.replace(folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({**self.hf_config(), **(extra_config or {})}, indent=2))


def check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError("a draft vocabulary must be a non-empty list of token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be in [0, {vocab_size}) (the target's vocabulary)")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be strictly increasing")
    return ids


def random_head(target: ModelArgs, seed: int = 0, bias: bool = True, draft_vocab=None) -> EagleHead:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return EagleHead(head_args(target), bias=bias, draft_vocab=draft_vocab)


def load_head(path: str | Path, target: ModelArgs) -> EagleHead:
    """Load a head folder (config.json + model.safetensors or pytorch_model.bin), checked against the target."""
    path = Path(path).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        if (path / "head" / "config.json").is_file():  # `eaglespec train --out` folders keep it in head/
            raise ValueError(f"{path} is a training run, not a head: its head is {path / 'head'} "
                             f"(--head {path / 'head'})")
        raise ValueError(f"head not found: {path} (expected a folder with config.json and model.safetensors)")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if key in cfg and cfg[key] != want:
            raise ValueError(f"head {path} does not fit the target: {key} {cfg[key]} != target's {want}")
    if (path / "model.safetensors").is_file():
        sd = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"head {path} has no model.safetensors or pytorch_model.bin")
    sd = {k.removeprefix("model."): v for k, v in sd.items() if not k.endswith("embed_tokens.weight")}
    args = head_args(target)
    args = dataclasses.replace(
        args,
        intermediate_size=cfg.get("intermediate_size", args.intermediate_size),
        num_attention_heads=cfg.get("num_attention_heads", args.num_attention_heads),
        num_key_value_heads=cfg.get("num_key_value_heads", args.num_key_value_heads),
        head_dim=cfg.get("head_dim") or cfg.get("hidden_size", args.hidden_size) // cfg.get("num_attention_heads", args.num_attention_heads),
        rms_norm_eps=cfg.get("rms_norm_eps", args.rms_norm_eps),
        rope_theta=float(cfg.get("rope_theta", args.rope_theta)),
        qkv_bias="layers.0.self_attn.q_proj.bias" in sd,
    )
    draft_vocab = None
    if "d2t" in sd:
        d2t = sd["d2t"].long()
        draft_vocab = d2t + torch.arange(d2t.numel())
        try:
            check_draft_vocab(draft_vocab, target.vocab_size)
        except ValueError as e:
            raise ValueError(f"head {path} does not fit the target: {e}") from None
        sd.setdefault("t2d", torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, draft_vocab, True))
    head = EagleHead(args, bias="fc.bias" in sd, draft_vocab=draft_vocab)
    expected = set(head.state_dict().keys())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"head {path} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    try:
        head.load_state_dict(sd)
    except RuntimeError as e:
        raise ValueError(f"head {path} does not fit the target: {str(e).splitlines()[-1].strip()}") from None
    return head
