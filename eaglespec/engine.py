"""The engine: prefill, plain decoding and EAGLE decoding over one target and its KV cache.

`Engine.stream` yields text as it is accepted; `Engine.generate` collects it with statistics. Both
methods go through the same prefill, cache and stopping rules, so speed-ups compare like with like.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .head import EagleHead, load_head, random_eagle3_head, random_head
from .loading import DEFAULT_MODEL, load_target, load_tokenizer
from .model import Transformer
from .ngram import NgramProposer, attach_chain
from .sampling import SamplingParams, next_token
from .compiled import StaticCall, compile_fn, configure_inductor, default_mode
from .costmodel import AUTO_BUCKETS, RankAcceptance, SpecSwitch, TreePolicy
from .stopping import Stopper, stream_delta
from .tree import Drafter, HostCandidates, Tree, TreeConfig, top_by_score, tree_from_host
from .verify import greedy_accept, tree_draws, trials_from_draws, verify, verify_sampled

METHODS = ("eagle", "vanilla")
REPO_HEADS = Path(__file__).resolve().parent.parent / "heads"
DEFAULT_HEADS = {DEFAULT_MODEL: REPO_HEADS / "smollm2-135m-instruct"}


class ContextLengthError(ValueError):
    """The prompt does not fit the context."""


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
    tree_tokens: int = 0               # tokens the target verified over all rounds, roots included (plain: 1 a step)

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
    tree_tokens: int = 0
    accept: list[int] = field(default_factory=list)


_CLAIM = threading.Lock()  # makes "is this engine free? then it is mine" one step


@contextlib.contextmanager
def _exclusive(engine: "Engine"):
    """Hold `engine` for one stream. Two streams would interleave their rounds in one KV cache and
    silently corrupt each other, so the second is refused (the server gives each request a replica)."""
    with _CLAIM:
        if getattr(engine, "_streaming", False):
            raise RuntimeError("this Engine is already generating (a stream is still open): finish or close it "
                               "first, or use one Engine per concurrent stream (see eaglespec.serve.replicate)")
        engine._streaming = True
    try:
        yield
    finally:
        engine._streaming = False


def tree_candidates(tree: TreeConfig) -> int:
    """How many draft candidates the tree takes per expanded node (the top-k it asks the head for)."""
    return tree.draft_top_k


def draft_vocab_size(head: EagleHead) -> int:
    """How many tokens the head drafts from: its reduced draft vocabulary, or the target's whole one."""
    ids = head.draft_ids
    return head.args.vocab_size if ids is None else int(ids.numel())


def check_tree_fits_head(tree: TreeConfig, head: EagleHead | None) -> None:
    """A tree that asks for more candidates than the head can draft would crash mid-generation."""
    if head is None:
        return
    size = draft_vocab_size(head)
    need = tree_candidates(tree)
    if need > size:
        raise ValueError(f"the head's draft vocabulary has {size} token(s) but the {tree.kind} tree takes the top "
                         f"{need} per node: use a smaller --top-k-draft, --tree chain, or a head with a larger "
                         "draft vocabulary")


def check_seed(seed) -> None:
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")


def check_request(method, max_new_tokens, temperature, top_p, top_k, seed, stop) -> tuple[SamplingParams, list[str]]:
    """A generation request's own arguments checked, needing no model: the CLI calls this before it spends
    seconds loading one, and every stream calls it again. Returns the sampling parameters and the stop list."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got '{method}'")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    params = SamplingParams(float(temperature) if isinstance(temperature, (int, float)) else temperature,
                            float(top_p) if isinstance(top_p, (int, float)) else top_p, top_k)
    check_seed(seed)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError("stop must be a non-empty string or a list of them")
    return params, stops


def _longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token covers: its longest vocabulary entry (byte-level
    entries spell one character per byte, so they never undercount). Cached on the tokenizer."""
    cached = getattr(tokenizer, "_eaglespec_longest_token", None)
    if cached is None:
        cached = max(map(len, tokenizer.get_vocab()), default=1) or 1
        try:
            tokenizer._eaglespec_longest_token = cached
        except AttributeError:
            pass
    return cached


RANDOM_HEADS = ("random", "random-eagle3")  # Engine.load's untrained heads (EAGLE-1, EAGLE-3)


def _notice(text: str) -> None:
    """One line on stderr for what a caller should know but need not act on (never on stdout: JSON goes there)."""
    print(f"eaglespec: {text}", file=sys.stderr, flush=True)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pack_target(model: Transformer, wanted: bool | None) -> bool:
    """Swap the target's linears for the few-row CPU GEMM where it works; True if they run on it."""
    from . import cpugemm
    if any(isinstance(m, cpugemm.PackedLinear) for m in model.modules()):
        return True  # a model shared by several engines is packed once
    if wanted is False:
        return False
    why = cpugemm.usable_for(model)
    if why is not None:
        if wanted or (model.embed_tokens.weight.device.type == "cpu" and not why.startswith("disabled")):
            _notice(f"the target's linears stay on torch's GEMM: {why}")
        return False
    cpugemm.pack_linears(model)
    return True


class _Rows(torch.nn.Module):
    """The draft vocabulary's rows of the target's LM head, as a module parameter rather than a bare
    tensor: compiled, it is then frozen into the graph and gets inductor's prepacked GEMM instead of an
    extern aten::mm (4x slower here). On the packed path a PackedLinear takes its place."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None

    def forward(self, hidden):
        return torch.nn.functional.linear(hidden, self.weight)


@dataclass
class _Sampled:
    """A generation's sampled drafts (T > 0, `Engine.draft_sampling`): the generation's generator, the
    temperature the head's distribution is drawn at (the target's), and the position scores."""
    gen: torch.Generator
    inv_t: float
    ranks: RankAcceptance


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from uniforms: -log(-log(U)). Why not -log(Exp(1)): torch.rand is 3x faster than exponential_ on
    CPU (0.10 against 0.33 ms for 2 x 8k)."""
    return -torch.log(-torch.log(u.clamp(min=1e-20)))


def sampled_mix(sampled: _Sampled, depth: int, device) -> torch.Tensor:
    """_children's mix for sampled drafts at `depth`: [0, 1/T, the rank scores] (no log-probability in the score,
    so which children are kept never depends on what was drawn)."""
    return torch.tensor([0.0, sampled.inv_t] + sampled.ranks.log_scores(depth), device=device)


