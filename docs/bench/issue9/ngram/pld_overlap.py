"""How often would an n-gram (prompt-lookup) guess be right where the head's top-2 is wrong? MT-bench v4 greedy outputs."""
import json, sys, torch
from eaglespec.engine import Engine, _Timers
from eaglespec.bench import load_questions, resolve_dataset
bench = json.load(open(sys.argv[1])); method = sys.argv[2]
eng = Engine.load(compile=False, packed_gemm=False)
torch.set_grad_enabled(False)
questions = {q.question_id: q for q in load_questions(resolve_dataset("mt_bench", None))}
def ngram(ctx, nmax=3, nmin=int(sys.argv[3]) if len(sys.argv) > 3 else 2):
    for n in range(nmax, nmin - 1, -1):
        key = ctx[-n:]
        for j in range(len(ctx) - n - 1, -1, -1):
            if ctx[j:j + n] == key:
                return ctx[j + n: j + n + 2]
    return None
N = h2 = p_any = p_right = p_extra = p2 = 0
for r in [r for r in bench["records"] if r["method"] == method]:
    ids = eng.encode(messages=[{"role": "user", "content": questions[r["question_id"]].turns[0]}])
    seq = ids + r["token_ids"]; L = len(seq); P = len(ids)
    feats, _ = eng._prefill(seq, _Timers())
    h = eng.head.first(eng.model.embed_tokens(torch.tensor([seq[1:] + [0]])), feats[None], torch.arange(L)[None], cache_start=0)[0]
    top = eng._to_target_ids(eng._draft_logprobs(h).topk(2, dim=-1).indices)
    for c in range(P, L - 2):     # root at c, the draft guesses seq[c+1]
        N += 1
        head_ok = seq[c + 1] in top[c - 1].tolist(); h2 += head_ok
        g = ngram(seq[: c + 1])
        if g:
            p_any += 1; ok = g[0] == seq[c + 1]; p_right += ok; p_extra += ok and not head_ok
            p2 += ok and len(g) > 1 and g[1] == seq[c + 2]
print(f"positions {N}: head top-2 right {h2/N:.3f}; n-gram guess exists {p_any/N:.3f}, right {p_right/N:.3f}, "
      f"right where head top-2 wrong {p_extra/N:.3f}; n-gram 2-chain right {p2/N:.3f}")
