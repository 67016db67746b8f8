"""The EAGLE draft head: fc(cat(embed(next token), feature)) -> decoder layer(s) -> predicted feature.

The head owns no embedding and no LM head: it borrows the target's, frozen. Its state-dict keys and
config.json follow the released EAGLE heads (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...,
LlamaConfig with `num_hidden_layers` and `bias`), so official heads load unchanged and ours load
in vLLM / SGLang. The released heads have one layer; a head may have more (`train --head-layers`), laid
out as the official code and vLLM/SGLang's llama_eagle build them: layer 0 without an input norm, every
later layer with one (`layers.i.input_layernorm.weight`).

A head may draft from a reduced vocabulary (EAGLE-3's `d2t`/`t2d` buffers): the LM head rows of the
most frequent tokens only. On a CPU the draft LM head is most of a draft step's cost. Which tokens are
drafted never affects the output: verification only needs candidate tokens, not their probabilities.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .model import (MLP, Attention, DecoderLayer, KVCache, ModelArgs, RMSNorm, Rotary, causal_mask,
                    check_aux_layers, default_aux_layers, rotate_half)


def head_args(target: ModelArgs, layers: int = 1) -> ModelArgs:
    """Draft layers shaped like the target's attention, with a dense Llama MLP and no q/k norm."""
    if layers < 1:
        raise ValueError(f"a head needs at least one layer, not {layers}")
    return dataclasses.replace(target, num_hidden_layers=layers, num_local_experts=0, num_experts_per_tok=0,
                               qk_norm=False, tie_word_embeddings=False)


