"""Drafting: grow a tree of candidate tokens with the draft head (the proposer).

Node 0 is the root: the last token already chosen, which the target has not yet processed. Every
other node is a candidate continuation; parents always precede their children.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .head import EagleHead

# EAGLE-1's static tree (mc_sim_7b_63): each node is the path of top-k ranks from the root.
EAGLE1_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
               [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
               [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]


@dataclass(frozen=True)
class TreeConfig:
    kind: str = "dynamic"      # dynamic (EAGLE-2) | static (EAGLE-1) | chain
    top_k: int = 4
    depth: int = 5
    total_tokens: int = 16     # draft nodes kept, root excluded (dynamic)

    def __post_init__(self):
        if self.kind not in ("dynamic", "static", "chain"):
            raise ValueError(f"tree kind must be dynamic, static or chain, got '{self.kind}'")
        for name in ("top_k", "depth", "total_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"tree {name} must be >= 1, got {getattr(self, name)}")

    def static_paths(self) -> list[list[int]]:
        if self.kind == "chain":
            return [[0] * d for d in range(1, self.depth + 1)]
        return EAGLE1_TREE

    @property
    def max_nodes(self) -> int:
        if self.kind == "dynamic":
            return self.total_tokens + 1
        return len(self.static_paths()) + 1


@dataclass
class Tree:
    tokens: torch.Tensor    # (N,) long, node 0 = root
    parents: torch.Tensor   # (N,) long, parent index, -1 for the root
    depths: torch.Tensor    # (N,) long, root = 0

    def __len__(self) -> int:
        return self.tokens.numel()

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: node i may attend to node j iff j is i or an ancestor of i."""
        return ancestor_mask(self.parents)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    for i, p in enumerate(parents.tolist()):  # parents precede children, so row p is complete
        if p >= 0:
            mask[i] |= mask[p]
    return mask


