"""A/B in one interleaved run: the auto tree with the n-gram chain (the default) vs the head's drafts only.

    python docs/bench/issue9/ngram/ngram_ab.py LIMIT TEMPERATURE OUT.json [NGRAM_B [NGRAM_A]]

Method `eagle` runs the tree with --ngram NGRAM_A (default: the default, 4), `eagle@ngramB` with NGRAM_B
(default 0: the head's drafts only); both share the target's compiled calls.
"""
import dataclasses, json, sys, time
from eaglespec.cli import build_parser, build_engine, compile_progress
from eaglespec import bench
from eaglespec.engine import Engine

limit = int(sys.argv[1]); temp = float(sys.argv[2]); out = sys.argv[3]
alt = int(sys.argv[4]) if len(sys.argv) > 4 else 0
main = ["--ngram", sys.argv[5]] if len(sys.argv) > 5 else []
args = build_parser().parse_args(["bench", "--dataset", "mt_bench", "--max-turns", "1", "--limit", str(limit),
                                  "--max-new-tokens", "128", "--temperature", str(temp), *main])
engine = build_engine(args)
tree_b = dataclasses.replace(engine.tree, ngram=alt)
e2 = Engine(engine.model, engine.tokenizer, engine.head, tree_b, engine.max_context, engine.compile_mode or False)
e2._target_call, e2._move = engine._target_call, engine._move
e2.warmup(progress=compile_progress())
qs = bench.pick(bench.load_questions(bench.resolve_dataset("mt_bench", None)), limit)
qs = [dataclasses.replace(q, turns=q.turns[:1]) for q in qs]
methods = {"vanilla": bench.build_method("vanilla", engine, None), "eagle": bench.build_method("eagle", engine, None),
           f"eagle@ngram{alt}": bench.build_method("eagle", e2, None)}
t0 = time.time()
recs = bench.run_bench(engine, qs, methods, 128, temp, 0, progress=True)
figs = bench.summarize(recs, methods, temp)
json.dump({"trees": {"eagle": dataclasses.asdict(engine.tree), f"eagle@ngram{alt}": dataclasses.asdict(tree_b)},
           "methods": figs, "records": recs}, open(out, "w"), indent=1)
for k, f in figs.items():
    print(k, {x: f.get(x) for x in ("tokens_per_s", "speedup", "speedup_median", "tau", "round_cost_steps",
                                     "draft_cost_steps", "mean_tree_tokens", "acceptance_by_depth", "greedy_identical")})
print("wall", time.time() - t0)
