"""`eaglespec generate` and `eaglespec chat`."""
from __future__ import annotations

import json
import sys

from .cli import add_engine_args, add_sampling_args, build_engine


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (streamed)")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
    p.add_argument("--method", default="eagle", choices=["eagle", "vanilla"])
    p.add_argument("--compare", action="store_true",
                   help="run plain decoding and EAGLE on the prompt and print both speeds, the speed-up and tau")
    p.add_argument("--repeats", type=int, default=3,
                   help="with --compare: interleaved pairs of runs the speed-up is the median of (default: 3)")
    p.add_argument("--raw", action="store_true", help="complete the text as is (no chat template)")
    p.add_argument("--json", action="store_true", help="print the result and statistics as one JSON object")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run_generate)

    c = sub.add_parser("chat", help="interactive chat (one line a turn; /exit or EOF ends)")
    c.add_argument("--method", default="eagle", choices=["eagle", "vanilla"])
    c.add_argument("--system", default=None, help="system prompt (default: none)")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=run_chat)


def _check_before_loading(args, kw: dict) -> None:
    """Bad arguments fail in a second, not after the model has loaded (tens of seconds)."""
    from .engine import check_request  # torch: imported only when a command runs, not for --help
    check_request(args.method, kw["max_new_tokens"], kw["temperature"], kw["top_p"], kw["top_k"], kw["seed"], kw["stop"])


def _request(args, prompt: str) -> dict:
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, seed=args.seed, stop=args.stop)
    if getattr(args, "raw", False):  # chat has no --raw
        kw["prompt"] = prompt
    else:
        kw["messages"] = [{"role": "user", "content": prompt}]
    return kw


def _stats_line(r) -> str:
    return (f"[{r.method}] {r.new_tokens} tokens in {r.time_s:.2f} s = {r.tokens_per_s:.1f} tok/s, "
            f"tau {r.tau:.2f}, {r.target_forwards} target forwards, draft {r.time_draft_s:.2f} s / "
            f"verify {r.time_verify_s:.2f} s, finish: {r.finish_reason}")


def _stream(engine, kw, method, show: bool):
    result = None
    for chunk in engine.stream(method=method, **kw):
        if show and chunk.text:
            print(chunk.text, end="", flush=True)
        result = chunk.result or result
    if show:
        print(flush=True)
    return result


def _warms_for(args) -> bool | None:
    """Engine.warmup's `greedy` for this command's sampling settings: a filter (top-k / top-p) at T > 0 takes
    the separate calls, which only the full warm-up covers."""
    if args.temperature == 0:
        return True
    return False if args.top_p >= 1 and not args.top_k else None


def run_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    if args.compare and args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    kw = _request(args, prompt)
    _check_before_loading(args, kw)
    engine = build_engine(args, greedy=_warms_for(args))
    engine.encode(**{k: kw[k] for k in ("prompt", "messages") if k in kw})  # validate before loading time
    if not args.compare:
        r = _stream(engine, kw, args.method, show=not args.json)
        if args.json:
            print(json.dumps({**r.to_dict(), "head": engine.head_source}))
        else:
            print(_stats_line(r), file=sys.stderr)
        return 0
    # Warm up both paths once (allocations, kernel selection) so neither pays it in the timing.
    warm = {**kw, "max_new_tokens": 8}
    for m in ("vanilla", "eagle"):
        _stream(engine, warm, m, show=False)
    results = {}
    for m in ("vanilla", "eagle"):
        if not args.json:
            print(f"--- {m} ---", flush=True)
        results[m] = _stream(engine, kw, m, show=not args.json)
        if not args.json:
            print(_stats_line(results[m]), flush=True)
    v, e = results["vanilla"], results["eagle"]
    speedup, rates = _median_speedup(engine, kw, v, e, args.repeats)
    same = v.token_ids == e.token_ids
    if args.json:
        print(json.dumps({"vanilla": v.to_dict(), "eagle": e.to_dict(), "speedup": speedup, "pairs": rates,
                          "identical": same, "head": engine.head_source}))
    else:
        print(f"\nspeed-up {speedup:.2f}x (median of {len(rates)} interleaved pairs; this one: eagle "
              f"{e.tokens_per_s:.1f} vs vanilla {v.tokens_per_s:.1f} tok/s), "
              f"tau {e.tau:.2f}, head: {engine.head_source}, "
              + ("outputs identical" if same else "outputs differ (sampling draws differ)" if args.temperature > 0
                 else "OUTPUTS DIFFER"))
    return 0


def _median_speedup(engine, kw, v, e, repeats: int) -> tuple[float, list[dict]]:
    """The speed-up as the median over `repeats` interleaved (vanilla, eagle) pairs, the streamed pair
    first: one pair of a ~2 s generation each moves by ±10 % with what else the machine does."""
    pairs = [(v.tokens_per_s, e.tokens_per_s)]
    for i in range(repeats - 1):
        order = ("eagle", "vanilla") if i % 2 == 0 else ("vanilla", "eagle")  # alternate who goes first
        got = {m: _stream(engine, kw, m, show=False).tokens_per_s for m in order}
        pairs.append((got["vanilla"], got["eagle"]))
    rates = [{"vanilla": a, "eagle": b} for a, b in pairs]
    ratios = sorted(b / a for a, b in pairs if a)
    return (ratios[len(ratios) // 2] if ratios else 0.0), rates


def run_chat(args) -> int:
    _check_before_loading(args, _request(args, "-"))
    engine = build_engine(args, greedy=_warms_for(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            r = _stream(engine, {"messages": messages, "max_new_tokens": args.max_new_tokens,
                                 "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                 "seed": args.seed, "stop": args.stop}, args.method, show=True)
        except ValueError as e:  # e.g. the conversation outgrew the context: say so, keep the session
            messages.pop()
            print(f"eaglespec: error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": r.text})
        print(_stats_line(r), file=sys.stderr)
