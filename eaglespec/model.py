"""The target model: a compact decoder for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3,
SmolLM2, Mixtral) with a preallocated KV cache and arbitrary (tree) attention masks.

Module and parameter names follow Hugging Face's, so a checkpoint's state dict loads after dropping
its `model.` prefix, and the draft head reuses `DecoderLayer` with EAGLE's key names.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = ",".join(cfg.get("architectures") or []) or model_type or "unknown"
            raise ValueError(f"unsupported architecture '{archs}'; supported model types: "
                             + ", ".join(SUPPORTED_ARCHITECTURES))
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) not in ("default", None) else None
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            head_dim=cfg.get("head_dim") or 0,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_local_experts=cfg.get("num_local_experts", 0) if model_type == "mixtral" else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if model_type == "mixtral" else 0,
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sc = args.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / sc["factor"]
    elif kind == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_ctx = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling '{kind}'; supported: default, linear, llama3")
    return inv_freq.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KVCache(nn.Module):
    """Preallocated keys and values, one (batch, kv heads, slots, dim) buffer pair per layer.

    Separate buffers per layer (not one stacked tensor) let a compiled graph update each in place;
    a write into a view of a shared buffer is functionalised into a copy of the whole cache."""

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, dtype, device):
        super().__init__()
        self.n_layers = n_layers
        shape = (batch, n_kv_heads, max_len, head_dim)
        for i in range(n_layers):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k0.shape[2]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    def write(self, layer: int, start: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int = 0):
        """Store k/v from slot `start` on; return the first `kv_len` (default: up to the last written) slots.

        A tensor `start` holds the slot indices (compiled, static shapes): written with index_copy_ in place."""
        kc, vc = self.layer(layer)
        if isinstance(start, torch.Tensor):
            kc.index_copy_(2, start, k)
            vc.index_copy_(2, start, v)
            return kc[:, :, :kv_len], vc[:, :, :kv_len]
        end = start + k.shape[2]
        kc[:, :, start:end] = k
        vc[:, :, start:end] = v
        return kc[:, :, :end], vc[:, :, :end]

    def move(self, src: torch.Tensor, dst_start: int):
        """Copy slots `src` to `dst_start...`: keeps an accepted tree path contiguous after verification."""
        dst = torch.arange(dst_start, dst_start + src.numel(), device=src.device)
        if torch.equal(src, dst):
            return
        for i in range(self.n_layers):
            for buf in self.layer(i):
                buf[:, :, dst] = buf[:, :, src]


    def move_slots(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy slots `src` onto `dst` in every layer (gathered first, so the two may overlap).
        Fixed-shape and in place, so it compiles into one graph over all layers."""
        for i in range(self.n_layers):
            for buf in self.layer(i):
                buf.index_copy_(2, dst, buf.index_select(2, src))


