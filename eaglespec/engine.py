"""The engine: prefill, plain decoding and EAGLE decoding over one target and its KV cache.

`Engine.stream` yields text as it is accepted; `Engine.generate` collects it with statistics. Both
methods go through the same prefill, cache and stopping rules, so speed-ups compare like with like.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .head import EagleHead, load_head, random_head
from .loading import DEFAULT_MODEL, load_target, load_tokenizer
from .model import Transformer
from .sampling import SamplingParams, next_token
from .tree import Drafter, TreeConfig
from .verify import verify

METHODS = ("eagle", "vanilla")
REPO_HEADS = Path(__file__).resolve().parent.parent / "heads"
DEFAULT_HEADS = {DEFAULT_MODEL: REPO_HEADS / "smollm2-135m-instruct"}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    new_tokens: int
    finish_reason: str                 # "stop" (EOS or stop string) | "length"
    method: str
    target_forwards: int               # decoding forwards of the target, prefill excluded
    tau: float                         # tokens produced per decoding forward (bonus and EOS counted; prefill excluded)
    accept_lengths: list[int] = field(default_factory=list)  # tokens added per round (accepted + bonus)
    time_s: float = 0.0                # prompt in to last token out, prefill included
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    tokens_per_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StreamChunk:
    text: str                          # new text since the previous chunk
    token_ids: list[int]
    result: GenerationResult | None = None  # set on the last chunk


@dataclass
class _Timers:
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    forwards: int = 0
    accept: list[int] = field(default_factory=list)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    def __init__(self, model: Transformer, tokenizer=None, head: EagleHead | None = None,
                 tree: TreeConfig | None = None, max_context: int | None = None, compile: bool | str = False):
        self.model = model
        self.tokenizer = tokenizer
        self.head = head
        self.tree = tree or TreeConfig()
        self.device = model.embed_tokens.weight.device
        self.max_context = min(max_context or model.args.max_position_embeddings,
                               model.args.max_position_embeddings)
        eos = set(model.args.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self.compiled = bool(compile)
        self._draft_ids = head.draft_ids if head is not None else None
        w = model.lm_head.weight
        self._draft_weight = w if self._draft_ids is None else w[self._draft_ids].contiguous()
        if compile:
            from .compiled import CompiledForward
            # one cache for the engine's life: a compiled graph must not see its buffers replaced
            self._ensure_cache(self.max_context + self.tree.max_nodes + self.tree.top_k * self.tree.depth + 1)
            mode = compile if isinstance(compile, str) else None  # None: max-autotune (tests pass "default")
            self._target_step = CompiledForward(model, model, mode)
            self._head_step = CompiledForward(head, head, mode) if head is not None else None
            self._draft_logprobs = torch.compile(self._draft_logprobs, mode=mode or "max-autotune", fullgraph=True)

    @classmethod
    def load(cls, model: str | None = None, head: str | None = None, device=None, dtype=None,
             tree: TreeConfig | None = None, max_context: int | None = None, compile: bool = False) -> "Engine":
        """head: a head folder, "random", or None for the model's shipped head (random if none)."""
        target, folder = load_target(model, device=device, dtype=dtype)
        tokenizer = load_tokenizer(folder)
        if head is None:
            shipped = DEFAULT_HEADS.get(model or DEFAULT_MODEL)
            head = str(shipped) if shipped and (shipped / "model.safetensors").is_file() else "random"
        if head == "random":
            draft = random_head(target.args)
        else:
            draft = load_head(head, target.args)
        w = target.embed_tokens.weight
        draft = draft.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
        engine = cls(target, tokenizer, draft, tree, max_context, compile)
        engine.head_source = head
        return engine

    # ---- prompts ---------------------------------------------------------------------------------

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               input_ids: list[int] | None = None) -> list[int]:
        if sum(x is not None for x in (prompt, messages, input_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages or input_ids")
        if input_ids is not None:
            ids = [int(i) for i in input_ids]
            if any(not 0 <= i < self.model.args.vocab_size for i in ids):
                raise ValueError(f"input_ids must be in [0, {self.model.args.vocab_size})")
        elif self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass input_ids")
        elif messages is not None:
            ids = self.tokenizer(self.render_chat(messages), add_special_tokens=False).input_ids
        else:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            ids = self.tokenizer(prompt).input_ids
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt is {len(ids)} tokens; the model's context is {self.max_context} tokens")
        return ids

    def render_chat(self, messages: list[dict]) -> str:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("messages must be a non-empty list of {role, content} objects with string values")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use a plain prompt")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # ---- decoding --------------------------------------------------------------------------------

    def _ensure_cache(self, n: int):
        n = -(-n // 256) * 256
        if self.model.cache is None or self.model.cache.max_len < n:
            self.model.setup_cache(n)
        if self.head is not None and (self.head.cache is None or self.head.cache.max_len < n):
            self.head.setup_cache(n)

    def _target(self, tokens, positions, mask=None, cache_start=0):
        if self.compiled:
            return self._target_step(tokens, positions, cache_start=cache_start, mask=mask)
        return self.model(tokens, positions, mask=mask, cache_start=cache_start)

    def _head(self, token_embeds, features, positions, mask=None, cache_start=0):
        if self.compiled:
            return self._head_step(token_embeds, features, positions, cache_start=cache_start, mask=mask)
        return self.head(token_embeds, features, positions, mask=mask, cache_start=cache_start)

    def _draft_logprobs(self, features: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax((features @ self._draft_weight.T).float(), dim=-1)

    def _prefill(self, ids: list[int], timers: _Timers):
        t0 = time.perf_counter()
        x = torch.tensor([ids], device=self.device)
        feats, logits = self.model(x, torch.arange(len(ids), device=self.device)[None], cache_start=0)
        _sync(self.device)
        timers.prefill += time.perf_counter() - t0
        return feats[0], logits[0, -1]

    def _vanilla(self, ids, params, gen, timers) -> Iterator[list[int]]:
        _, logits = self._prefill(ids, timers)
        tok = next_token(logits, params, gen)
        yield [tok]
        cur = len(ids)
        while True:
            t0 = time.perf_counter()
            _, logits = self._target(torch.tensor([[tok]], device=self.device),
                                     torch.tensor([[cur]], device=self.device), cache_start=cur)
            tok = next_token(logits[0, -1], params, gen)
            timers.verify += time.perf_counter() - t0
            timers.forwards += 1
            timers.accept.append(1)
            cur += 1
            yield [tok]

    def _eagle(self, ids, params, gen, timers) -> Iterator[list[int]]:
        if self.head is None:
            raise ValueError("method 'eagle' needs a draft head")
        model, dev = self.model, self.device
        drafter = Drafter(self._head, model.embed_tokens, self._draft_logprobs, self.tree, self._draft_ids)
        feats, logits = self._prefill(ids, timers)
        root = next_token(logits, params, gen)
        yield [root]
        t0 = time.perf_counter()
        # Head position t holds (feature t, token t+1); its last output predicts the root's feature.
        head_tokens = torch.tensor([ids[1:] + [root]], device=dev)
        h = self.head(model.embed_tokens(head_tokens), feats[None], torch.arange(len(ids), device=dev)[None],
                      cache_start=0)
        root_feature, cur = h[0, -1], len(ids)
        timers.draft += time.perf_counter() - t0
        while True:
            t0 = time.perf_counter()
            tree = drafter.draft(root, root_feature, cur)
            _sync(dev)
            t1 = time.perf_counter()
            n = len(tree)
            mask = torch.cat([torch.ones(n, cur, dtype=torch.bool), tree.ancestor_mask()], dim=1).to(dev)
            f, lg = self._target(tree.tokens.to(dev)[None], (cur + tree.depths).to(dev)[None], mask, cur)
            path, bonus = verify(tree, lg[0], params, gen)
            path_t = torch.tensor(path, device=dev)
            model.cache.move(cur + path_t, cur)
            new = tree.tokens[path[1:]].tolist() + [bonus]
            t2 = time.perf_counter()
            timers.draft += t1 - t0
            timers.verify += t2 - t1
            timers.forwards += 1
            timers.accept.append(len(new))
            yield new
            t0 = time.perf_counter()
            h = self._head(model.embed_tokens(torch.tensor([new], device=dev)), f[:, path_t],
                          (cur + torch.arange(len(path), device=dev))[None], cache_start=cur)
            root, root_feature, cur = bonus, h[0, -1], cur + len(path)
            timers.draft += time.perf_counter() - t0

    @torch.inference_mode()
    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               input_ids: list[int] | None = None, method: str = "eagle", max_new_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop: list[str] | str | None = None, ignore_eos: bool = False) -> Iterator[StreamChunk]:
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got '{method}'")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
        params = SamplingParams(float(temperature) if isinstance(temperature, (int, float)) else temperature,
                                float(top_p) if isinstance(top_p, (int, float)) else top_p, top_k)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        ids = self.encode(prompt, messages, input_ids)
        budget = min(max_new_tokens, self.max_context - len(ids))
        self._ensure_cache(len(ids) + budget + self.tree.max_nodes + self.tree.top_k * self.tree.depth + 1)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        timers = _Timers()
        rounds = (self._eagle if method == "eagle" else self._vanilla)(ids, params, gen, timers)

        out: list[int] = []
        text, sent, finish = "", 0, "length"
        hold = max((len(s) for s in stops), default=1) - 1  # text that may still turn into a stop string
        start = time.perf_counter()
        try:
            for new in rounds:
                done, generated = False, len(new)
                for i, t in enumerate(new):
                    if t in self.eos_ids and not ignore_eos:
                        new, finish, done, generated = new[:i], "stop", True, i + 1
                        break
                if len(out) + len(new) >= budget:
                    new, done = new[: budget - len(out)], True
                    generated = len(new)
                if out and timers.accept:  # a cut round counts what it produced: kept tokens and the EOS
                    timers.accept[-1] = generated
                out += new
                if self.tokenizer is not None:
                    text = self.tokenizer.decode(out, skip_special_tokens=True)
                    hit = min((i for i in (text.find(s, max(0, sent - hold)) for s in stops) if i >= 0), default=-1)
                    if hit >= 0:
                        text, finish, done = text[:hit], "stop", True
                    safe = len(text) if done else max(sent, len(text) - hold)
                    while safe > sent and text[safe - 1] == "\ufffd" and not done:
                        safe -= 1  # an incomplete UTF-8 character: wait for its remaining bytes
                    delta, sent = text[sent:safe], max(sent, safe)
                else:
                    delta = ""
                if done:
                    break
                yield StreamChunk(delta, new)
        finally:
            rounds.close()
        elapsed = time.perf_counter() - start
        fwd = timers.forwards
        result = GenerationResult(
            text=text, token_ids=out, prompt_tokens=len(ids), new_tokens=len(out), finish_reason=finish,
            method=method, target_forwards=fwd,
            tau=sum(timers.accept) / fwd if fwd else 1.0, accept_lengths=list(timers.accept),
            time_s=elapsed, time_prefill_s=timers.prefill, time_draft_s=timers.draft,
            time_verify_s=timers.verify, tokens_per_s=len(out) / elapsed if elapsed > 0 else 0.0)
        yield StreamChunk(delta, new, result)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        for chunk in self.stream(prompt, **kwargs):
            if chunk.result is not None:
                return chunk.result
        raise RuntimeError("stream ended without a result")  # unreachable: stream always ends with one