class Drafter:
    """Runs the head over a tree. Tree nodes occupy head-cache slots after `head_len` and are
    forgotten when the next round writes its accepted tokens there."""

    def __init__(self, head: EagleHead, embed: torch.nn.Embedding, logprobs, config: TreeConfig,
                 draft_ids: torch.Tensor | None = None):
        """head: the head or its compiled call; logprobs: predicted features -> draft log-probabilities,
        over `draft_ids` (target token ids) when the head drafts from a reduced vocabulary."""
        self.head, self.embed, self.logprobs, self.config = head, embed, logprobs, config
        self.draft_ids = draft_ids

    def _topk(self, features: torch.Tensor, k: int):
        """(log-probs, target token ids) of the k most likely draft tokens for each row."""
        values, idx = self.logprobs(features).topk(k)
        return values, (idx if self.draft_ids is None else self.draft_ids[idx])

    def _expand(self, head_len: int, fed_parents: list[int], tokens: list[int], features: torch.Tensor,
                depths: list[int]) -> torch.Tensor:
        """Feed new nodes (their token and their parent's predicted feature) into the head.

        `fed_parents[i]` is the index among previously fed nodes of node i's parent in the head
        cache, or -1 if its parent is the root. Returns the new nodes' predicted features.
        """
        n_old = self._n_fed
        n_new = len(tokens)
        dev = features.device
        parents = torch.tensor(self._fed_parent + fed_parents, dtype=torch.long)
        anc = ancestor_mask(parents)[n_old:]  # (n_new, n_old + n_new)
        mask = torch.cat([torch.ones(n_new, head_len, dtype=torch.bool), anc], dim=1).to(dev)
        pos = torch.tensor([head_len - 1 + d for d in depths], device=dev)[None]
        tok = torch.tensor(tokens, device=dev)[None]
        out = self.head(self.embed(tok), features[None], pos, mask=mask, cache_start=head_len + n_old)
        self._fed_parent += fed_parents
        self._n_fed += n_new
        return out[0]

    def draft(self, root_token: int, root_feature: torch.Tensor, head_len: int) -> Tree:
        """root_feature: the head's prediction of the root's feature (from the last accepted pair)."""
        self._fed_parent: list[int] = []
        self._n_fed = 0
        if self.config.kind == "dynamic":
            return self._dynamic(root_token, root_feature, head_len)
        return self._static(root_token, root_feature, head_len)

    def _dynamic(self, root_token, root_feature, head_len) -> Tree:
        """EAGLE-2: expand the top_k frontier by cumulative log-prob; keep the best total_tokens nodes."""
        cfg = self.config
        k = cfg.top_k
        values, ids = self._topk(root_feature[None], k)
        # every generated node: token, parent (node index, 0 = root), score, depth
        tokens, parents, scores, depths = [root_token], [-1], [0.0], [0]
        tokens += ids[0].tolist(); parents += [0] * k; scores += values[0].tolist(); depths += [1] * k
        frontier = list(range(1, k + 1))
        fed_index = {}  # node index -> index among fed nodes
        frontier_feature = root_feature[None].expand(k, -1)
        for d in range(2, cfg.depth + 1):
            fed_parents = [fed_index.get(parents[n], -1) for n in frontier]
            for j, n in enumerate(frontier):
                fed_index[n] = self._n_fed + j
            out = self._expand(head_len, fed_parents, [tokens[n] for n in frontier], frontier_feature,
                               [d - 1] * len(frontier))
            values, ids = self._topk(out, k)  # (|frontier|, k)
            cum = values + torch.tensor([scores[n] for n in frontier], device=out.device)[:, None]
            best = cum.flatten().topk(k).indices.tolist()
            first_new = len(tokens)
            flat_tok, flat_score = ids.flatten().tolist(), cum.flatten().tolist()
            for j in range(len(frontier) * k):
                tokens.append(flat_tok[j]); parents.append(frontier[j // k]); scores.append(flat_score[j]); depths.append(d)
            frontier = [first_new + j for j in best]
            frontier_feature = out[[j // k for j in best]]
        # Keep the best nodes; a child never outscores its parent and ties go to the shallower node,
        # so the kept set is a tree. Sorting by (depth, score) puts parents before children.
        n_keep = min(cfg.total_tokens, len(tokens) - 1)
        order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:n_keep]
        keep = [0] + sorted(order, key=lambda i: (depths[i], -scores[i], i))
        new_index = {old: new for new, old in enumerate(keep)}
        return Tree(tokens=torch.tensor([tokens[i] for i in keep]),
                    parents=torch.tensor([new_index[parents[i]] if i else -1 for i in keep]),
                    depths=torch.tensor([depths[i] for i in keep]))

    def _static(self, root_token, root_feature, head_len) -> Tree:
        """EAGLE-1 tree / chain: node [r0..rd] is the rank-rd child of node [r0..rd-1]."""
        paths = sorted(self.config.static_paths(), key=lambda p: (len(p), p))
        index = {(): 0}
        tokens, parents, depths = [root_token], [-1], [0]
        feature = {(): root_feature}
        fed_index: dict[tuple, int] = {}
        max_depth = max(len(p) for p in paths)
        for d in range(1, max_depth + 1):
            level = [tuple(p) for p in paths if len(p) == d]
            need = sorted({p[:-1] for p in level})
            if d > 1:  # feed the parents (depth d-1 nodes) to get their children's distribution
                fed_parents = [fed_index.get(p[:-1], -1) for p in need]
                for j, p in enumerate(need):
                    fed_index[p] = self._n_fed + j
                out = self._expand(head_len, fed_parents, [tokens[index[p]] for p in need],
                                   torch.stack([feature[p[:-1]] for p in need]), [d - 1] * len(need))
                for j, p in enumerate(need):
                    feature[p] = out[j]
            feats = torch.stack([feature[p] for p in need])
            ranks = self._topk(feats, max(p[-1] for p in level) + 1)[1]
            row = {p: j for j, p in enumerate(need)}
            for p in level:
                index[p] = len(tokens)
                tokens.append(int(ranks[row[p[:-1]], p[-1]])); parents.append(index[p[:-1]]); depths.append(d)
        return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))
