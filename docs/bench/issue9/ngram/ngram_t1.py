import sys, torch
from collections import Counter
from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig
from eaglespec.ngram import NgramProposer
from eaglespec.bench import load_questions, resolve_dataset, pick
qs = pick(load_questions(resolve_dataset("mt_bench", None)), int(sys.argv[1]))
T = float(sys.argv[2])
eng = Engine.load(compile=False, tree=TreeConfig(auto=True))
stats = Counter()
real = NgramProposer.observe
def obs(self, d, ok):
    stats["verified"] += len(d); stats["accepted"] += sum(ok)
    for dd, o in zip(d, ok): stats[f"d{dd}"] += 1; stats[f"d{dd}ok"] += o
    return real(self, d, ok)
NgramProposer.observe = obs
rp = NgramProposer.propose
def prop(self):
    out = rp(self); stats["rounds"] += 1; stats["proposed"] += bool(out); return out
NgramProposer.propose = prop
for i, q in enumerate(qs):
    eng.generate(messages=[{"role": "user", "content": q.turns[0]}], method="eagle", max_new_tokens=128, temperature=T, seed=i)
print(dict(stats)); print("calibrated", [round(a, 3) for a in eng._ngram.accept])
