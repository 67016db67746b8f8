"""Offline chain accuracy on MT-bench outputs: P(d1 top-1 right), P(d2 top-1 right | d1 right), and the head's confidences."""
import json, sys, torch
from eaglespec.engine import Engine, _Timers
from eaglespec.bench import load_questions, resolve_dataset
bench = json.load(open(sys.argv[1])); method = sys.argv[2]
eng = Engine.load(compile=False, packed_gemm=False, head=sys.argv[3] if len(sys.argv) > 3 else None)
torch.set_grad_enabled(False)
questions = {q.question_id: q for q in load_questions(resolve_dataset("mt_bench", None))}
n = h1s = h2s = 0; c1 = c2 = c1h = c2h = 0.0; sib = 0
for r in [r for r in bench["records"] if r["method"] == method]:
    ids = eng.encode(messages=[{"role": "user", "content": questions[r["question_id"]].turns[0]}])
    seq = ids + r["token_ids"]; L = len(seq); P = len(ids)
    feats, _ = eng._prefill(seq, _Timers())
    emb = eng.model.embed_tokens
    h = eng.head.first(emb(torch.tensor([seq[1:] + [0]])), feats[None], torch.arange(L)[None], cache_start=0)[0]
    lp1 = eng._draft_logprobs(h); s1, t1 = lp1.topk(2, dim=-1); t1 = eng._to_target_ids(t1)
    # depth 2 for every row j: token seq[j+2] (the right d1 token), hidden h[j], position j+1, over slots [0..j] + own
    mask = torch.zeros(L, 2 * L, dtype=torch.bool)
    mask[:, :L] = torch.ones(L, L, dtype=torch.bool).tril()
    mask[torch.arange(L), L + torch.arange(L)] = True
    nxt = torch.tensor([seq[2:] + [0, 0]])
    h2 = eng.head.step(emb(nxt), h[None], (torch.arange(L) + 1)[None], mask=mask, cache_start=L)[0]
    lp2 = eng._draft_logprobs(h2); s2, t2 = lp2.max(-1); t2 = eng._to_target_ids(t2)
    for i in range(P - 1, L - 3):
        n += 1
        hit1 = int(t1[i, 0]) == seq[i + 2]; h1s += hit1; c1 += s1[i, 0].exp().item()
        sib += int(t1[i, 1]) == seq[i + 2]
        if hit1:
            c1h += 1
            hit2 = int(t2[i]) == seq[i + 3]; h2s += hit2; c2 += s2[i].exp().item()
print(f"positions {n}: d1 top-1 {h1s/n:.3f} (mean top-1 prob {c1/n:.3f}); 2nd sibling {sib/n:.3f}; "
      f"d2 top-1 given d1 right {h2s/max(h1s,1):.3f} (mean prob {c2/max(h1s,1):.3f}); chain of 2 {h2s/n:.3f}")