def layer_config(a: ModelArgs) -> dict:
    """The config fields both head kinds share: Llama decoder layers the size of the target's."""
    return {
        "model_type": "llama",
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "num_hidden_layers": a.num_hidden_layers,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": a.rope_scaling,
        "max_position_embeddings": a.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


class EagleHead(nn.Module):
    def __init__(self, args: ModelArgs, bias: bool = True, draft_vocab: torch.Tensor | None = None):
        """draft_vocab: the target token ids the head drafts from, ascending (None: all of them)."""
        super().__init__()
        self.args = args
        self.bias = bias
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bias)
        # layer 0 reads fc's output as it is; a later layer's input is a residual stream, normed first
        self.layers = nn.ModuleList(DecoderLayer(args, i, input_norm=i > 0) for i in range(args.num_hidden_layers))
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
        self.cache = KVCache(self.args.num_hidden_layers, batch, self.args.num_key_value_heads, max_len,
                             self.args.head_dim, w.dtype, w.device)  # one K/V pair per layer

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache_start: int | None = None, ttt_steps: int | None = None):
        """token_embeds, features: (B, T, H); returns the predicted next features (B, T, H).

        Position t holds embed(token[t+1]) and feature[t]; see `Transformer.forward` for mask/cache.
        With `ttt_steps`, the list of `unroll`'s predictions instead (training goes through forward, and
        so through a DDP wrapper's gradient hooks).
        """
        if ttt_steps is not None:
            return self.unroll(token_embeds, features, ttt_steps)
        x = self.fc(torch.cat((token_embeds, features.to(token_embeds.dtype)), dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        cache = self.cache if cache_start is not None else None
        mask = causal_mask(x.shape[1], cache_start, x.device) if cache is not None and mask is None else mask
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, 0 if cache_start is None else cache_start)
        return x

    def unroll(self, embeds: torch.Tensor, feats: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """The head's predictions k = 1..depth steps into a draft, for every position at once.

        outs[k-1][:, p] predicts f_{p+1} after a chain of k head steps that started from the true
        feature f_{p-k+1}: step 1 at position p-k+1 is fed (f_{p-k+1}, x_{p-k+2}); step i > 1 at
        position p-k+i is fed (the previous step's predicted feature, x_{p-k+i+1}). Tokens stay the real
        ones. In every layer, each step attends to what that layer's cache would hold when drafting: the
        true-feature steps at positions <= p-k+1 and the chain's own earlier steps. Valid for p >= k-1
        (earlier entries are junk). Differentiable: `train --ttt-steps` trains on it.

        Computed chain by chain as Eagle3Head.unroll does (chain[i][:, s]: step i + 1 of the chain that
        began at s), so that every step's attention is `chain_attention` (no T x T matrix on CPU), then
        shifted to the predicted positions."""
        b, t, _ = feats.shape
        positions = torch.arange(t, device=feats.device)[None].expand(b, -1)
        x = self.fc(torch.cat((embeds, feats.to(embeds.dtype)), -1))
        cos, sin = self.rotary(positions, x.dtype)
        first, own = [], [([], []) for _ in self.layers]  # per layer: step 1's keys/values; the chain's
        for layer in self.layers:
            q, k, v = _rotated_qkv(layer.self_attn, layer.input_layernorm(x), cos, sin)
            first.append((k, v))
            x = _finish(layer, x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        chain = [x]
        for i in range(1, depth):
            fed = F.pad(embeds[:, i:], (0, 0, 0, i))  # x_{s+1+i}: the token step i + 1 of the chain at s reads
            x = self.fc(torch.cat((fed, chain[-1].to(embeds.dtype)), -1))
            cos, sin = self.rotary(positions + i, x.dtype)
            for layer, (k0, v0), (ks, vs) in zip(self.layers, first, own):
                q, k, v = _rotated_qkv(layer.self_attn, layer.input_layernorm(x), cos, sin)
                ks.append(k), vs.append(v)
                y = chain_attention(q, k0, v0, torch.stack(ks, -2), torch.stack(vs, -2), 1.0 / math.sqrt(layer.self_attn.hd))
                x = _finish(layer, x, y)
            chain.append(x)
        return [_shift_right(c, i, 1) for i, c in enumerate(chain)]

    # ---- the drafting interface shared with Eagle3Head ---------------------------------------------
    # first(): the head on the target's own features (catch-up after a verification, prefill);
    # step(): on the head's own previous output (tree depths >= 2); both return the hidden state the
    # next step feeds on. draft_logits(): that hidden state's logits over the draft vocabulary.
    # EAGLE-1 feeds its predicted feature where the target's went, so first and step coincide.

    arch = "eagle"
    aux_layers = None  # the target's final feature, not intermediate layers

    def first(self, token_embeds, target_hidden, positions, mask=None, cache_start=None) -> torch.Tensor:
        return self(token_embeds, target_hidden, positions, mask, cache_start)

    def step(self, token_embeds, hidden, positions, mask=None, cache_start=None) -> torch.Tensor:
        return self(token_embeds, hidden, positions, mask, cache_start)

    def draft_logits(self, hidden: torch.Tensor, target_lm_rows: torch.Tensor) -> torch.Tensor:
        """The borrowed LM head: `target_lm_rows` are the target's LM head rows of the draft vocabulary."""
        return torch.nn.functional.linear(hidden, target_lm_rows)  # a linear, so inductor can pick its own GEMM

    # ---- checkpoint format ----------------------------------------------------------------------

    def hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLMEagle"],
            **layer_config(self.args),
            "bias": self.bias,
            "qkv_bias": self.args.qkv_bias,
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


def _rotated_qkv(attn: Attention, x: torch.Tensor, cos, sin):
    """q, k, v (B, heads, T, d) with rotary applied and k/v repeated to every query head (GQA)."""
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, attn.n_heads, attn.hd).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, attn.n_kv, attn.hd).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, attn.n_kv, attn.hd).transpose(1, 2)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    if attn.n_kv != attn.n_heads:
        rep = attn.n_heads // attn.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return q, k, v


def _finish(layer, x, y):
    b, h, t, d = y.shape
    x = x + layer.self_attn.o_proj(y.transpose(1, 2).reshape(b, t, h * d))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _shift_right(x: torch.Tensor, s: int, dim: int) -> torch.Tensor:
    if s == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, s))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - s)], dim)


