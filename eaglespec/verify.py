"""Verification: which drafted nodes the target accepts, and the token it adds after them.

Greedy keeps the longest path that matches the target's argmax. Sampling walks down the tree with
recursive rejection sampling over each node's (deterministic) children: child x is accepted with
probability p(x); on rejection p(x) is zeroed and p renormalised; if all are rejected the next token
is drawn from what is left of p. For any fixed set of candidates this draws exactly from p, so the
output distribution is the target's.
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams, sample, target_probs
from .tree import Tree


def greedy_accept(tree: Tree, argmax: torch.Tensor) -> tuple[list[int], int, list[int]]:
    """Greedy verification: (accepted node indices, root first; bonus token; the new tokens, i.e. the
    accepted nodes' tokens after the root, then the bonus).

    A node is accepted when its token equals the target's argmax at its parent, and so are all its
    ancestors'. Siblings carry distinct tokens, so the accepted nodes form one path; its deepest node
    gives the bonus token. One host read per round (the argmax); the walk is on the tree's host lists,
    parents before children, since a few dozen list steps cost less than tensor operations here."""
    tokens, parents, depths = tree.host_lists()
    best = argmax[:len(tokens)].tolist()
    ok, deepest = [True] * len(tokens), 0
    for i in range(1, len(tokens)):
        par = parents[i]
        ok[i] = ok[par] and tokens[i] == best[par]
        if ok[i] and depths[i] > depths[deepest]:
            deepest = i
    path, node = [], deepest
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    bonus = best[deepest]
    return path, bonus, [tokens[i] for i in path[1:]] + [bonus]


def verify(tree: Tree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """logits: (N, V), the target's output at every tree node. Returns the accepted node indices
    (root first) and the next token after the last of them (the bonus token)."""
    kids = tree.children()
    tokens = tree.host_lists()[0]
    path, node = [0], 0
    if params.greedy:
        best = logits.argmax(-1).tolist()
        while True:
            nxt = next((c for c in kids[node] if tokens[c] == best[node]), None)
            if nxt is None:
                return path, best[node]
            path.append(nxt)
            node = nxt
    while True:
        p = target_probs(logits[node], params)
        for c in kids[node]:
            t = tokens[c]
            if float(torch.rand((), generator=generator, device=p.device)) < float(p[t]):
                path.append(c)
                node = c
                break
            p[t] = 0.0
            total = p.sum()
            if total <= 0:  # everything left was rejected: only reachable by rounding
                return path, sample(target_probs(logits[node], params), generator)
            p = p / total
        else:
            return path, sample(p, generator)
