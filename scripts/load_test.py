#!/usr/bin/env python
"""Bounded load run against a local `eaglespec serve` (127.0.0.1 / localhost only).

    # 8 clients x 10 requests each, after a single-client baseline
    python scripts/load_test.py --url http://127.0.0.1:8000 --clients 8 --requests 10 --max-tokens 64
    # single-client speed through the API: eagle vs vanilla on the same prompts (one server)
    python scripts/load_test.py --url http://127.0.0.1:8000 --speed --prompts-n 5 --max-tokens 128

Prompts: MT-bench first turns from ../shared/datasets/mt_bench.jsonl (next to the repository), a
--prompts JSONL file with the same shape, or a built-in list. Every request is greedy (temperature 0)
unless --temperature says otherwise. The run stops by itself: a fixed number of requests, and no
new request after --max-seconds.
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mt_bench.jsonl"
BUILT_IN = [
    "Explain why the sky is blue in three sentences.",
    "Write a short poem about a lighthouse keeper.",
    "What are the main differences between TCP and UDP?",
    "Give me three tips for learning a new language.",
    "Summarize the plot of Romeo and Juliet.",
    "How does a refrigerator keep food cold?",
    "Write a Python function that checks whether a number is prime.",
    "What should I pack for a weekend hiking trip?",
]


def load_prompts(path: str | None, n: int | None) -> list[str]:
    src = Path(path) if path else MT_BENCH
    if src.is_file():
        prompts = [json.loads(line)["turns"][0] for line in src.read_text().splitlines() if line.strip()]
    elif path:
        raise SystemExit(f"load_test: no such prompts file: {path}")
    else:
        prompts = BUILT_IN
    return prompts[:n] if n else prompts


def check_local(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"load_test: refusing to load {host!r}: only 127.0.0.1 / localhost servers may be targeted")
    return url.rstrip("/")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Api:
    def __init__(self, url: str, key: str | None, timeout: float):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))

    def model(self) -> str:
        r = self.http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def chat(self, body: dict, stream: bool) -> dict:
        """One request; returns {ok, status, latency, ttft, tokens, text, eaglespec, error}."""
        t0 = time.perf_counter()
        out = {"ok": False, "status": None, "latency": None, "ttft": None, "tokens": 0, "text": "",
               "eaglespec": None, "error": None}
        try:
            if not stream:
                r = self.http.post("/v1/chat/completions", json=body)
                out["status"] = r.status_code
                data = r.json()
                if r.status_code == 200:
                    out.update(ok=True, tokens=data["usage"]["completion_tokens"],
                               text=data["choices"][0]["message"]["content"], eaglespec=data.get("eaglespec"))
                else:
                    out["error"] = data.get("error", {}).get("message")
            else:
                body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                    out["status"] = r.status_code
                    if r.status_code != 200:
                        r.read()
                        out["error"] = r.json().get("error", {}).get("message")
                    else:
                        parts = []
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                out["error"] = ev["error"]["message"]
                                break
                            if ev.get("usage"):
                                out["tokens"] = ev["usage"]["completion_tokens"]
                            if ev.get("eaglespec"):
                                out["eaglespec"] = ev["eaglespec"]
                            for ch in ev.get("choices", []):
                                piece = ch.get("delta", {}).get("content")
                                if piece:
                                    out["ttft"] = out["ttft"] or time.perf_counter() - t0
                                    parts.append(piece)
                        out["text"], out["ok"] = "".join(parts), out["error"] is None
        except (httpx.HTTPError, ValueError, KeyError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["latency"] = time.perf_counter() - t0
        return out


def body_for(model: str, prompt: str, args, method: str | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": 0}
    if method:
        body["method"] = method
    return body


def summarize(name: str, results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    taus = [r["eaglespec"]["tau"] for r in ok if r["eaglespec"]]
    statuses: dict[str, int] = {}
    for r in results:
        key = str(r["status"] or "no response")
        statuses[key] = statuses.get(key, 0) + 1
    s = {"phase": name, "requests": len(results), "succeeded": len(ok), "statuses": statuses,
         "latency_p50_s": percentile(lat, 0.5), "latency_p95_s": percentile(lat, 0.95),
         "ttft_p50_s": percentile(ttft, 0.5) if ttft else None, "completion_tokens": tokens, "wall_s": wall,
         "tokens_per_s": tokens / wall if wall > 0 else 0.0,
         "mean_tau": statistics.mean(taus) if taus else None,
         "errors": sorted({r["error"] for r in results if r["error"]})[:5]}
    return s


def print_summary(s: dict):
    ttft = f", TTFT p50 {s['ttft_p50_s']:.2f} s" if s["ttft_p50_s"] is not None else ""
    tau = f", mean tau {s['mean_tau']:.2f}" if s["mean_tau"] is not None else ""
    print(f"[{s['phase']}] {s['succeeded']}/{s['requests']} ok {s['statuses']}; latency p50 {s['latency_p50_s']:.2f} s "
          f"p95 {s['latency_p95_s']:.2f} s{ttft}; {s['completion_tokens']} tokens in {s['wall_s']:.1f} s = "
          f"{s['tokens_per_s']:.1f} tok/s{tau}", flush=True)
    for e in s["errors"]:
        print(f"    error: {e}", flush=True)


def run_load(api: Api, model: str, prompts: list[str], args) -> dict:
    deadline = time.perf_counter() + args.max_seconds
    report = {}
    # warm-up (not counted): first-use allocations on every replica the clients will reach
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(lambda i: api.chat({**body_for(model, prompts[i % len(prompts)], args), "max_tokens": 8}, False),
                      range(args.clients)))
    if args.single:
        t0, single = time.perf_counter(), []
        for i in range(args.single):
            if time.perf_counter() > deadline:
                break
            single.append(api.chat(body_for(model, prompts[i % len(prompts)], args), args.stream))
        report["single"] = summarize("single client", single, time.perf_counter() - t0)
        print_summary(report["single"])

    lock, results = threading.Lock(), []

    def client(c: int):
        for r in range(args.requests):
            if time.perf_counter() > deadline:
                return
            res = api.chat(body_for(model, prompts[(c * args.requests + r) % len(prompts)], args), args.stream)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(client, range(args.clients)))
    report["load"] = summarize(f"{args.clients} clients x {args.requests}", results, time.perf_counter() - t0)
    print_summary(report["load"])
    return report


def run_speed(api: Api, model: str, prompts: list[str], args) -> dict:
    methods = ("vanilla", "eagle")
    for m in methods:  # warm-up: allocations, kernel choices and GPU clocks stay out of the timing
        for i in range(args.warmup):
            api.chat(body_for(model, prompts[i % len(prompts)], args, m), False)
    per = {m: [] for m in methods}
    for p in prompts:
        for m in methods:
            per[m].append(api.chat(body_for(model, p, args, m), False))
    report, same = {}, 0
    for m in methods:
        ok = [r for r in per[m] if r["ok"]]
        tokens, secs = sum(r["tokens"] for r in ok), sum(r["latency"] for r in ok)
        server = [r["eaglespec"]["tokens_per_s"] for r in ok]
        taus = [r["eaglespec"]["tau"] for r in ok]
        report[m] = {"succeeded": len(ok), "requests": len(per[m]), "tokens": tokens,
                     "client_tokens_per_s": tokens / secs if secs else 0.0,
                     "server_tokens_per_s": statistics.mean(server) if server else 0.0,
                     "mean_tau": statistics.mean(taus) if taus else None}
        print(f"[{m}] {len(ok)}/{len(per[m])} ok, {tokens} tokens: {report[m]['client_tokens_per_s']:.1f} tok/s "
              f"through the API ({report[m]['server_tokens_per_s']:.1f} tok/s in the engine), "
              f"mean tau {report[m]['mean_tau'] or 0:.2f}", flush=True)
    same = sum(a["ok"] and b["ok"] and a["text"] == b["text"] for a, b in zip(per["vanilla"], per["eagle"]))
    v, e = report["vanilla"]["client_tokens_per_s"], report["eagle"]["client_tokens_per_s"]
    report["speedup"] = e / v if v else 0.0
    report["identical_outputs"] = f"{same}/{len(prompts)}"
    print(f"speed-up through the API: {report['speedup']:.2f}x; identical outputs {same}/{len(prompts)}"
          + (" (greedy: all in float32; bf16 rounding may flip near-ties)" if args.temperature == 0 else ""),
          flush=True)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (127.0.0.1 / localhost only)")
    p.add_argument("--api-key", default=os.environ.get("EAGLESPEC_API_KEY"))
    p.add_argument("--model", default=None, help="model id (default: the server's)")
    p.add_argument("--clients", "-c", type=int, default=8)
    p.add_argument("--requests", "-r", type=int, default=10, help="requests per client")
    p.add_argument("--single", type=int, default=3, help="single-client requests before the load (0 = skip)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action="store_true", help="stream responses (adds time to first token)")
    p.add_argument("--prompts", default=None, help="JSONL with 'turns' (default: MT-bench first turns)")
    p.add_argument("--prompts-n", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--speed", action="store_true", help="single-client eagle vs vanilla speed check instead")
    p.add_argument("--warmup", type=int, default=2, help="--speed: untimed full-length requests per method")
    p.add_argument("--max-seconds", type=float, default=900, help="no new request after this long")
    p.add_argument("--timeout", type=float, default=600, help="per-request timeout (s)")
    p.add_argument("--json", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1 or args.single < 0:
        p.error("--clients, --requests and --max-tokens must be >= 1, --single >= 0")
    url = check_local(args.url)
    api = Api(url, args.api_key, args.timeout)
    try:
        model = args.model or api.model()
    except httpx.HTTPError as e:
        raise SystemExit(f"load_test: cannot reach {url}: {e}")
    prompts = load_prompts(args.prompts, args.prompts_n or (5 if args.speed else None))
    print(f"server {url}, model {model}, {len(prompts)} prompts, max_tokens {args.max_tokens}", flush=True)
    report = run_speed(api, model, prompts, args) if args.speed else run_load(api, model, prompts, args)
    report["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