def chain_attention_reference(q, k0, v0, kc, vc, scale: float) -> torch.Tensor:
    """Attention of step i >= 1 of the training-time-test unroll, written out: each query t attends
    causally to the prefix keys k0[..., :t+1, :] and to its own chain's keys kc[..., t, j, :], j < i.
    q, k0, v0 (B, heads, T, d); kc, vc (B, heads, T, i, d). Materialises (B, heads, T, T) scores."""
    t = q.shape[-2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    prefix = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
    own = (q.unsqueeze(-2) * kc).sum(-1) * scale  # (B, heads, T, i)
    probs = torch.cat([prefix, own], -1).float().softmax(-1).to(q.dtype)
    p0, pc = probs.split([t, own.shape[-1]], -1)
    return p0 @ v0 + (pc.unsqueeze(-1) * vc).sum(-2)


class _ChainAttention(torch.autograd.Function):
    """`chain_attention_reference` from the fused causal flash kernel, on CPU.

    The prefix is ordinary causal attention; the chain adds i keys per query. Forward merges the
    kernel's output with them through its log-sum-exp. Backward runs the kernel's backward with the
    merged output and log-sum-exp: it then forms the merged softmax's probabilities and row terms,
    so its q/k0/v0 gradients are the prefix block's exact share; the chain's share is a few
    (B, heads, T, i) tensors. No T x T matrix is stored, which made steps 1.. of the unroll three
    quarters of an EAGLE-3 training step's attention time here."""

    @staticmethod
    def forward(ctx, q, k0, v0, kc, vc, scale):
        o_p, lse_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k0, v0, 0.0, True, scale=scale)
        s = (q.unsqueeze(-2) * kc).sum(-1).float() * scale  # (B, heads, T, i)
        lse = torch.logaddexp(lse_p.float(), torch.logsumexp(s, -1))
        p = torch.exp(s - lse.unsqueeze(-1))
        w = torch.exp(lse_p.float() - lse).unsqueeze(-1)
        out = torch.empty_like(o_p).copy_(w * o_p + (p.unsqueeze(-1) * vc).sum(-2))  # the kernel's layout
        lse_out = torch.empty_like(lse_p).copy_(lse)
        ctx.save_for_backward(q, k0, v0, kc, vc, out, lse_out, p)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k0, v0, kc, vc, out, lse, p = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k0, v0, out, lse, 0.0, True, scale=ctx.scale)
        dp = (grad.unsqueeze(-2) * vc).sum(-1)  # (B, heads, T, i)
        row = (grad * out).sum(-1, keepdim=True)
        ds = (p * (dp - row)).to(q.dtype)
        dq = dq + (ds.unsqueeze(-1) * kc).sum(-2) * ctx.scale
        dkc = ds.unsqueeze(-1) * q.unsqueeze(-2) * ctx.scale
        dvc = p.to(q.dtype).unsqueeze(-1) * grad.unsqueeze(-2)
        return dq, dk0, dv0, dkc, dvc, None