class Engine:
    def __init__(self, model: Transformer, tokenizer=None, head: EagleHead | None = None,
                 tree: TreeConfig | None = None, max_context: int | None = None, compile: bool | str = False,
                 cost_table=None, packed_gemm: bool | None = None):
        """compile: False (eager), True (the device's best torch.compile mode) or a mode name.
        cost_table: a `costmodel.CostTable` for `tree.auto` (default: the cached calibration, measured
        on first use).
        packed_gemm: run the target's linears on the few-row CPU GEMM (cpugemm.py; swaps them in
        `model`, in place), and the head's and draft LM-head rows' too (on a copy: `head` is left as it
        is, and `self.head` is the packed copy). None: wherever it works (CPU fp32 with AVX2 and a
        compiler); False: never."""
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
        self.model_source = getattr(model, "source", "unknown")
        check_tree_fits_head(self.tree, head)
        self._draft_ids = head.draft_ids if head is not None else None
        w = model.lm_head.weight
        rows = None  # an EAGLE-3 head has its own LM head: it gets no copy of the target's rows
        if head is None or getattr(head, "borrows_lm_head", True):
            rows = w if self._draft_ids is None else w[self._draft_ids].contiguous()
        self.packed_gemm = _pack_target(model, packed_gemm)
        self._draft_lm = _Rows(rows) if rows is not None else None
        if self.packed_gemm:
            from . import cpugemm
            if head is not None:
                self.head = head = cpugemm.packed_copy(head)
            if rows is not None:
                self._draft_lm = cpugemm.PackedLinear(self._draft_lm)
                cpugemm.onto_huge_pages(cpugemm.packed_slots(self._draft_lm))
        self.compile_mode = (compile if isinstance(compile, str) else default_mode(self.device)) if compile else None
        self.compiled = self.compile_mode is not None
        if self.compiled:
            configure_inductor(self.device, w.dtype)
        # One cache for the engine's life: a compiled graph must not see its buffers replaced.
        self._ensure_cache(self.max_context + self._round_slack())
        mode, packed = self.compile_mode, self.packed_gemm
        self._target_call = StaticCall(self._target_fn, model, mode, "target", packed, dynamic_t=packed,
                                       skip_guards=True)
        top_k = lambda: self.tree.draft_top_k  # noqa: E731 - all that the draft graphs read of the tree
        self._catchup_call = StaticCall(self._catchup_fn, head, mode, "catch-up", packed, skip_guards=True,
                                        state=top_k) if head is not None else None
        self._expand_call = StaticCall(self._expand_fn, head, mode, "expand", packed, skip_guards=True,
                                       state=top_k) if head is not None else None
        self._move = compile_fn(self._move_fn, mode, packed) if mode is not None else self._move_fn
        # Greedy rounds verify and run the head's catch-up in one call (_fused_fn): the catch-up as a call of
        # its own cost ~1.5 ms a round on the default CPU model, a quarter of a plain step, mostly waking the
        # second core's thread and the call's own overhead; inside the verification it costs ~0.3-0.4 ms
        # (docs/performance.md, "The catch-up inside the verification"). False: the separate call, as at T > 0.
        self.fuse_catchup = True
        self._fused_call = StaticCall(self._fused_fn, model, mode, "verify+catch-up", packed, dynamic_t=packed,
                                      skip_guards=True, state=top_k) if head is not None else None
        # the rejection sampling inside the sampled call: cpugemm's kernel where it is built (CPU), else tensor ops
        self._draws_kernel = self.packed_gemm
        # the kernel's view of the draft vocabulary: its target ids, and target id -> its index (-1 outside it); both
        # empty where the head drafts the full vocabulary
        self._kernel_ids = self._draft_of = torch.zeros(0, dtype=torch.long, device=self.device)
        if self._draft_ids is not None:
            self._kernel_ids = self._draft_ids
            self._draft_of = torch.full((w.shape[0],), -1, dtype=torch.long, device=self.device)
            self._draft_of[self._draft_ids] = torch.arange(self._draft_ids.numel(), device=self.device)
        self._fused_sampled_call = StaticCall(self._fused_sampled_fn, model, mode, "verify+catch-up, sampled", packed,
                                              dynamic_t=packed, skip_guards=True, state=top_k) \
            if head is not None else None
        self._move_both = (compile_fn(self._move_both_fn, mode, packed) if mode is not None
                           else self._move_both_fn) if head is not None else None
        self._move_bufs: tuple = ((), [])  # the caches, and their buffers for cpugemm's move_slots
        self._cost_table = cost_table
        self.policy: TreePolicy | None = None  # the latest top-k drafts' policy (for callers that inspect it)
        self._policies: dict[tuple, TreePolicy] = {}  # (sampled drafts, fused catch-up, online costs) -> policy
        # True: the tree policy corrects the cost table by the verification times its rounds measure (TreePolicy).
        # Off by default: measured on 80 MT-bench turns it did not win (T = 0 1.259x against 1.270x for the table
        # alone, T = 1 1.062x against 1.076x, one interleaved run; docs/performance.md, "Sampled rounds in one call")
        self.online_costs = False
        # At T > 0: draw the drafts from the head's distribution (verify_sampled) instead of taking its top-k
        # (verify). Both are lossless; sampled drafts are accepted more often where the target is unsure
        # (docs/performance.md, "Sampled drafts"). Greedy decoding always takes the top-k.
        self.draft_sampling = True
        self._ranks: RankAcceptance | None = None
        self._top_inputs: dict = {}
        self.warmed_for: bool | None = None  # the last warmup's `greedy`
        self._switch: SpecSwitch | None = None
        self._ngram: NgramProposer | None = None  # the running generation's (greedy or sampled rounds')
        self._ngrams: dict[bool, NgramProposer] = {}

    @classmethod
    def load(cls, model: str | None = None, head: str | None = None, device=None, dtype=None,
             tree: TreeConfig | None = None, max_context: int | None = None, compile: bool | str = False,
             packed_gemm: bool | None = None) -> "Engine":
        """head: a head folder, "random" (an untrained EAGLE-1 head), "random-eagle3" (an untrained EAGLE-3
        head on the official layers), or None for the model's shipped head (random if none)."""
        target, folder = load_target(model, device=device, dtype=dtype)
        target.source = model or DEFAULT_MODEL
        tokenizer = load_tokenizer(folder)
        if head is None:
            shipped = DEFAULT_HEADS.get(model or DEFAULT_MODEL)
            head = str(shipped) if shipped and (shipped / "model.safetensors").is_file() else "random"
        if head == "random":
            draft = random_head(target.args)
        elif head == "random-eagle3":
            draft = random_eagle3_head(target.args)
        else:
            draft = load_head(head, target.args)
        w = target.embed_tokens.weight
        draft = draft.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
        engine = cls(target, tokenizer, draft, tree, max_context, compile, packed_gemm=packed_gemm)
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
            ids = self._tokenize(self.render_chat(messages), add_special_tokens=False)
        else:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise ContextLengthError(f"prompt is {len(ids)} tokens; the model's context is {self.max_context} tokens")
        return ids

    def _tokenize(self, text: str, **kw) -> list[int]:
        """Token ids of `text`, refusing at once a text too long for any tokenization to fit the context:
        a 24 MB prompt would otherwise be tokenized whole (seconds, gigabytes) only to be refused."""
        most = self.max_context * _longest_token_chars(self.tokenizer)
        if len(text) > most:
            raise ContextLengthError(f"prompt is {len(text):,} characters, more than the model's context of "
                                     f"{self.max_context} tokens can hold")
        return self.tokenizer(text, **kw).input_ids

    def render_chat(self, messages: list[dict]) -> str:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("messages must be a non-empty list of {role, content} objects with string values")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use a plain prompt")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # ---- the static-shape calls (compiled or eager; see compiled.py) -------------------------------

    def _target_fn(self, tokens, positions, *, slots, mask):
        feats, logits = self._target_forward(tokens, positions, mask=mask, cache_start=slots)
        return feats[0], logits[0], logits[0].argmax(-1)

    def _target_forward(self, tokens, positions, **kw):
        """The target's forward, returning (what the head feeds on, logits): its final features for an
        EAGLE-1 head, the concatenated hidden states entering the head's three layers for EAGLE-3."""
        aux = getattr(self.head, "aux_layers", None)
        if aux is None:
            return self.model(tokens, positions, **kw)
        _, logits, hidden = self.model(tokens, positions, aux_layers=aux, **kw)
        return hidden, logits

    def _draft_logprobs(self, hidden: torch.Tensor, inv_t: torch.Tensor | float = 1.0) -> torch.Tensor:
        logits = self.head.draft_logits(hidden) if self._draft_lm is None else self._draft_lm(hidden)
        return torch.log_softmax(logits.float() * inv_t, dim=-1)

    def _children(self, hidden: torch.Tensor, noise: torch.Tensor, mix: torch.Tensor):
        """Each head output row's k children: (their scores, their target ids, the row's log-probabilities over the
        draft vocabulary). noise zeros, mix [1, 1, 0...]: the top-k and their log-probabilities, bit for bit (adding
        0 and multiplying by 1 change no value). noise Gumbel, mix [0, 1/T, s_0..s_k-1]: a sample without
        replacement from the rows at temperature T (the Gumbel-top-k trick), scored by position alone (s_r:
        RankAcceptance), so that which nodes are kept never depends on what was drawn."""
        return self._children_of(self._draft_logprobs(hidden, mix[1]), noise, mix)

    def _children_of(self, lq: torch.Tensor, noise: torch.Tensor, mix: torch.Tensor):
        """_children from the rows' log-probabilities at the draft temperature."""
        ids = (lq + noise).topk(self.tree.draft_top_k, dim=-1).indices
        return lq.gather(-1, ids) * mix[0] + mix[2:], self._to_target_ids(ids), lq

    def _to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self._draft_ids is None else self._draft_ids[ids]

    def _catchup_fn(self, tokens, hidden, positions, last, noise, mix, *, slots, mask):
        """The head on the tokens just accepted (padded to a fixed count), fused with depth 1: the
        root's predicted hidden state, its k children (_children) and its log-probabilities."""
        out = self.head.first(self.model.embed_tokens(tokens), hidden, positions, mask=mask, cache_start=slots)[0]
        root = out.index_select(0, last)
        scores, ids, lq = self._children(root, noise, mix)
        return root[0], scores[0], ids[0], lq[0]

    def _expand_fn(self, tokens, hidden, positions, scores, noise, mix, *, slots, mask):
        """One depth: the frontier through the head, each row's k children (_children), the k best children
        overall, and the rows' log-probabilities."""
        out = self.head.step(self.model.embed_tokens(tokens), hidden, positions, mask=mask, cache_start=slots)[0]
        lp, ids, lq = self._children(out, noise, mix)
        cum = lp + scores[:, None]
        best = cum.flatten().topk(self.tree.draft_top_k).indices
        return out, cum, ids, best, lq

    def _fused_fn(self, tokens, positions, *, slots, mask):
        """A greedy round's verification with the head's catch-up and depth 1 in the same call. The head runs
        on every tree node, fed (the node's feature, the target's argmax there), in the node's own head-cache
        slot under the tree's mask. On the nodes greedy acceptance keeps, that argmax is the next accepted
        token (or the bonus), and their ancestors are the accepted ones: exactly the pairs the catch-up would
        feed, in the slots it would write once the accepted path is moved into place (_move_both). The other
        nodes' entries are dropped like the target's. Returns every node's head output and top-k (scores,
        target ids), the last accepted node's starting the next round, and the host's block: each node's argmax
        and top-k as one float64 tensor, the round's one read."""
        feats, logits = self._target_forward(tokens, positions, mask=mask, cache_start=slots)
        amax = logits[0].argmax(-1)
        out = self.head.first(self.model.embed_tokens(amax[None]), feats, positions, mask=mask, cache_start=slots)[0]
        top = self._draft_logprobs(out).topk(self.tree.draft_top_k, dim=-1)
        ids = self._to_target_ids(top.indices)
        # what the host reads of the round, in one block: each node's argmax, then its children's scores and ids
        # (ids < 2**53 and float32 scores are exact in float64)
        host = torch.cat([amax[:, None].double(), top.values.double(), ids.double()], dim=1)
        return out, top.values, ids, host

    def _fused_sampled_fn(self, tokens, positions, temperature, q_logp, kids, kid_ok, det, u, gumbel_u, mix, *, slots,
                          mask):
        """A sampled round's verification with the head's catch-up and depth 1 in the same call (sampled drafts,
        T > 0, no top-k / top-p filter): as _fused_fn, with the argmax replaced by each node's draw under
        verify_sampled's rule (tree_draws: the token that follows the node if it is accepted, from the target's
        distribution; a child is accepted exactly when it is its parent's draw). The rejection sampling runs here
        on uniforms the caller drew, so the head can be fed (feature, next token) before the host knows the
        path. det: per node, the n-gram chain's child tried first (-1: none).

        Every node's children for the next round are drawn here too (_children, Gumbel-top-k), with one row of
        Gumbel noise made from `gumbel_u` (draft vocab,) and the rank scores `mix`: only the last accepted node's
        are used, and which node that is depends on the draws and u, never on this noise, so they are a fresh
        sample from its row. Why: drawn on the host after the call (the noise's two logarithms over the draft
        vocabulary, a top-k, a second read) they made a sampled round's drafting 0.145 plain steps against 0.079 here
        (docs/performance.md, "Thirty-seventh session").

        Returns every node's draw, the head's output, its log-probabilities at the draft temperature, its
        children's scores and target ids, and the host's block: each node's draw, children's scores and ids as one
        float64 tensor (as _fused_fn's), the round's one read."""
        feats, logits = self._target_forward(tokens, positions, mask=mask, cache_start=slots)
        p = torch.softmax(logits[0].float() / temperature[0, :, None], dim=-1)  # target_probs, no filter
        q = q_logp[0].float().exp()
        if self._draws_kernel:
            draws = torch.ops.eaglespec.tree_draws(p, q, self._kernel_ids, self._draft_of, kids[0], kid_ok[0],
                                                   det[0], u[0])
        else:
            if self._draft_ids is not None:
                q = torch.zeros(q.shape[0], p.shape[-1], device=q.device).index_copy(1, self._draft_ids, q)
            draws = tree_draws(p, q, kids[0], kid_ok[0], u[0], det[0])
        out = self.head.first(self.model.embed_tokens(draws[None]), feats, positions, mask=mask, cache_start=slots)[0]
        lq = self._draft_logprobs(out, 1.0 / temperature[0, :, None])
        scores, ids, _ = self._children_of(lq, gumbel(gumbel_u), mix)
        host = torch.cat([draws[:, None].double(), scores.double(), ids.double()], dim=1)
        return draws, out, lq, scores, ids, host

    def _move_fn(self, src, dst):
        self.model.cache.move_slots(src, dst)

    def _move_both_fn(self, src, dst):
        self.model.cache.move_slots(src, dst)
        self.head.cache.move_slots(src, dst)

    @property
    def fuses_catchup(self) -> bool:
        """Whether greedy rounds run the head's catch-up inside the verification call."""
        return self.fuse_catchup and self._fused_call is not None

    def fuses_sampling(self, params: SamplingParams) -> bool:
        """Whether sampled rounds with these parameters run the rejection sampling and the head's catch-up inside
        the verification call: sampled drafts, and no top-k / top-p filter (the graph draws from the tempered
        distribution only; a filtered one keeps the separate calls)."""
        return (self.fuses_catchup and self.draft_sampling and not params.greedy and params.top_p >= 1
                and not params.top_k)

    def calls_for(self, greedy: bool | None) -> tuple[bool, bool, bool]:
        """(the separate verification sizes and catch-up, the greedy fused verification, the sampled one): which
        ways of verifying generations make at this temperature (greedy True / False; None: both). At T > 0 with
        a top-k / top-p filter, or with top-k drafts, rounds take the separate calls (fuses_sampling); those
        are counted in only for None."""
        fused = self.fuses_catchup and greedy is not False
        sampled = self.fuses_catchup and self.draft_sampling and greedy is not True
        separate = greedy is None or not (fused if greedy else sampled)
        return separate, fused, sampled

    # ---- decoding --------------------------------------------------------------------------------

    def _round_slack(self) -> int:
        """Cache slots a round may use beyond the committed tokens (tree, padding, catch-up)."""
        t = self.tree
        return t.max_nodes + t.max_depth * t.draft_top_k * t.draft_top_k + 2 * (self._pad + 1) + max(AUTO_BUCKETS)

    def _ensure_cache(self, n: int):
        n = -(-n // 256) * 256
        if self.model.cache is None or self.model.cache.max_len < n:
            self.model.setup_cache(n)
        if self.head is not None and (self.head.cache is None or self.head.cache.max_len < n):
            self.head.setup_cache(n)

    def _prefill(self, ids: list[int], timers: _Timers):
        t0 = time.perf_counter()
        x = torch.tensor([ids], device=self.device)
        aux = getattr(self.head, "aux_layers", None)
        # the LM head on the last position only: over every prompt position it was ~15 % of a prefill
        out = self.model(x, torch.arange(len(ids), device=self.device)[None], cache_start=0, logits=False,
                         aux_layers=aux)
        logits = self.model.lm_head(out[0][0, -1:])[0]
        _sync(self.device)
        timers.prefill += time.perf_counter() - t0
        return (out[0] if aux is None else out[2])[0], logits

    def _verify_forward(self, tokens: torch.Tensor, positions: torch.Tensor, cur: int, mask=None):
        return self._target_call(tokens[None], positions[None], cache_start=cur, t=tokens.numel(), mask=mask)

    def _vanilla(self, ids, params, gen, timers) -> Iterator[list[int]]:
        _, logits = self._prefill(ids, timers)
        tok = next_token(logits, params, gen)
        yield [tok]
        cur = len(ids)
        while True:
            t0 = time.perf_counter()
            _, logits, amax = self._verify_forward(torch.tensor([tok], device=self.device),
                                                   torch.tensor([cur], device=self.device), cur)
            tok = int(amax[0]) if params.greedy else next_token(logits[0], params, gen)
            timers.verify += time.perf_counter() - t0
            timers.forwards += 1
            timers.tree_tokens += 1
            timers.accept.append(1)
            cur += 1
            yield [tok]

    @property
    def _pad(self) -> int:
        """Accepted tokens per round, at most (the catch-up's fixed length)."""
        return self.tree.max_accept + 1

    def _catchup(self, new: list[int], feats: torch.Tensor, path: torch.Tensor, cur: int, inputs=None):
        """Feed the accepted (feature, next token) pairs to the head; return the root's hidden, its k children's
        scores and ids, and its log-probabilities. inputs: _draw_inputs's (default: the top-k)."""
        p, dev = self._pad, self.device
        n = len(new)
        toks = torch.zeros(1, p, dtype=torch.long, device=dev)
        toks[0, :n] = torch.tensor(new, device=dev)
        hidden = feats.index_select(0, path)[None]
        pos = (cur + torch.arange(p, device=dev))[None]
        last = torch.tensor([n - 1], device=dev)
        noise, mix = (inputs or self._draw_inputs(None))(1, 1)
        return self._catchup_call(toks, hidden, pos, last, noise, mix, cache_start=cur, t=p)

    def _head_prefill(self, ids: list[int], root: int, feats: torch.Tensor, inputs):
        dev = self.device
        head_tokens = torch.tensor([ids[1:] + [root]], device=dev)
        h = self.head.first(self.model.embed_tokens(head_tokens), feats[None],
                            torch.arange(len(ids), device=dev)[None], cache_start=0)
        root_hidden = h[0, -1]
        scores, ids, lq = self._children(root_hidden[None], *inputs(1, 1))
        return root_hidden, scores[0], ids[0], lq[0]

    def _draw_inputs(self, sampled: "_Sampled | None"):
        """(depth, rows) -> (noise (rows, draft vocab), mix (k + 2,)) for the draft calls: the top-k (zeros, and
        [1, 1, 0...], kept once per size), or, for sampled drafts, fresh Gumbel noise from the generation's
        generator and the positions' scores of that depth (RankAcceptance)."""
        k, dev, vocab = self.tree.draft_top_k, self.device, draft_vocab_size(self.head)
        if sampled is None:
            def top(depth: int, rows: int):
                key = (rows, k)
                if key not in self._top_inputs:
                    mix = torch.zeros(k + 2, device=dev)
                    mix[:2] = 1.0
                    self._top_inputs[key] = (torch.zeros(rows, vocab, device=dev), mix)
                return self._top_inputs[key]
            return top

        def draw(depth: int, rows: int):
            noise = gumbel(torch.rand(rows, vocab, generator=sampled.gen, device=dev))
            return noise, sampled_mix(sampled, depth, dev)
        return draw

    def _choose_tree(self, root: int, cands, depth: int, chain: list[int], policy: TreePolicy | None) -> Tree:
        """The verified tree: fixed for static trees and fixed sizes; the cost model's pick for auto.
        `chain`: the n-gram proposer's continuation, attached below the root beside the head's nodes."""
        host = HostCandidates.read(cands)  # the round's one read while drafting
        nodes, alone = [], []
        if chain:
            host, nodes, alone = attach_chain(host, chain, self._ngram.accept)
        free = frozenset(i for i, a in zip(nodes, alone) if a)
        if cands.fixed is not None:
            keep = cands.fixed
        elif policy is not None:
            _, keep = policy.choose(host.scores, host.depths, depth, free)
            mine = [i for i in keep if i not in free]  # the policy calibrates the head's nodes only
            self._kept = ([host.scores[i] for i in mine], [host.depths[i] for i in mine])
        else:
            keep = top_by_score(host.scores, min(self.tree.total_tokens, len(host)))
        self._round = (list(keep), nodes, free)
        return tree_from_host(root, host, keep, self.device)

    def _sampled_rows(self, cands, tree: Tree) -> tuple[list[int], list[int]]:
        """Sampled drafts: per tree node, the q_logp row it was drawn from and its rank among its siblings (-1 for
        the n-gram chain's own nodes, which the head did not draw)."""
        keep, k = self._round[0], self.tree.draft_top_k
        depths = tree.host_lists()[2]
        rows, ranks = [0], [0]
        for j, c in enumerate(keep, 1):
            row, rank = cands.row_and_rank(c, depths[j], k) if c < len(cands) else (0, -1)
            rows.append(row)
            ranks.append(rank)
        return rows, ranks

    def _tree_draw_inputs(self, cands, tree: Tree, rows: list[int], ranks: list[int], chain: frozenset,
                          params: SamplingParams, sampled: _Sampled):
        """_fused_sampled_fn's inputs past the tree: per node, the temperature, the draft distribution its children
        were drawn from (q_logp's row), their tokens in the order tried (their rank) and which exist, the n-gram
        chain's child (-1: none; tried first, as a proposal of all its mass on one token, whether or not the head
        drew the same token: tree_draws; `chain`: its tree nodes, _chain_nodes), and fresh uniforms from the
        generation's generator for the trials, the final draw and the chain's trial; then the uniforms and the rank
        scores the next round's children are drawn with."""
        n, k, dev = len(tree), self.tree.draft_top_k, self.device
        tokens = tree.host_lists()[0]
        kid_tok, kid_ok, q_row = [[0] * k for _ in range(n)], [[False] * k for _ in range(n)], [0] * n
        det = [-1] * n
        for j, kids in enumerate(tree.children()):
            for c in kids:
                if c in chain:
                    det[j] = tokens[c]
                if ranks[c] >= 0:  # the head's: siblings were drawn without replacement, distinct ranks below k
                    kid_tok[j][ranks[c]], kid_ok[j][ranks[c]] = tokens[c], True
                    q_row[j] = rows[c]
        q = cands.q_logp.index_select(0, torch.tensor(q_row, device=dev))
        u = torch.rand(1, n, k + 2, generator=sampled.gen, dtype=torch.float64, device=dev)
        gumbel_u = torch.rand(draft_vocab_size(self.head), generator=sampled.gen, device=dev)
        return (torch.full((1, n), params.temperature, device=dev), q[None], torch.tensor([kid_tok], device=dev),
                torch.tensor([kid_ok], device=dev), torch.tensor([det], device=dev), u, gumbel_u,
                sampled_mix(sampled, 1, dev))

    def _chain_nodes(self) -> frozenset:
        """The tree nodes the n-gram chain proposed this round (tree node j > 0 is candidate keep[j - 1])."""
        keep, nodes, _ = self._round
        if not nodes:
            return frozenset()
        mine = set(nodes)
        return frozenset(j for j, c in enumerate(keep, 1) if c in mine)

    def _learn(self, path: list[int], policy: TreePolicy | None) -> None:
        """After verification: calibrate the tree policy on the head's nodes and the n-gram proposer on
        the chain's own. path: the accepted tree nodes, root first (tree node j > 0 is candidate keep[j - 1])."""
        keep, nodes, free = self._round
        accepted = [keep[j - 1] for j in path[1:]]
        if policy is not None:
            # the head's nodes on the path come first: a node the head drafted has a drafted parent
            own = next((k for k, c in enumerate(accepted) if c in free), len(accepted))
            policy.observe(*self._kept, own)
        if free:
            kept, hit = set(keep), set(accepted)
            seen, parent_ok = [], True
            for d, c in enumerate(nodes, 1):
                if not (parent_ok and c in kept):
                    break
                if c in free:
                    seen.append((d, c in hit))
                parent_ok = c in hit
            self._ngram.observe([d for d, _ in seen], [ok for _, ok in seen])

    def reset_learning(self) -> None:
        """Forget what the tree policies, the position scores and the n-gram proposer learned (a replayable
        run starts fresh)."""
        self.forget_policies()
        self._switch = None
        self._ngram = None
        self._ngrams = {}
        self._ranks = None

    def forget_policies(self) -> None:
        """Drop the tree policies (they are rebuilt, from the cost table, at their next round)."""
        self.policy = None
        self._policies.clear()

    def _auto_tree(self) -> bool:
        return self.tree.auto and self.tree.kind == "dynamic"

    def _table(self):
        """The cost table the auto tree is sized by (the cached calibration, spot-checked; measured if none)."""
        if self._cost_table is None:
            from .costmodel import load_or_measure
            self._cost_table = load_or_measure(self, (1,) + self.auto_buckets(), log=_notice)
        return self._cost_table

    def _get_policy(self, sampled: bool = False, fused: bool = False) -> TreePolicy | None:
        """The tree policy of this way of drafting: sampled drafts have other scores to calibrate, and fused
        rounds other costs (depth 1 comes with the verification), so each keeps its own."""
        if not self._auto_tree():
            return None
        key = (sampled, fused, self.online_costs)
        if key not in self._policies:
            self._policies[key] = TreePolicy(self._table(), self.auto_buckets(), self.tree.max_depth, fused=fused,
                                             sampled=sampled, online=self.online_costs)
        if not sampled:
            self.policy = self._policies[key]
        return self._policies[key]

    def _get_sampled(self, params: SamplingParams, gen: torch.Generator) -> _Sampled | None:
        """The generation's sampled-draft state, or None where it takes the top-k (greedy, or switched off)."""
        if params.greedy or not self.draft_sampling:
            return None
        k, depth = self.tree.draft_top_k, self.tree.max_depth
        if self._ranks is None or self._ranks.k != k or len(self._ranks.tries) != depth + 1:
            self._ranks = RankAcceptance(depth, k)
        return _Sampled(gen, 1.0 / params.temperature, self._ranks)

    def _get_switch(self) -> SpecSwitch | None:
        """The speculate-or-not switch, opt-in (EAGLESPEC_SPEC_SWITCH=1), with the auto tree only (a fixed
        tree is the user's choice). Measured on the default model (20 MT-bench turns, interleaved, quiet),
        its effect was within run-to-run noise at T = 0 and T = 1 (docs/performance.md), so it is not the
        default."""
        if self._switch is not None:  # installed already (by an earlier generation, or a caller)
            return self._switch
        if not self._auto_tree() or os.environ.get("EAGLESPEC_SPEC_SWITCH", "0") != "1":
            return None
        self._switch = SpecSwitch(self._table().t_verify(1), self._pad)
        return self._switch

    def _get_ngram(self, sampled: bool = False) -> NgramProposer | None:
        """The n-gram proposer of greedy or of sampled rounds: each calibrates its chain's acceptance on its own
        rounds (a chain token is accepted far less often when the target samples)."""
        if not (self.tree.ngram and self.tree.kind == "dynamic"):
            return None
        limit = self.tree.ngram  # within the catch-up's fixed length (_pad = tree.max_accept + 1)
        proposer = self._ngrams.get(sampled)
        if proposer is None or proposer.max_len != limit:
            proposer = self._ngrams[sampled] = NgramProposer(limit)
        self._ngram = proposer
        return proposer

    def auto_buckets(self) -> tuple[int, ...]:
        return tuple(b for b in AUTO_BUCKETS if b <= self.tree.max_nodes) or (self.tree.max_nodes,)

    def _eagle(self, ids, params, gen, timers) -> Iterator[list[int]]:
        if self.head is None:
            raise ValueError("method 'eagle' needs a draft head")
        dev = self.device
        sampled = self._get_sampled(params, gen)
        inputs = self._draw_inputs(sampled)
        # greedy: the argmax a node's head input needs is known inside the verification (_fused_fn); sampled
        # drafts: so is the node's draw, where the rejection sampling runs inside it too (_fused_sampled_fn)
        way = ("sampled-fused" if sampled is not None and self.fuses_sampling(params)
               else "fused" if params.greedy and self.fuses_catchup else "separate")
        policy = self._get_policy(sampled is not None, way != "separate")
        drafter = Drafter(self._expand_call, self.tree)
        # the n-gram chain's tokens are not drawn from the head: verify_sampled (filtered sampling) has no rule for
        # them; tree_draws tries each as a proposal of all its mass on one token
        ngram = None if sampled is not None and way != "sampled-fused" else self._get_ngram(not params.greedy)
        feats, logits = self._prefill(ids, timers)
        root = next_token(logits, params, gen)
        yield [root]
        t0 = time.perf_counter()
        if ngram is not None:
            ngram.reset(ids + [root])
        root_hidden, root_scores, root_ids, root_q = self._head_prefill(ids, root, feats, inputs)
        root_host = None
        cur = len(ids)
        timers.draft += time.perf_counter() - t0
        switch = self._get_switch()
        pending: list[tuple[int, torch.Tensor]] = []  # plain rounds' (token, root feature) since the head caught up
        # The switch is fed wall time from one round's start to the next's: what the caller does with each
        # yield (stop checks, streaming) is paid per round, so per token it weighs more on plain rounds.
        spec_start, spec_tokens, plain_secs = None, 0, 0.0
        while True:
            now = time.perf_counter()
            if spec_start is not None:
                switch.record(True, now - spec_start, spec_tokens)
                spec_start = None
            if switch is not None and switch.plain_next(len(pending)):
                new = self._plain_round(root, cur, params, gen, timers, pending)
                yield new
                root, cur = new[0], cur + 1
                if ngram is not None:
                    ngram.extend(new)
                plain_secs += time.perf_counter() - now
                continue
            t0 = time.perf_counter()
            if pending:  # the head catches up on the plain rounds' tokens before it drafts again
                start = cur - len(pending)
                path_t = torch.tensor(list(range(len(pending))) + [0] * (self._pad - len(pending)), device=dev)
                root_host = None
                root_hidden, root_scores, root_ids, root_q = self._catchup(
                    [tok for tok, _ in pending], torch.cat([f for _, f in pending]), path_t, start, inputs)
                t0 = time.perf_counter()
                switch.record(False, plain_secs + (t0 - now), len(pending))  # the stretch, its catch-up included
                pending.clear()
                plain_secs = 0.0
            t_round = t0
            depth = policy.depth() if policy is not None else self.tree.max_depth
            cands = drafter.draft(root_hidden, root_scores, root_ids, cur, depth, inputs,
                                  root_q if sampled is not None else None, root_host)
            chain = ngram.propose() if ngram is not None else []
            tree = self._choose_tree(root, cands, depth, chain, policy)
            _sync(dev)
            t1 = time.perf_counter()
            n = len(tree)
            path, bonus, new, next_root = self._verify_round(tree, cands, cur, params, gen, sampled, way, inputs)
            self._compact(path, n, cur, both=way != "separate")
            t2 = time.perf_counter()
            if policy is not None:
                policy.observe_time(n, 1e3 * (t2 - t1))
            self._learn(path, policy)
            timers.draft += t1 - t0
            timers.verify += t2 - t1
            timers.forwards += 1
            timers.tree_tokens += n
            timers.accept.append(len(new))
            yield new
            t0 = time.perf_counter()
            root_hidden, root_scores, root_ids, root_q, root_host = next_root()
            root, cur = bonus, cur + len(path)
            if ngram is not None:
                ngram.extend(new)
            timers.draft += time.perf_counter() - t0
            if switch is not None:
                spec_start, spec_tokens = t_round, len(new)

    def _verify_round(self, tree: Tree, cands, cur: int, params: SamplingParams, gen, sampled, way: str, inputs):
        """Verify `tree` after `cur` committed tokens, the way this round's rounds go: "fused" (greedy: one call, the
        head's catch-up and depth 1 inside), "sampled-fused" (the same with the rejection sampling inside) or
        "separate" (the verification, then the catch-up as a call of its own). Returns (the accepted nodes, root
        first; the bonus token; the new tokens; next_root), where next_root() gives the next round's (root hidden,
        children's scores, their ids, the root's draft log-probabilities or None, the children as HostCandidates or
        None): called once the round's tokens have gone to the caller."""
        n, mask = len(tree), tree.ancestor_mask()
        tokens_in, positions = tree.tokens[None], (cur + tree.depths)[None]
        if way == "sampled-fused":
            rows, ranks = self._sampled_rows(cands, tree)
            chain = self._chain_nodes()
            _, out, lq, scores, ids, host = self._fused_sampled_call(
                tokens_in, positions, *self._tree_draw_inputs(cands, tree, rows, ranks, chain, params, sampled),
                cache_start=cur, t=n, mask=mask)
            # the round's one read: every node's draw (by verify_sampled's rule: the token that follows it) and its
            # children for the next round
            block = host.tolist()
            draws = [int(r[0]) for r in block]
            path, bonus, new = greedy_accept(tree, draws)
            sampled.ranks.observe(trials_from_draws(tree, path, draws, ranks, chain))
            return path, bonus, new, self._next_root(out, scores, ids, lq, block, path[-1])
        if way == "fused":
            out, scores, ids, host = self._fused_call(tokens_in, positions, cache_start=cur, t=n, mask=mask)
            block = host.tolist()  # the round's one read: every node's argmax and top-k
            path, bonus, new = greedy_accept(tree, [int(r[0]) for r in block])
            return path, bonus, new, self._next_root(out, scores, ids, None, block, path[-1])
        f, lg, amax = self._verify_forward(tree.tokens, cur + tree.depths, cur, mask)
        if params.greedy:
            path, bonus, new = greedy_accept(tree, amax)
        else:
            if sampled is None:
                path, bonus = verify(tree, lg, params, gen)
            else:
                path, bonus, trials = verify_sampled(tree, lg, params, gen, cands.q_logp,
                                                     *self._sampled_rows(cands, tree), self._draft_ids)
                sampled.ranks.observe(trials)
            tokens = tree.host_lists()[0]  # already on the host: the tree was built from lists
            new = [tokens[i] for i in path[1:]] + [bonus]

        def next_root():
            path_t = torch.tensor(path + [0] * (self._pad - len(path)), device=self.device)
            return *self._catchup(new, f, path_t, cur, inputs), None
        return path, bonus, new, next_root

    def _next_root(self, out, scores, ids, lq, block: list[list[float]], last: int):
        """A fused round's next_root: the head caught up inside the verification, so the last accepted node is the
        next root, and its children are on the host already (a depth-1 round then reads nothing more). out, scores,
        ids, lq: every node's head output, children's scores and target ids, and (sampled rounds; else None)
        log-probabilities; block: the call's host block, each node's [token, k scores, k ids]."""
        k = self.tree.draft_top_k
        host = HostCandidates([int(x) for x in block[last][1 + k:]], [-1] * k, [1] * k, block[last][1:1 + k])
        return lambda: (out[last], scores[last], ids[last], None if lq is None else lq[last], host)

    def _compact(self, path: list[int], n: int, cur: int, both: bool) -> None:
        """Move the accepted nodes' cache entries (the head's too where it ran inside the verification) into the
        slots after the committed tokens."""
        accepted = len(path)
        if path == list(range(accepted)):  # every accepted node is in its slot already: no call
            return
        # padding to the fixed count: slots past the tree copy onto themselves, harmlessly
        pad = [cur + n + i for i in range(accepted, self._pad)]
        slots = torch.tensor([[cur + i for i in path] + pad, list(range(cur, cur + accepted)) + pad],
                             device=self.device)
        self._move_slots(slots[0], slots[1], both)

    def _move_slots(self, src: torch.Tensor, dst: torch.Tensor, both: bool) -> None:
        """Copy the cache slots src onto dst in the target's cache (and the head's, with both)."""
        if not self._draws_kernel:  # cpugemm's kernel is built where the CPU GEMM is: else the compiled graph
            (self._move_both if both else self._move)(src, dst)
            return
        caches = (self.model.cache, self.head.cache) if both else (self.model.cache,)
        held = self._move_bufs[0]
        if len(held) != len(caches) or any(a is not b for a, b in zip(held, caches)):  # rebuilt for a longer context
            self._move_bufs = caches, [b for c in caches for b in c.buffers()]
        torch.ops.eaglespec.move_slots(self._move_bufs[1], src, dst)

    def _plain_round(self, root, cur, params, gen, timers, pending) -> list[int]:
        """One plain decoding step inside an EAGLE generation (the switch says speculating does not pay):
        verify the root alone; its feature waits in `pending` for the head's next catch-up."""
        dev = self.device
        t1 = time.perf_counter()
        one = lambda v: torch.tensor([v], device=dev)  # noqa: E731
        tree = Tree(tokens=one(root), parents=one(-1), depths=one(0))
        f, lg, amax = self._verify_forward(tree.tokens, cur + tree.depths, cur)  # one token: sees every slot
        bonus = int(amax[0]) if params.greedy else verify(tree, lg, params, gen)[1]
        t2 = time.perf_counter()
        timers.verify += t2 - t1
        timers.forwards += 1
        timers.tree_tokens += 1
        timers.accept.append(1)
        pending.append((bonus, f[:1]))
        return [bonus]

    # ---- warm-up and calibration -------------------------------------------------------------------

    def shapes(self) -> dict[str, list[int]]:
        """Every fixed shape a generation can call, by call site."""
        t = self.tree
        verify = {1}
        if t.kind != "dynamic":
            verify.add(t.max_nodes)
        elif t.auto:
            verify.update(self.auto_buckets())
        else:
            verify.add(min(t.max_nodes, t.max_candidates + 1))
        frontier = {t.draft_top_k} if t.kind == "dynamic" else {len(rows) for rows in Drafter(None, t)._plan[0]}
        fused = sorted(n for n in verify if n > 1) if self.fuses_catchup else []
        return {"verify": sorted(verify), "frontier": sorted(frontier), "catch-up": [self._pad], "fused": fused,
                "sampled-fused": fused if self.draft_sampling else []}

    @torch.inference_mode()
    def warmup(self, progress=None, greedy: bool | None = None) -> None:
        """Run (and so compile) every shape once, off to the side of the cache. greedy: True, only what greedy
        generations call (plain steps, the fused verification, the frontier); False, only what T > 0 calls
        without a top-k / top-p filter (plain steps, the sampled fused verification, the frontier; without
        fusion, the verification sizes and the catch-up); None, everything. Why: in a new process each
        of the target's graphs takes ~5-6 s to load from the cache (dynamo traces it again), and a command
        that knows its temperature should not wait for graphs it never calls; one it does call later
        compiles then."""
        self.warmed_for = greedy
        shapes = self.shapes()
        separate, fused, sampled = self.calls_for(greedy)
        steps = [("verify", n) for n in shapes["verify"] if n == 1 or separate]
        if self.head is not None:
            if separate:
                steps += [("catch-up", shapes["catch-up"][0])]
            steps += [("frontier", f) for f in shapes["frontier"]]
            steps += [("verify+catch-up", n) for n in (shapes["fused"] if fused else [])]
            steps += [("verify+catch-up, sampled", n) for n in (shapes["sampled-fused"] if sampled else [])]
        for i, (kind, n) in enumerate(steps):
            if progress:
                progress(i, len(steps), f"{kind} {n}")
            if kind.startswith("verify"):
                self.time_verify_call(n, 64, fused=kind != "verify", sampled=kind.endswith("sampled"))
            else:
                self.time_draft_call("first" if kind == "catch-up" else "step", 64, n)
        if self.head is not None:
            p = self._pad
            if not self._draws_kernel:  # else cpugemm's move_slots: nothing to compile
                self._move(torch.arange(p, device=self.device), torch.arange(p, device=self.device))
                if self._move_both is not None:
                    self._move_both(torch.arange(p, device=self.device), torch.arange(p, device=self.device))
            if self._auto_tree():
                self._table()  # load (and spot-check) the cost table now, not inside the first timed round
        if progress:
            progress(len(steps), len(steps), "done")

    @torch.inference_mode()
    def time_verify_call(self, n: int, context: int, fused: bool = False, sampled: bool = False) -> None:
        """One verification of n tokens after `context` cached ones (cache contents are scratch); fused: the
        greedy rounds' call, with the head's catch-up and depth 1 (_fused_fn); fused and sampled: the sampled
        rounds' (_fused_sampled_fn), every node with a full set of children."""
        dev = self.device
        toks = torch.zeros(n, dtype=torch.long, device=dev)
        pos = context + torch.arange(n, device=dev)
        mask = torch.ones(n, context + n, dtype=torch.bool, device=dev).tril(context)
        if fused and sampled:
            # as the trees sampled rounds verify: the root's children (drawable tokens), the other nodes leaves
            k = self.tree.draft_top_k
            q = torch.full((1, n, draft_vocab_size(self.head)), -9.0, device=dev)
            kids = torch.arange(k, device=dev) if self._draft_ids is None else self._draft_ids[:k]
            kids = kids.expand(1, n, k).contiguous()
            kid_ok = torch.zeros(1, n, k, dtype=torch.bool, device=dev)
            kid_ok[0, 0, :min(k, n - 1)] = True
            det = torch.full((1, n), -1, dtype=torch.long, device=dev)
            u = torch.rand(1, n, k + 2, dtype=torch.float64, device=dev)
            gumbel_u = torch.rand(draft_vocab_size(self.head), device=dev)
            mix = torch.linspace(0.0, -float(k), k + 2, device=dev)  # any rank scores: the shape is what counts
            host = self._fused_sampled_call(toks[None], pos[None], torch.ones(1, n, device=dev), q, kids, kid_ok, det,
                                                                            u, gumbel_u, mix, cache_start=context, t=n, mask=mask)[-1]
            host.tolist()
            return
        if fused:
            amax = self._fused_call(toks[None], pos[None], cache_start=context, t=n, mask=mask)[3]
        else:
            amax = self._verify_forward(toks, pos, context, mask)[2]
        amax.tolist()

    @torch.inference_mode()
    def time_draft_call(self, which: str, context: int, frontier: int | None = None) -> None:
        dev, h = self.device, self.model.args.hidden_size
        if which == "first":
            h *= len(getattr(self.head, "aux_layers", None) or (0,))  # EAGLE-3 feeds on three target layers
            p = self._pad
            feats = torch.zeros(p + 1, h, device=dev, dtype=self.model.embed_tokens.weight.dtype)
            self._catchup([0] * 2, feats, torch.zeros(p, dtype=torch.long, device=dev), context)[2].tolist()
        else:
            f = frontier or self.tree.draft_top_k
            hidden = torch.zeros(1, f, h, device=dev, dtype=self.model.embed_tokens.weight.dtype)
            mask = torch.ones(f, context + f, dtype=torch.bool, device=dev)
            noise, mix = self._draw_inputs(None)(2, f)
            self._expand_call(torch.zeros(1, f, dtype=torch.long, device=dev), hidden,
                              torch.full((1, f), context, device=dev), torch.zeros(f, device=dev), noise, mix,
                              cache_start=context, t=f, mask=mask)[3].tolist()

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               input_ids: list[int] | None = None, method: str = "eagle", max_new_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop: list[str] | str | None = None, ignore_eos: bool = False) -> Iterator[StreamChunk]:
        """Chunks of new text and tokens, one per decoding round; the last one carries the result.
        One stream at a time per Engine (its KV cache lives in the model): a second raises RuntimeError."""
        with _exclusive(self):
            yield from self._stream(prompt, messages, input_ids, method, max_new_tokens, temperature, top_p, top_k,
                                    seed, stop, ignore_eos)

    @torch.inference_mode()
    def _stream(self, prompt, messages, input_ids, method, max_new_tokens, temperature, top_p, top_k, seed, stop,
                ignore_eos) -> Iterator[StreamChunk]:
        params, stops = check_request(method, max_new_tokens, temperature, top_p, top_k, seed, stop)
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if method == "eagle":
            check_tree_fits_head(self.tree, self.head)  # the tree may have been swapped since construction
        ids = self.encode(prompt, messages, input_ids)
        budget = min(max_new_tokens, self.max_context - len(ids))
        self._ensure_cache(len(ids) + budget + self._round_slack())
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        timers = _Timers()
        rounds = (self._eagle if method == "eagle" else self._vanilla)(ids, params, gen, timers)

        stopper = Stopper(self.tokenizer, self.eos_ids, ignore_eos, stops, budget)
        sent, delta, kept, first = 0, "", [], True
        start = time.perf_counter()
        try:
            for new in rounds:
                outcome = stopper.feed(new)
                kept = outcome.kept
                if outcome.done and not first and timers.accept:
                    # a cut round counts what the rule consumed: the kept tokens and an EOS that ended it
                    timers.accept[-1] = outcome.consumed
                first = False
                delta, sent = stream_delta(stopper.text, sent, stopper.hold, outcome.done)
                if outcome.done:
                    break
                yield StreamChunk(delta, kept)
        finally:
            rounds.close()
        elapsed = time.perf_counter() - start
        fwd, out = timers.forwards, stopper.out
        result = GenerationResult(
            text=stopper.text, token_ids=out, prompt_tokens=len(ids), new_tokens=len(out),
            finish_reason=stopper.finish, method=method, target_forwards=fwd,
            tau=sum(timers.accept) / fwd if fwd else 1.0, accept_lengths=list(timers.accept),
            time_s=elapsed, time_prefill_s=timers.prefill, time_draft_s=timers.draft,
            time_verify_s=timers.verify, tokens_per_s=len(out) / elapsed if elapsed > 0 else 0.0,
            tree_tokens=timers.tree_tokens)
        yield StreamChunk(delta, kept, result)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        with contextlib.closing(self.stream(prompt, **kwargs)) as chunks:  # closed now, not whenever GC runs
            for chunk in chunks:
                if chunk.result is not None:
                    return chunk.result
        raise RuntimeError("stream ended without a result")  # unreachable: stream always ends with one
