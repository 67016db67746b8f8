"""A/B in one interleaved run: the auto tree with today's buckets vs with more (small) buckets."""
import dataclasses, json, sys, time
from eaglespec.cli import build_parser, build_engine, compile_progress
from eaglespec import bench
from eaglespec.engine import Engine

sets = [tuple(int(x) for x in b.split(",")) for b in sys.argv[1].split(";")]
limit = int(sys.argv[2]); temp = float(sys.argv[3]); out = sys.argv[4]
args = build_parser().parse_args(["bench", "--dataset", "mt_bench", "--max-turns", "1", "--limit", str(limit),
                                  "--max-new-tokens", "128", "--temperature", str(temp)])
engine = build_engine(args)
alts = {}
for i, buckets in enumerate(sets):
    e2 = Engine(engine.model, engine.tokenizer, engine.head, engine.tree, engine.max_context, engine.compile_mode or False)
    e2._target_call, e2._move = engine._target_call, engine._move
    e2.auto_buckets = (lambda b=buckets: b)
    e2.warmup(progress=compile_progress())
    alts[f"eagle@b{i}"] = e2
qs = bench.pick(bench.load_questions(bench.resolve_dataset("mt_bench", None)), limit)
qs = [dataclasses.replace(q, turns=q.turns[:1]) for q in qs]
methods = {"vanilla": bench.build_method("vanilla", engine, None), "eagle": bench.build_method("eagle", engine, None),
           **{k: bench.build_method("eagle", e, None) for k, e in alts.items()}}
t0 = time.time()
recs = bench.run_bench(engine, qs, methods, 128, temp, 0, progress=True)
figs = bench.summarize(recs, methods, temp)
json.dump({"buckets": sets, "methods": figs, "records": recs,
           "tables": {k: e._cost_table.to_json() for k, e in alts.items() if e._cost_table}}, open(out, "w"), indent=1)
for k, f in figs.items():
    print(k, {x: f.get(x) for x in ("tokens_per_s", "speedup", "speedup_median", "tau", "round_cost_steps",
                                     "draft_cost_steps", "mean_tree_tokens", "greedy_identical")})
print("wall", time.time() - t0)
