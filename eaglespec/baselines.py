"""Reference decoders from Hugging Face transformers, run on the same weights as our engine.

`hf` is transformers' own `generate` (plain decoding, greedy or sampling); `pld` is its prompt-lookup
decoding (`prompt_lookup_num_tokens`): n-gram drafts copied from the context, verified by the
target. At T > 0 transformers' prompt lookup samples each position from the target and keeps drafts
while they equal the sample, which is still exact sampling from the target, so both run at any T.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .engine import GenerationResult
from .loading import load_target, resolve_model

PLD_TOKENS = 10  # transformers' documented example value; Spec-Bench uses the same


def model_folder(model: str | None) -> Path:
    """The Hugging Face folder our engine's weights came from (a GGUF file is converted once, cached)."""
    path = resolve_model(model)
    if path.suffix == ".gguf":
        return load_target(model, device="cpu")[1]
    return path


class HFDecoder:
    """transformers `generate` on the engine's weights, device and dtype, with the engine's stopping.

    Target forwards are counted with a forward pre-hook; each call's cache length gives how far the
    sequence had grown, so the tokens each verification round added (its accept length) follow.
    """

    def __init__(self, engine, model: str | None, prompt_lookup: int | None = None):
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig
        transformers.logging.set_verbosity_error()  # generate's advice lines would break the progress bar
        w = engine.model.embed_tokens.weight
        self.model = AutoModelForCausalLM.from_pretrained(str(model_folder(model)), dtype=w.dtype)
        self.model = self.model.to(w.device).eval().requires_grad_(False)
        self.model.generation_config = GenerationConfig()  # no sampling defaults from the checkpoint
        self.engine = engine
        self.prompt_lookup = prompt_lookup
        self.eos = sorted(engine.eos_ids)
        tok = engine.tokenizer
        self.pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else self.eos[0]
        self._calls: list[int] = []
        self.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        # the position of the call's first token = how many tokens the cache already holds
        pos = kwargs.get("position_ids")
        if pos is None:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            self._calls.append(int(cache.get_seq_length()) if cache is not None else 0)
        else:
            self._calls.append(int(pos.reshape(-1)[0]))

    @torch.inference_mode()
    def __call__(self, input_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> GenerationResult:
        from transformers import GenerationConfig
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else 1.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
            eos_token_id=self.eos, pad_token_id=self.pad, prompt_lookup_num_tokens=self.prompt_lookup)
        dev = self.engine.device
        x = torch.tensor([input_ids], device=dev)
        torch.manual_seed(seed)  # transformers samples from the global generator
        self._calls = []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = self.model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - t0
        produced = out[0, len(input_ids):].tolist()
        ids, finish = produced, "length"
        for i, t in enumerate(produced):
            if t in self.engine.eos_ids:
                ids, finish = produced[:i], "stop"
                break
        produced = produced[: len(ids) + (finish == "stop")]
        # Call i (after the prefill) starts at cache length s_i and the round adds s_{i+1} - s_i tokens;
        # the last round ends at the last produced token, whose own forward never runs.
        starts = self._calls[1:]
        end = len(input_ids) + len(produced) - 1
        accept = [b - a for a, b in zip(starts, starts[1:] + [end])]
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=True) if self.engine.tokenizer else ""
        return GenerationResult(
            text=text, token_ids=ids, prompt_tokens=len(input_ids), new_tokens=len(ids), finish_reason=finish,
            method="pld" if self.prompt_lookup else "hf", target_forwards=len(starts),
            tau=sum(accept) / len(accept) if accept else 1.0, accept_lengths=accept, time_s=elapsed,
            time_prefill_s=0.0, time_draft_s=0.0, time_verify_s=0.0,
            tokens_per_s=len(ids) / elapsed if elapsed > 0 else 0.0)