class Attention(nn.Module):
    small_attention = False  # set by cpugemm.pack_linears where its attention kernel runs (CPU fp32, AVX-512)

    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * self.hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * self.hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.hd, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, args.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, cache_start: int):
        b, t, _ = x.shape
        if hasattr(self, "qkv_proj"):  # cpugemm.pack_linears fuses the three: one pass, one call
            q, k, v = self.qkv_proj(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.n_heads, self.hd)
        k = k.view(b, t, self.n_kv, self.hd)
        v = v.view(b, t, self.n_kv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.write(self.layer_idx, cache_start, k, v, 0 if mask is None else mask.shape[-1])
        gqa = self.n_kv != self.n_heads
        if self.small_attention and mask is not None and mask.dtype == torch.bool:
            # cpugemm's kernel for query rows under a mask (decoding, verification of any size, masked prompt
            # rows); it returns (b, t, heads, dim) already. Each row's result depends only on its query and the
            # keys it sees, so a verified row has the decoding step's bits: on int8 activations a last-bit
            # difference flips a rounding that grows through the layers. It was bounded to 32 rows once, and
            # torch's attention above that made 71 of 80 MT-bench answers leave plain decoding's on a 60-node
            # tree. With a mask it is also faster than torch's (33 / 128 / 1,024 rows: 0.11 / 0.61 / 14.5 ms
            # against 0.15 / 0.86 / 20.6, one layer of the default model); the unmasked prefill keeps torch's.
            y = torch.ops.eaglespec.small_attention(q, k, v, mask, self.hd ** -0.5)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=gqa).transpose(1, 2)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa).transpose(1, 2)
        return self.o_proj(y.reshape(b, t, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):  # fused by cpugemm.pack_linears
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    """Mixtral's sparse MoE: softmax router, top-k experts, weights renormalised over the chosen k."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.experts = nn.ModuleList(MLP(args.hidden_size, args.intermediate_size)
                                     for _ in range(args.num_local_experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0, input_norm: bool = True):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        # EAGLE's draft layer has no norm before attention: its input is already fc(embedding, feature).
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps) if input_norm else nn.Identity()
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.num_local_experts:
            self.block_sparse_moe = MoE(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def forward(self, x, cos, sin, mask, cache, cache_start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_start)
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return x + ffn(self.post_attention_layernorm(x))


def causal_mask(t: int, cache_start: int | None, device) -> torch.Tensor | None:
    """Mask for t new tokens after `cache_start` cached ones; None where SDPA's own rule suffices."""
    if t == 1 or not cache_start:
        return None  # one token sees everything; a fresh prefill is plainly causal
    return torch.ones(t, cache_start + t, dtype=torch.bool, device=device).tril(cache_start)


class Rotary(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def _apply(self, fn, recurse=True):
        # `.to(bfloat16)` would round the frequencies too (relative error 3.7e-3, growing with the
        # position's angle); transformers keeps them in fp32, and so do we: only the device changes.
        freq = self.inv_freq
        super()._apply(fn, recurse)
        if freq.dtype == torch.float32 and self.inv_freq.dtype != torch.float32:
            self.inv_freq = freq.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype):
        """positions (B, T) -> cos, sin of shape (B, 1, T, head_dim), computed in fp32 like HF."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(args)
        self.cache: KVCache | None = None

    def setup_cache(self, max_len: int, batch: int = 1):
        w = self.embed_tokens.weight
        a = self.args
        self.cache = KVCache(a.num_hidden_layers, batch, a.num_key_value_heads, max_len, a.head_dim,
                             w.dtype, w.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                cache_start: int | None = None, logits: bool = True, aux_layers: tuple[int, ...] | None = None):
        """Run `tokens` (B, T) at `positions` (B, T).

        With `cache_start`, keys/values go to cache slots [cache_start, cache_start+T) and the
        tokens attend to slots [0, cache_start+T) through `mask` (bool, True = may attend, shape
        (T, cache_start+T) or broadcastable); without it, the tokens attend among themselves
        (`mask`, or causal if None). Returns the features (post final norm) and, if asked, logits.

        With `aux_layers` (EAGLE-3), also returns the hidden states *entering* those layers (index
        L = the last layer's output, before the final norm), concatenated in the given order:
        (B, T, len(aux_layers) * H), taken from this same forward.
        """
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        cache = self.cache if cache_start is not None else None
        mask = causal_mask(tokens.shape[1], cache_start, tokens.device) if cache is not None and mask is None else mask
        taken = {}
        for i, layer in enumerate(self.layers):
            if aux_layers is not None and i in aux_layers:
                taken[i] = x
            x = layer(x, cos, sin, mask, cache, 0 if cache_start is None else cache_start)
        features = self.norm(x)
        out = features, (self.lm_head(features) if logits else None)
        if aux_layers is None:
            return out
        taken[len(self.layers)] = x
        return (*out, torch.cat([taken[i] for i in aux_layers], dim=-1))


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers: the hidden states entering layers 2, L//2 and L-3, as
    the official code captures them (eagle/model/modeling_llama_kv.py); clamped into [0, L] so that
    shallow (test) models get three valid, if repeated, layers."""
    return tuple(min(max(i, 0), n_layers) for i in (2, n_layers // 2, n_layers - 3))


def check_aux_layers(layers, n_layers: int) -> tuple[int, ...]:
    layers = tuple(int(i) for i in layers)
    if len(layers) != 3 or any(not 0 <= i <= n_layers for i in layers):
        raise ValueError(f"EAGLE-3 takes three target layers in [0, {n_layers}] (the hidden states entering them; "
                         f"{n_layers} = the last layer's output), got {list(layers)}")
    return layers


def share_weights(module: nn.Module) -> nn.Module:
    """A copy of `module` (a target or a head) whose parameters and buffers are the same tensors, with no
    KV cache: another engine over the same weights, or a variant of the module, costs no weight memory."""
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    clone = copy.deepcopy(module, memo)
    clone.cache = None
    return clone