def chain_attention(q, k0, v0, kc, vc, scale: float) -> torch.Tensor:
    """See `chain_attention_reference`; fused on CPU (in fp32, whatever mix of fp32/bf16 comes in; the result
    in q's dtype), written out elsewhere."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        # Under CPU autocast (`train --autocast bf16`) the projections come out bf16 next to fp32 ones; the
        # fused kernel wants one dtype, and fp32 keeps it O(T) in memory (the written-out path is T x T).
        dtype = q.dtype
        q, k0, v0, kc, vc = (t.float() for t in (q, k0, v0, kc, vc))
        return _ChainAttention.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), kc, vc, scale).to(dtype)
    return chain_attention_reference(q, k0, v0, kc, vc, scale)


def eagle3_head_args(target: ModelArgs) -> ModelArgs:
    """EAGLE-3's draft layer: the target's attention shape, a dense MLP, no qkv bias (the official
    Llama layout, which SGLang and vLLM load), no q/k norm."""
    return dataclasses.replace(head_args(target), qkv_bias=False)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer (`midlayer`): attention over cat(input_layernorm(embed), hidden_norm(h))
    (2H wide), residual h, then the usual post-attention norm and gated MLP."""

    def __init__(self, args: ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        h = args.hidden_size
        self.self_attn = Attention(args, 0)
        # q/k/v read the 2H concatenation; o_proj writes back H (Attention builds them H wide).
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * h, attn.n_heads * attn.hd, bias=args.qkv_bias)
        attn.k_proj = nn.Linear(2 * h, attn.n_kv * attn.hd, bias=args.qkv_bias)
        attn.v_proj = nn.Linear(2 * h, attn.n_kv * attn.hd, bias=args.qkv_bias)
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = MLP(h, args.intermediate_size)
        # Some SpecForge/speculators heads use the normed h as the residual (vLLM's `norm_before_residual`).
        self.norm_before_residual = norm_before_residual

    def attn_input(self, embeds: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the 2H attention input, the residual)."""
        hn = self.hidden_norm(h)
        return torch.cat((self.input_layernorm(embeds), hn), dim=-1), (hn if self.norm_before_residual else h)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, embeds, h, cos, sin, mask, cache, cache_start):
        x, residual = self.attn_input(embeds, h)
        return self.finish(residual, self.self_attn(x, cos, sin, mask, cache, cache_start))


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head: fc(3H -> H) fuses three target layers; one `midlayer`; its own `norm` and
    `lm_head` over the draft vocabulary. From the second draft step on it feeds on its own pre-norm
    output. State-dict keys and config.json follow the official EAGLE-3 checkpoints (fc.weight,
    midlayer.*, norm.weight, lm_head.weight, d2t, t2d; architectures LlamaForCausalLMEagle3).

    draft_vocab: target ids the head drafts (ascending), None = the whole vocabulary (d2t all zero).
    aux_layers: the three target layers whose entering hidden states fc fuses (see `default_aux_layers`)."""

    arch = "eagle3"

    def __init__(self, args: ModelArgs, aux_layers: tuple[int, int, int], draft_vocab: torch.Tensor | None = None,
                 norm_before_residual: bool = False):
        super().__init__()
        self.args = args
        h = args.hidden_size
        ids = torch.arange(args.vocab_size) if draft_vocab is None else \
            check_draft_vocab(torch.as_tensor(draft_vocab, dtype=torch.long), args.vocab_size)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(args, norm_before_residual)
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.lm_head = nn.Linear(h, ids.numel(), bias=False)
        self.register_buffer("d2t", ids - torch.arange(ids.numel()))  # target id = index + d2t[index]
        t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        self.aux_layers = tuple(int(i) for i in aux_layers)
        self.rotary = Rotary(args)
        self.cache: KVCache | None = None

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """Target ids of the draft vocabulary; None when it is the whole vocabulary in order."""
        if self.d2t.numel() == self.args.vocab_size and not bool(self.d2t.any()):
            return None
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    setup_cache = EagleHead.setup_cache  # one layer: its args say num_hidden_layers 1

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden.to(self.fc.weight.dtype))

    def first(self, token_embeds, target_hidden, positions, mask=None, cache_start=None) -> torch.Tensor:
        """target_hidden (B, T, 3H): the target's aux layers; returns the pre-norm output (B, T, H)."""
        return self.step(token_embeds, self.fuse(target_hidden), positions, mask, cache_start)

    def step(self, token_embeds, hidden, positions, mask=None, cache_start=None) -> torch.Tensor:
        """hidden (B, T, H): the head's own previous output (or fc's fusion of the target's layers)."""
        cos, sin = self.rotary(positions, hidden.dtype)
        cache = self.cache if cache_start is not None else None
        mask = causal_mask(hidden.shape[1], cache_start, hidden.device) if cache is not None and mask is None else mask
        return self.midlayer(token_embeds.to(hidden.dtype), hidden, cos, sin, mask, cache,
                             0 if cache_start is None else cache_start)

    def forward(self, token_embeds, target_hidden, positions=None, mask=None, cache_start=None, ttt_steps=None):
        """first(); with `ttt_steps`, the training-time-test unroll (see `unroll`), so that training goes
        through forward (and a DDP wrapper's gradient hooks)."""
        if ttt_steps is not None:
            return self.unroll(token_embeds, target_hidden, ttt_steps)
        return self.first(token_embeds, target_hidden, positions, mask, cache_start)

    def unroll(self, token_embeds: torch.Tensor, target_hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: `steps` draft steps from every position at once, each fed the previous
        step's own output (as when drafting), with the real next tokens.

        token_embeds (B, T, H): embed(x_{t+1}) at t (right-padded batches; positions 0..T-1);
        target_hidden (B, T, 3H). outs[i][:, t] is step i of a draft that began at t on the target's
        layers: fed token x_{t+1+i} at rotary position t+i, its output drafts x_{t+2+i}. Step i
        attends to what the head's cache holds when drafting: step 0's keys at positions <= t (the
        committed prefix) and the chain's own keys of steps 1..i at t (its ancestors and itself),
        the mask the official trainer and SpecForge use. Entries whose token runs past T are junk
        (the caller masks them out)."""
        b, t, _ = token_embeds.shape
        mid, attn = self.midlayer, self.midlayer.self_attn
        dev = token_embeds.device
        h = self.fuse(target_hidden)
        positions = torch.arange(t, device=dev)[None].expand(b, -1)
        scale = 1.0 / math.sqrt(attn.hd)
        outs, chain_k, chain_v = [], [], []
        for i in range(steps):
            embeds = token_embeds if i == 0 else F.pad(token_embeds[:, i:], (0, 0, 0, i))  # x_{t+1+i}
            x, residual = mid.attn_input(embeds.to(h.dtype), h)
            cos, sin = self.rotary(positions + i, x.dtype)
            q, k, v = _rotated_qkv(attn, x, cos, sin)
            if i == 0:
                k0, v0 = k, v
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                chain_k.append(k), chain_v.append(v)
                y = chain_attention(q, k0, v0, torch.stack(chain_k, -2), torch.stack(chain_v, -2), scale)
            h = mid.finish(residual, attn.o_proj(y.transpose(1, 2).reshape(b, t, attn.n_heads * attn.hd)))
            outs.append(h)
        return outs

    borrows_lm_head = False  # its own norm + lm_head: the engine passes no target rows

    def draft_logits(self, hidden: torch.Tensor, target_lm_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Its own LM head over the draft vocabulary (`target_lm_rows` is unused: the interface is EAGLE-1's)."""
        return self.lm_head(self.norm(hidden))

    # ---- checkpoint format ----------------------------------------------------------------------

    def hf_config(self) -> dict:
        a, aux = self.args, self.aux_layers
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer_config(a),
            "target_hidden_size": a.hidden_size,  # fc reads 3 x this (SpecForge, vLLM)
            "draft_vocab_size": int(self.d2t.numel()),
            "norm_before_residual": self.midlayer.norm_before_residual,
            # SGLang/SpecForge name a layer by the one whose *output* is taken (SGLang adds 1 to capture
            # the hidden state entering the next): ours enter `aux`, so they are aux - 1. vLLM ignores
            # this nested key and uses its default, the same layers when `aux` is the default.
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux], "use_aux_hidden_state": True},
        }

    save = EagleHead.save


