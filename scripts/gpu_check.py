"""The CUDA check: run on a machine with an NVIDIA GPU, in the repository root, with torch, transformers,
tokenizers, safetensors and scipy installed (no model download: every model here is built at random).

    PYTHONPATH=. python3 scripts/gpu_check.py --out DIR [--smollm2-config FOLDER --head heads/smollm2-135m-instruct]

What it checks, each part on its own so one failure does not hide the others (DIR/gpu_check.json has
every result, DIR/gpu_check.log the log):
  1. greedy lossless on CUDA, fp32: every family x {random EAGLE-1, random EAGLE-3 head} x every tree
     kind (and the auto size with a synthetic cost table), token for token against plain decoding
     (a difference only at a tie of the target, top-2 logits within 1e-4);
  2. heads that draft well (the tests' oracle pairs, EAGLE-1 and EAGLE-3): tau and identity, fp32 and
     bf16 (bf16 verification of a tree and one-token decoding round differently, so the bf16 rows count
     how many prompts match and how close the target's top-2 were where they did not);
  3. the sampling chi-square on CUDA (first three tokens against the target's exact joint distribution);
  4. the compiled engine on CUDA (torch.compile's CUDA default mode): identity and tau;
  5. features -> train (EAGLE-1 and EAGLE-3, bf16 autocast) -> generate through the CLI on CUDA;
  6. with --smollm2-config: a target with SmolLM2-135M's exact shapes (random weights: the cost of a
     verification does not depend on the weights), `eaglespec calibrate` eager and compiled, bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

from eaglespec.costmodel import CostTable
from eaglespec.engine import Engine
from eaglespec.head import random_eagle3_head, random_head
from eaglespec.loading import load_target
from eaglespec.sampling import SamplingParams
from eaglespec.testing import (FAMILIES, eagle3_oracle_pair, exact_continuations, make_tiny_checkpoint, oracle_pair,
                               random_prompts)
from eaglespec.tree import TreeConfig

NEW = 32
RESULTS: dict = {}
LOG = None


def log(*a):
    text = " ".join(str(x) for x in a)
    print(text, flush=True)
    if LOG is not None:
        LOG.write(text + "\n")
        LOG.flush()


def part(name):
    """Run one part, record its result or its traceback, and its wall time."""
    def wrap(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            log(f"== {name}")
            try:
                RESULTS[name] = {"ok": True, **(fn(*a, **k) or {})}
            except Exception as e:  # noqa: BLE001 - a check script reports every failure and goes on
                RESULTS[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
                log(traceback.format_exc())
            RESULTS[name]["seconds"] = round(time.perf_counter() - t0, 1)
            log(f"   -> {json.dumps({k: v for k, v in RESULTS[name].items() if k != 'trace'})[:600]}")
        return run
    return wrap


def gen(engine, prompt, method="eagle"):
    return engine.generate(input_ids=prompt, method=method, max_new_tokens=NEW, ignore_eos=True)


def tie_gap(model, prompt, got, want):
    """None if identical; else the target's top-2 logit gap (fp32 full forward) where they first differ."""
    if got == want:
        return None
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    seq = torch.tensor([prompt + want[:i]], device=model.embed_tokens.weight.device)
    with torch.inference_mode():
        _, logits = model(seq, torch.arange(seq.shape[1], device=seq.device)[None])
    top2 = logits[0, -1].float().topk(2).values
    return float(top2[0] - top2[1])


def compare(engine, model, ps, want):
    same, gaps, taus = 0, [], []
    for p, w in zip(ps, want):
        r = gen(engine, p)
        taus.append(r.tau)
        g = tie_gap(model, p, r.token_ids, w)
        if g is None:
            same += 1
        else:
            gaps.append(g)
    return {"same": same, "of": len(ps), "tie_gaps": [round(g, 6) for g in gaps],
            "tau": round(sum(taus) / len(taus), 3)}


FLAT = CostTable(verify_ms={1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}, draft_first_ms=0.1, draft_step_ms=0.1)


@part("1 greedy lossless, fp32, every family x head x tree")
def greedy_families(dev):
    rows, bad = [], []
    for fam in FAMILIES:
        with tempfile.TemporaryDirectory() as d:
            model, _ = load_target(str(make_tiny_checkpoint(Path(d) / fam, fam)), device=dev, dtype=torch.float32)
        ps = random_prompts(4, seed=1)
        want = [gen(Engine(model), p, "vanilla").token_ids for p in ps]
        for hname, make in (("eagle1", random_head), ("eagle3", random_eagle3_head)):
            head = make(model.args, seed=3).to(dev).eval().requires_grad_(False)
            for kind, auto in (("dynamic", False), ("static", False), ("chain", False), ("dynamic", True)):
                tree = TreeConfig(kind=kind, auto=auto)
                eng = Engine(model, head=head, tree=tree, cost_table=FLAT if auto else None)
                res = compare(eng, model, ps, want)
                row = {"family": fam, "head": hname, "tree": kind + ("-auto" if auto else ""), **res}
                rows.append(row)
                if any(g >= 1e-4 for g in res["tie_gaps"]):
                    bad.append(row)
    log(f"   {sum(r['same'] for r in rows)}/{sum(r['of'] for r in rows)} identical; mismatches not at a tie: {len(bad)}")
    if bad:
        raise AssertionError(f"greedy EAGLE differs from plain decoding, not at a tie: {bad[:3]}")
    return {"rows": rows}


