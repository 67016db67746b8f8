"""Would an n-gram continuation attached *below the head's drafts* add accepted tokens? (MT-bench v4 greedy outputs.)

Today's chain is the continuation of the context's own suffix, attached below the root. When the head's
first draft is right but differs from the chain's first token, nothing proposes a second token except the
head's next depth (right 0.38 of the time given the first). Here, at every position, we also look up the
continuation of context + the head's k-th draft and count where it is right, beyond what the root's chain
and the head's second step would already give. Usage: below_head.py BENCH.json METHOD [K]"""
import json, sys, torch
from eaglespec.engine import Engine, _Timers
from eaglespec.bench import load_questions, resolve_dataset
from eaglespec.ngram import NgramProposer
bench = json.load(open(sys.argv[1])); method = sys.argv[2]; K = int(sys.argv[3]) if len(sys.argv) > 3 else 2
eng = Engine.load(compile=False, packed_gemm=False)
torch.set_grad_enabled(False)
questions = {q.question_id: q for q in load_questions(resolve_dataset("mt_bench", None))}
N = d1_head = d1_chain = d1_any = 0
d2_root_chain = d2_below = d2_below_new = 0
below_exists = 0
for r in [r for r in bench["records"] if r["method"] == method]:
    ids = eng.encode(messages=[{"role": "user", "content": questions[r["question_id"]].turns[0]}])
    seq = ids + r["token_ids"]; L = len(seq); P = len(ids)
    feats, _ = eng._prefill(seq, _Timers())
    h = eng.head.first(eng.model.embed_tokens(torch.tensor([seq[1:] + [0]])), feats[None], torch.arange(L)[None], cache_start=0)[0]
    top = eng._to_target_ids(eng._draft_logprobs(h).topk(K, dim=-1).indices).tolist()
    ng = NgramProposer(4)
    ng.reset(seq[:P])
    for c in range(P, L - 2):     # the root is seq[c] (already in the context); drafts guess seq[c+1], seq[c+2]
        ng.extend([seq[c]]) if len(ng.tokens) == c else None
        N += 1
        chain = ng.propose()
        heads = top[c - 1]
        ok_head = seq[c + 1] in heads; ok_chain = bool(chain) and chain[0] == seq[c + 1]
        d1_head += ok_head; d1_chain += ok_chain; d1_any += ok_head or ok_chain
        root2 = ok_chain and len(chain) > 1 and chain[1] == seq[c + 2]
        d2_root_chain += root2
        # below the head's right draft (if it is not the chain's first token, which already has the chain below)
        if ok_head and not (ok_chain):
            probe = NgramProposer(4); probe.tokens = ng.tokens + [seq[c + 1]]; probe.after = ng.after
            # the suffix lookup only needs the index of the context before; the new token extends the suffix
            g = probe.propose()
            below_exists += bool(g)
            if g and g[0] == seq[c + 2]:
                d2_below += 1
print(f"positions {N}: d1 right: head top-{K} {d1_head/N:.3f}, root chain {d1_chain/N:.3f}, either {d1_any/N:.3f}")
print(f"d2 right via the root chain {d2_root_chain/N:.3f}; head right, chain not: {(d1_any-d1_chain)/N:.3f} of positions, "
      f"an n-gram below it exists {below_exists/N:.3f}, right {d2_below/N:.3f}")
