"""Tiny randomly initialised models for tests: Hugging Face folders (config.json + safetensors +
tokenizer with a ChatML template) for each supported family, built in seconds, no downloads; and
`oracle_pair`, a tiny target with a head whose drafts are usually accepted (tests and `eaglespec fuzz --tiny`)."""
from __future__ import annotations

from pathlib import Path

import torch

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding drafts tokens cheaply and verifies them with the target model.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Question: what is 12 times 7? Answer: 84. The sky is blue because of Rayleigh scattering.",
    "Once upon a time there was a small model that wanted to generate text faster.",
]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer with ChatML special tokens and chat template, trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def tiny_hf_config(family: str = "llama", vocab_size: int = 320, **overrides):
    import transformers as tf
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, initializer_range=0.2)
    extra = {
        "llama": (tf.LlamaConfig, {}),
        "mistral": (tf.MistralConfig, {"sliding_window": None}),
        "qwen2": (tf.Qwen2Config, {"use_sliding_window": False}),
        "qwen3": (tf.Qwen3Config, {"head_dim": 16, "use_sliding_window": False}),
        "mixtral": (tf.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    }
    if family not in extra:
        raise ValueError(f"unknown family {family}; known: {', '.join(FAMILIES)}")
    cls, kw = extra[family]
    return cls(**{**common, **kw, **overrides})


def make_tiny_checkpoint(folder: str | Path, family: str = "llama", vocab_size: int = 320, seed: int = 0,
                         **overrides) -> Path:
    """Save a random `family` model (transformers' own class) and a tiny tokenizer into `folder`."""
    from transformers import AutoModelForCausalLM
    folder = Path(folder)
    cfg = tiny_hf_config(family, vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    tiny_tokenizer(vocab_size).save_pretrained(str(folder))
    return folder


def oracle_pair(vocab_size: int = 320, seed: int = 0, noise: float = 0.0, logit_scale: float = 1.0,
                **arg_overrides) -> tuple:
    """A one-layer target and a head that copies its layer, so the head's drafts are usually right.

    Embedding rows have unit RMS, so the target's input norm is the identity and the head (which has
    no input norm, and reads only the token embedding through fc = [I | 0]) computes the target's
    pre-norm hidden state; the final norm's weight is 1, so both rank tokens alike. What still
    differs: the head never sees the first prompt token, and `noise` perturbs its weights, so drafts
    get rejected now and then and accepted paths vary. `logit_scale` makes the target peakier.
    """
    from .head import random_head
    from .model import ModelArgs, Transformer
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


def eagle3_oracle_pair(vocab_size: int = 320, seed: int = 0, noise: float = 0.0, logit_scale: float = 1.0,
                       draft_vocab=None) -> tuple:
    """A one-layer target and an EAGLE-3 head that copies its layer, so the head's drafts are usually right.

    The target's embeddings are tiny (RMS 0.01): its input norm scales them to unit RMS, and the
    residual they add is negligible, so the layer's output is ~ attention + MLP of the normed tokens.
    The head reads only input_layernorm(embed) (q/k/v's hidden half is zero) and, with
    norm_before_residual and a zero hidden_norm, adds no residual: it computes the same from the
    tokens, whatever its fed hidden state. `noise` perturbs every weight so drafts are sometimes wrong
    and the hidden half is not exactly unused."""
    from .head import Eagle3Head, eagle3_head_args
    from .model import ModelArgs, Transformer, default_aux_layers
    args = ModelArgs(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = Transformer(args)
        emb = model.embed_tokens.weight
        emb /= emb.pow(2).mean(-1, keepdim=True).sqrt() * 100
        model.lm_head.weight *= logit_scale
        head = Eagle3Head(eagle3_head_args(args), default_aux_layers(1), draft_vocab=draft_vocab,
                          norm_before_residual=True)
        h, mid, layer = args.hidden_size, head.midlayer, model.layers[0]
        head.fc.weight.zero_()
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(mid.self_attn, name).weight
            w.zero_()
            w[:, :h] = getattr(layer.self_attn, name).weight
        mid.self_attn.o_proj.load_state_dict(layer.self_attn.o_proj.state_dict())
        mid.hidden_norm.weight.zero_()
        mid.post_attention_layernorm.load_state_dict(layer.post_attention_layernorm.state_dict())
        mid.mlp.load_state_dict(layer.mlp.state_dict())
        head.norm.load_state_dict(model.norm.state_dict())
        rows = model.lm_head.weight if draft_vocab is None else model.lm_head.weight[torch.as_tensor(draft_vocab)]
        head.lm_head.weight.copy_(rows)
        for p in head.parameters():
            p += noise * p.std() * torch.randn_like(p)
    return model.eval().requires_grad_(False), head.eval().requires_grad_(False)


def random_prompts(n: int, seed: int, vocab: int = 320, max_len: int = 40) -> list[list[int]]:
    """n prompts of 1..max_len random token ids, the same for a seed (the lossless checks' inputs)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def exact_continuations(model, prompt: list[int], n: int, params) -> dict[tuple, float]:
    """P(first n new tokens) under plain sampling with `params`, from one batched forward over every
    continuation (a tiny vocabulary only: V**(n-1) rows), on the model's device: the reference the
    sampling chi-square tests (tests/, scripts/gpu_check.py) compare EAGLE's draws with."""
    from .sampling import target_probs
    v, dev = model.args.vocab_size, model.embed_tokens.weight.device
    conts = torch.cartesian_prod(*[torch.arange(v)] * (n - 1)).reshape(-1, n - 1) if n > 1 else torch.zeros(1, 0)
    seqs = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts.long()], dim=1).to(dev)
    with torch.inference_mode():
        _, logits = model(seqs, torch.arange(seqs.shape[1], device=dev)[None].expand(len(seqs), -1))
    probs = target_probs(logits[:, len(prompt) - 1:], params).double().cpu()  # (conts, n, V)
    out = {}
    for row, cont in zip(probs, conts.long().tolist()):
        prefix = 1.0
        for i, x in enumerate(cont):
            prefix *= float(row[i, x])
        for x, px in enumerate(row[-1].tolist()):
            if prefix * px > 0:
                out[tuple(cont) + (x,)] = prefix * px
    return out