def oracle(kind, dev, dtype):
    model, head = (oracle_pair(noise=0.3, logit_scale=3.0) if kind == "eagle1"
                   else eagle3_oracle_pair(noise=0.1, logit_scale=3.0))
    return model.to(dev, dtype), head.to(dev, dtype)


@part("2 heads that draft well (oracle pairs), fp32 and bf16")
def good_heads(dev):
    out, bad = [], []
    for hname in ("eagle1", "eagle3"):
        for dtype in (torch.float32, torch.bfloat16):
            model, head = oracle(hname, dev, dtype)
            ps = random_prompts(12, seed=2)
            want = [gen(Engine(model), p, "vanilla").token_ids for p in ps]
            for kind in ("dynamic", "static", "chain"):
                res = compare(Engine(model, head=head, tree=TreeConfig(kind=kind)), model, ps, want)
                row = {"head": hname, "dtype": str(dtype).removeprefix("torch."), "tree": kind, **res}
                out.append(row)
                log("  ", row)
                if dtype == torch.float32 and any(g >= 1e-4 for g in res["tie_gaps"]):
                    bad.append(row)
                if dtype == torch.float32 and res["tau"] < 1.3:
                    bad.append({**row, "why": "tau < 1.3: the head does not draft well enough to test acceptance"})
    if bad:
        raise AssertionError(f"fp32 failures: {bad[:3]}")
    return {"rows": out}


@part("3 sampling chi-square on CUDA")
def sampling(dev, draws=1500):
    import numpy as np
    import scipy.stats
    rows = []
    for hname in ("eagle1", "eagle3"):
        if hname == "eagle1":
            model, head = oracle_pair(vocab_size=8, logit_scale=3.0, noise=0.3)
        else:
            model, head = eagle3_oracle_pair(vocab_size=8, logit_scale=3.0, noise=0.1)
        model, head = model.to(dev), head.to(dev)
        params = SamplingParams(temperature=1.0)
        engine = Engine(model, head=head, tree=TreeConfig(top_k=3, depth=3, total_tokens=8))
        prompt = [1, 2, 3]
        expected = exact_continuations(model, prompt, 3, params)
        counts, accepted = Counter(), 0
        for seed in range(draws):
            r = engine.generate(input_ids=prompt, max_new_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
            counts[tuple(r.token_ids)] += 1
            accepted += r.accept_lengths[0] > 1
        keys = sorted(expected)
        exp = np.array([expected[k] for k in keys])
        obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
        pooled = exp * obs.sum() / exp.sum() >= 5  # cells too rare for the chi-square are pooled into one
        o = np.append(obs[pooled], obs[~pooled].sum())
        e = np.append(exp[pooled], exp[~pooled].sum()) * obs.sum() / exp.sum()
        p = float(scipy.stats.chisquare(o, e).pvalue)
        impossible = sum(c for k, c in counts.items() if k not in expected)
        rows.append({"head": hname, "draws": draws, "first_round_accepting": accepted, "p_value": p,
                     "impossible_draws": impossible})
        log("  ", rows[-1])
        if p < 1e-3 or impossible or accepted < draws // 4:
            raise AssertionError(f"sampling on CUDA does not follow the target: {rows[-1]}")
    return {"rows": rows}


@part("4 compiled engine on CUDA")
def compiled(dev):
    rows = []
    for hname in ("eagle1", "eagle3"):
        model, head = oracle(hname, dev, torch.float32)
        ps = random_prompts(6, seed=4)
        t0 = time.perf_counter()
        plain = Engine(model, compile=True)
        want = [gen(plain, p, "vanilla").token_ids for p in ps]
        eng = Engine(model, head=head, compile=True)
        res = compare(eng, model, ps, want)
        rows.append({"head": hname, "mode": eng.compile_mode, **res, "seconds": round(time.perf_counter() - t0, 1)})
        log("  ", rows[-1])
        if any(g >= 1e-4 for g in res["tie_gaps"]):
            raise AssertionError(f"compiled greedy EAGLE differs from plain decoding: {rows[-1]}")
    return {"rows": rows}


def cli(*args, timeout=400):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", "import sys; from eaglespec.cli import main; sys.exit(main())", *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    tail = (p.stdout + p.stderr)[-1500:]
    log(f"   $ eaglespec {' '.join(args)}  -> rc {p.returncode} in {time.perf_counter() - t0:.1f} s")
    if p.returncode != 0:
        raise RuntimeError(f"eaglespec {args[0]} failed (rc {p.returncode}): {tail}")
    return p.stdout, tail


@part("5 features -> train -> generate through the CLI on CUDA")
def cli_pipeline(dev, work: Path):
    tiny = make_tiny_checkpoint(work / "tiny", "llama")
    data = work / "chats.jsonl"
    with data.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: what is {i} times 7?"},
                                             {"role": "assistant", "content": f"{i} times 7 is {7 * i}. " * 3}]}) + "\n")
    out = {}
    for arch in ("eagle", "eagle3"):
        feats, head = work / f"feats-{arch}", work / f"head-{arch}"
        cli("features", "--model", str(tiny), "--device", dev, "--data", str(data), "--arch", arch,
            "--out", str(feats), "--max-len", "128")
        extra = ["--ttt-steps", "3"] if arch == "eagle3" else []
        cli("train", "--model", str(tiny), "--device", dev, "--features-dir", str(feats), "--arch", arch, *extra,
            "--out", str(head), "--max-steps", "12", "--batch-tokens", "512", "--save-every", "6",
            "--eval-conversations", "4")
        stdout, _ = cli("generate", "--model", str(tiny), "--head", str(head / "head"), "--device", dev,
                        "--compare", "--json", "--max-new-tokens", "24", "Question 3: what is 3 times 7?")
        out[arch] = stdout.strip()[-300:]
    return {"outputs": out}


