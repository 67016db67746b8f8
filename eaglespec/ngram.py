"""A second proposer for the draft tree: n-gram lookup in the context ("prompt lookup").

Why: a small target repeats itself (lists, restated questions, code it already wrote), and the
head is weak exactly where that text is: its first-token accuracy on the target's MT-bench answers is
0.45. Measured offline on the 80 MT-bench first answers of SmolLM2-135M (T = 0): where the last 2-4
tokens occurred earlier in the context, the tokens that followed them then are right 73 % of the
time, and right where the head's two best guesses are both wrong at 12 % of all positions; two such
tokens in a row are right at 26 % of positions. So each round we attach the continuation of the
longest earlier match below the root, as one chain, beside the head's candidates. Verification does
not care who proposed a node: greedy keeps the longest matching path; with top-k drafts recursive rejection
sampling treats every child as a fixed candidate; with drafts sampled from the head, the chain's token is
tried first under its parent, as a proposal of all its mass on one token (verify.tree_draws, `det`). So the
output stays exactly the target's, token for token or in distribution.

The chain's own nodes are scored with acceptance rates calibrated online (per depth, on nodes that
only the chain proposed), so the cost-model policy ranks them with the head's candidates and keeps
them only when they pay.
"""
from __future__ import annotations

import math

from .tree import HostCandidates

MIN_N, MAX_N = 2, 4   # a 1-token match is right 22 % of the time here: not worth a verified slot
PRIOR = 0.5           # chance a chain-only node is accepted given its parent was, before any round is seen
EMA = 0.05


class NgramProposer:
    """The context's n-grams, indexed as tokens arrive, and calibrated chain acceptance."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.accept = [PRIOR] * (max_len + 1)   # [d]: P(chain-only node at depth d accepted | parent accepted)
        self.reset([])

    def reset(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []
        self.after: dict[tuple, int] = {}   # n-gram -> index of the token after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        ctx, after = self.tokens, self.after
        for t in tokens:
            ctx.append(t)
            i = len(ctx) - 1
            for n in range(MIN_N, MAX_N + 1):
                if i >= n:
                    after[tuple(ctx[i - n:i])] = i

    def propose(self) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix (≤ max_len tokens)."""
        ctx = self.tokens
        for n in range(min(MAX_N, len(ctx)), MIN_N - 1, -1):
            j = self.after.get(tuple(ctx[-n:]))
            if j is not None:
                return ctx[j:j + self.max_len]
        return []

    def observe(self, depths: list[int], accepted: list[bool]) -> None:
        """Nodes only the chain proposed, verified with their parent accepted: their depths and whether
        each was accepted. (Where the head drafted the same token, the head's calibration counts it.)"""
        for d, ok in zip(depths, accepted):
            self.accept[d] += EMA * (float(ok) - self.accept[d])


def attach_chain(cands: HostCandidates, chain: list[int], rates: list[float]):
    """The candidates (host lists, as the round has read them) with `chain` attached below the root. A chain
    token the head also drafted under the same parent is that node (siblings must carry distinct tokens): it
    keeps the head's score. A token only the chain proposes becomes a new node scored as its parent's score
    + log(rate at its depth), i.e. P(parent accepted) x P(this token | parent accepted). Returns (the new
    candidates, the chain's candidate indices, whether each of those is the chain's alone).

    Scores stay non-increasing from parent to child, and new nodes come after their parents, so a
    stable sort by score still keeps any prefix connected."""
    tokens, parents, depths, scores = list(cands.tokens), list(cands.parents), list(cands.depths), list(cands.scores)
    where = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    nodes, alone, parent, score = [], [], -1, 0.0
    for d, tok in enumerate(chain, 1):
        i = where.get((parent, tok))
        if i is None:
            i = len(tokens)
            score += math.log(max(rates[d], 1e-3))
            tokens.append(tok); parents.append(parent); depths.append(d); scores.append(score)
        else:
            score = scores[i]
        nodes.append(i)
        alone.append(i >= len(cands))
        parent = i
    return HostCandidates(tokens, parents, depths, scores), nodes, alone