def check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError("a draft vocabulary must be a non-empty list of token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be in [0, {vocab_size}) (the target's vocabulary)")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be strictly increasing")
    return ids


def random_head(target: ModelArgs, seed: int = 0, bias: bool = True, draft_vocab=None, layers: int = 1) -> EagleHead:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return EagleHead(head_args(target, layers), bias=bias, draft_vocab=draft_vocab)


def grown_head(head: EagleHead, layers: int, seed: int = 0) -> EagleHead:
    """`head` with layers appended up to `layers`, each computing the identity at first (its o_proj and
    down_proj zero, so it adds nothing to the residual stream): the grown head drafts exactly as `head`
    does, and training starts from what `head` learned instead of from scratch. The new layers' other
    weights are random, so their gradients are not zero once the output projections move."""
    n = len(head.layers)
    if layers < n:
        raise ValueError(f"the head has {n} layers; it can grow, not shrink, to {layers}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        grown = EagleHead(dataclasses.replace(head.args, num_hidden_layers=layers), bias=head.bias,
                          draft_vocab=head.draft_ids)
    missing, unexpected = grown.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("layers.") and int(k.split(".")[1]) >= n for k in missing), \
        (missing, unexpected)
    with torch.no_grad():
        for layer in grown.layers[n:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown.to(head.fc.weight)


def head_layers(sd: dict) -> int:
    """How many decoder layers an EAGLE-1 state dict (our key names) holds: `layers.0.*` ... `layers.{n-1}.*`."""
    ids = {int(k.split(".")[1]) for k in sd if k.startswith("layers.") and k.split(".")[1].isdigit()}
    return max(ids) + 1 if ids else 1


def random_eagle3_head(target: ModelArgs, seed: int = 0, draft_vocab=None, aux_layers=None) -> Eagle3Head:
    """aux_layers: default EAGLE-3's (2, L//2, L-3) of the target's L layers."""
    aux = check_aux_layers(aux_layers if aux_layers is not None else default_aux_layers(target.num_hidden_layers),
                           target.num_hidden_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Eagle3Head(eagle3_head_args(target), aux, draft_vocab=draft_vocab)


def load_head(path: str | Path, target: ModelArgs) -> EagleHead | Eagle3Head:
    """Load a head folder (config.json + model.safetensors or pytorch_model.bin), checked against the
    target: an EAGLE-1/2 head (`layers.0.*`) or an EAGLE-3 head (`midlayer.*`), whichever it holds."""
    path = Path(path).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        if (path / "head" / "config.json").is_file():  # `eaglespec train --out` folders keep it in head/
            raise ValueError(f"{path} is a training run, not a head: its head is {path / 'head'} "
                             f"(--head {path / 'head'})")
        raise ValueError(f"head not found: {path} (expected a folder with config.json and model.safetensors)")
    # every published layout (official EAGLE-1/2/3, SpecForge, speculators) read without pickle, mapped onto
    # our keys and checked against the target's sizes: eaglespec/formats.py
    from .formats import read_head
    cfg, sd = read_head(path, target)
    eagle3_keys = any(k.startswith("midlayer.") for k in sd)
    eagle3_config = "LlamaForCausalLMEagle3" in (cfg.get("architectures") or [])
    if eagle3_config and not eagle3_keys:
        raise ValueError(f"head {path}: config.json says LlamaForCausalLMEagle3 but its weights hold no midlayer.* "
                         "(not an EAGLE-3 checkpoint)")
    layers = 1 if eagle3_keys else head_layers(sd)
    if not eagle3_keys and int(cfg.get("num_hidden_layers") or layers) != layers:
        raise ValueError(f"head {path}: config.json says num_hidden_layers {cfg['num_hidden_layers']}, its weights "
                         f"hold {layers} layer{'s' * (layers != 1)}")
    args = eagle3_head_args(target) if eagle3_keys else head_args(target, layers)
    args = dataclasses.replace(
        args,
        intermediate_size=cfg.get("intermediate_size", args.intermediate_size),
        num_attention_heads=cfg.get("num_attention_heads", args.num_attention_heads),
        num_key_value_heads=cfg.get("num_key_value_heads", args.num_key_value_heads),
        head_dim=cfg.get("head_dim") or cfg.get("hidden_size", args.hidden_size) // cfg.get("num_attention_heads", args.num_attention_heads),
        rms_norm_eps=cfg.get("rms_norm_eps", args.rms_norm_eps),
        rope_theta=float(cfg.get("rope_theta", args.rope_theta)),
        rope_scaling=cfg.get("rope_scaling", args.rope_scaling),  # the head's own RoPE (formats.rope_fields)
        qkv_bias=("midlayer" if eagle3_keys else "layers.0") + ".self_attn.q_proj.bias" in sd,
    )
    draft_vocab = None
    if "d2t" in sd:
        d2t = sd["d2t"].long()
        draft_vocab = d2t + torch.arange(d2t.numel())
        try:
            check_draft_vocab(draft_vocab, target.vocab_size)
        except ValueError as e:
            raise ValueError(f"head {path} does not fit the target: {e}") from None
        sd["d2t"] = d2t
        sd.setdefault("t2d", torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, draft_vocab, True))
    if eagle3_keys:
        try:
            aux = check_aux_layers(eagle3_aux_layers(cfg, target.num_hidden_layers), target.num_hidden_layers)
        except ValueError as e:
            raise ValueError(f"head {path} does not fit the target: {e}") from None
        head = Eagle3Head(args, aux, draft_vocab=draft_vocab, norm_before_residual=bool(cfg.get("norm_before_residual")))
        if draft_vocab is None:  # no d2t: the head drafts over the whole vocabulary
            sd.update(d2t=head.d2t.clone(), t2d=head.t2d.clone())
    else:
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


def eagle3_aux_layers(cfg: dict, n_layers: int) -> tuple[int, ...]:
    """The target layers (entered) an EAGLE-3 config names. SGLang/SpecForge's
    `eagle_config.eagle_aux_hidden_state_layer_ids` name the layer whose output is taken (SGLang
    captures id + 1); vLLM's top-level key of the same name names the layer entered. Neither: the
    official default (2, L//2, L-3)."""
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        if isinstance(cfg.get("eagle_config"), dict) else None
    if nested:
        return tuple(int(i) + 1 for i in nested)
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"])
    return default_aux_layers(n_layers)
