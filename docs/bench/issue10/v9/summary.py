"""Headline numbers of after.sh's benchmark runs, per method: tokens/s, speed-up over plain decoding, tau, and
tau over the run's first 20 questions (the issue's "20 questions at T = 1"), from the records of each JSON.
tau is recomputed from the records (sum of accept lengths / rounds) and checked against the whole run's.

    python docs/bench/issue10/v9/summary.py RUN.json [RUN.json ...]
"""
import json
import sys


def tau(records):
    lengths = [a for r in records for a in r["accept_lengths"]]
    return sum(lengths) / len(lengths)


def rate(records):
    return sum(r["new_tokens"] for r in records) / sum(r["time_s"] for r in records)


for path in sys.argv[1:]:
    run = json.load(open(path))
    t = run["settings"]["temperature"]
    recs = run["records"]
    first20 = list(dict.fromkeys(r["question_id"] for r in recs))[:20]
    base = rate([r for r in recs if r["method"] == "vanilla"])
    print(f"{path}: T = {t}, {len({r['question_id'] for r in recs})} questions, greedy identical: {run['greedy_identical']}")
    for m in run["methods"]:
        mine = [r for r in recs if r["method"] == m]
        sub = [r for r in mine if r["question_id"] in first20]
        print(f"  {m:12s} {rate(mine):7.1f} tok/s  {rate(mine) / base:.3f}x  tau {tau(mine):.3f}"
              f"  | first 20 questions: {rate(sub) / rate([r for r in recs if r['method'] == 'vanilla' and r['question_id'] in first20]):.3f}x"
              f"  tau {tau(sub):.3f}")