def smollm2_random(config: Path, work: Path) -> Path:
    """A target with SmolLM2-135M's config and tokenizer and random bf16 weights (built once)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM
    folder = work / "smollm2-random"
    if not (folder / "config.json").is_file():
        cfg = AutoConfig.from_pretrained(str(config))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(folder))
        for f in config.iterdir():
            if f.name != "config.json" and f.is_file():
                shutil.copy(f, folder / f.name)
    return folder


def calibrate(dev, config: Path, head: str, work: Path, out_dir: Path, mode: str):
    @part(f"6 SmolLM2-135M shapes: calibrate on CUDA, bf16, {mode.strip('-')}")
    def run():
        folder = smollm2_random(config, work)
        stdout, _ = cli("calibrate", "--model", str(folder), "--head", head, "--device", dev, "--dtype", "bfloat16",
                        "--sizes", "1,2,3,4,6,8,12,16,24,32,48,64", "--json", mode, "--reps", "30", timeout=420)
        table = json.loads(stdout.strip().splitlines()[-1])
        (out_dir / f"calibrate-{mode.strip('-')}.json").write_text(json.dumps(table, indent=1))
        base = table["verify_ms"]["1"]
        log("   T(n)/T(1):", {n: round(ms / base, 2) for n, ms in table["verify_ms"].items()}, "T(1) ms", round(base, 3))
        return {"table": table}
    run()


def main() -> int:
    global LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smollm2-config", default=None, help="folder with SmolLM2's config.json and tokenizer files")
    ap.add_argument("--head", default="heads/smollm2-135m-instruct")
    ap.add_argument("--parts", default="2,6e,3,5,1,6c,4", help="parts to run, in this order (6e/6c: eager/compiled)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG = (out / "gpu_check.log").open("w")
    dev = a.device
    RESULTS["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                      "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    log(RESULTS["env"])
    parts = a.parts.split(",")
    work = Path(tempfile.mkdtemp())
    steps = {"1": lambda: greedy_families(dev), "2": lambda: good_heads(dev), "3": lambda: sampling(dev),
             "4": lambda: compiled(dev), "5": lambda: cli_pipeline(dev, work),
             "6e": lambda: calibrate(dev, Path(a.smollm2_config), a.head, work, out, "--eager"),
             "6c": lambda: calibrate(dev, Path(a.smollm2_config), a.head, work, out, "--compile")}
    unknown = [k for k in parts if k not in steps]
    if unknown:
        ap.error(f"unknown --parts {','.join(unknown)}; known: {','.join(steps)}")
    for key in parts:  # in the order given: the most wanted first, in case the time runs out
        if key.startswith("6") and not a.smollm2_config:
            continue
        steps[key]()
        (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1))  # each part's result as it lands
    failed = [k for k, v in RESULTS.items() if isinstance(v, dict) and v.get("ok") is False]
    log(f"failed parts: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
