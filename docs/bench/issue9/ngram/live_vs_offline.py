"""Does live depth-1 acceptance match the head's offline (teacher-forced) top-1 on the same text?"""
import json, sys, torch
from eaglespec.engine import Engine, _Timers
bench = json.load(open(sys.argv[1])); method = sys.argv[2] if len(sys.argv) > 2 else "eagle"
qs = {}
import eaglespec.bench as B
recs = [r for r in bench["records"] if r["method"] == method]
# prompts: re-encode the question like the bench does
from eaglespec.bench import load_questions
eng = Engine.load(compile=False, packed_gemm=False)
torch.set_grad_enabled(False)
from eaglespec.bench import resolve_dataset
questions = {q.question_id: q for q in load_questions(resolve_dataset("mt_bench", None))}
from collections import defaultdict
cat = defaultdict(lambda: [0, 0])
bypos = defaultdict(lambda: [0, 0])
tot = hit1 = live = viol = rounds = hitk = 0; pos_all = hit_all = 0
for r in recs[: int(sys.argv[3]) if len(sys.argv) > 3 else None]:
    q = questions[r["question_id"]]
    ids = eng.encode(messages=[{"role": "user", "content": q.turns[0]}])
    assert len(ids) == r["prompt_tokens"], (len(ids), r["prompt_tokens"])
    out = r["token_ids"]; seq = ids + out
    feats, _ = eng._prefill(seq, _Timers())
    toks = torch.tensor([seq[1:] + [0]])
    h = eng.head.first(eng.model.embed_tokens(toks), feats[None], torch.arange(len(seq))[None], cache_start=0)[0]
    lp = eng._draft_logprobs(h)
    top = eng._to_target_ids(lp.topk(4, dim=-1).indices)  # (L, 4): row i predicts seq[i+2]
    P = len(ids)
    for i in range(P - 1, len(seq) - 2):
        pos_all += 1; hh = int(top[i, 0] == seq[i + 2]); hit_all += hh
        cat[q.category][0] += 1; cat[q.category][1] += hh
        b = (i - P + 1) // 32; bypos[b][0] += 1; bypos[b][1] += hh
    c = P
    for a in r["accept_lengths"]:
        if c + 1 >= len(seq): break
        rounds += 1
        h1 = int(top[c - 1, 0] == seq[c + 1]); hit1 += h1
        hitk += int(seq[c + 1] in top[c - 1, :2].tolist())
        live += int(a >= 2)
        viol += int(h1 and a < 2)
        c += a
print(f"{method}: rounds {rounds}; offline top-1 at round starts {hit1/rounds:.3f}, top-2 {hitk/rounds:.3f}; "
      f"live depth-1 acceptance {live/rounds:.3f}; rounds where offline top-1 hit but live rejected: {viol}; "
      f"offline top-1 over all output positions {hit_all/pos_all:.3f} ({pos_all})")
print({k: round(v[1]/v[0], 3) for k, v in cat.items()})
print("by 32-token block:", {k: round(v[1]/v[0], 3) for k, v in sorted(bypos.items())})
