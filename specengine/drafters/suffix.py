"""Suffix decoding (Oliaro et al., SuffixDecoding): drafts from suffix trees over the request's own
tokens and over earlier requests' outputs.

Two kinds of tree, one class (SuffixTree):
  - one per row, over its prompt and the tokens it has generated (and, with an encoder-decoder
    target, its encoder input): extended each round by the tokens the row gained;
  - one global tree over the outputs of requests that have finished (each with the end of its
    prompt before it, so that an answer's first tokens have a context), bounded by a budget in
    tokens: the oldest outputs leave first.

Each round, for each row: the longest suffix of its sequence that occurred before is found in
each tree (of at most max_depth - budget tokens, so that a draft of the row's budget fits below
the match in the tree; at least max_depth // 2), and from there the most frequent continuation
is followed: at each step the child seen most often, its probability count(child) / count(node)
multiplied into the path's. The draft stops when that probability falls below min_prob, at the
row's budget, or at max_spec_factor * (the match's length) tokens: a long match earns a long
draft, a one-token match a single token. Of the two trees' drafts, the one from the longer match
is proposed (it saw more of the context: one earlier occurrence of the row's last token says
less than what earlier requests' outputs did after its last five), between equal matches the one
of higher score (the sum of its tokens' path probabilities: the tokens it expects accepted). A
row whose context matches nothing drafts nothing; when no row drafts, the round is a target-only
round.

q is one-hot on the proposed token (logits=None), so verification stays lossless, as with the
n-gram drafter: greedy output is the target's, sampled output follows the target's distribution.
Which tokens a seeded sampled request gets depends on the drafts, and these depend on the
requests that finished before it.

The trees are path-compressed and depth-limited (the structure of Arctic Inference's
implementation of SuffixDecoding): every suffix of at most max_depth tokens of each document is
in the tree, a node holds a run of tokens by reference (a document and a range) and counts the
suffixes that pass through or end at it. Appending a token updates one node per suffix still
growing (at most max_depth); a draft is one walk from the matched node. Pure Python: bench/
bench_suffix.py measures a round's lookups.

The drafter learns a request's output from the sequences it sees: propose() is handed every row's
sequence each round, and when keep_rows() drops a row its last sequence goes into the global tree
(the tokens of the row's last round, which it never saw, are missing; so are the outputs of rows
that never drafted, with gamma="auto" at 0).
"""
from __future__ import annotations

import torch

from ..sampling.batch import SamplingBatch
from .base import Drafter, Proposal


class _Node:
    __slots__ = ("count", "children", "parent", "doc", "start", "length")

    def __init__(self, count: int, parent: "_Node | None", doc: int, start: int, length: int):
        self.count = count        # suffixes (of at most max_depth tokens) that pass through or end here
        self.children: dict[int, _Node] | None = None  # by first token
        self.parent = parent
        self.doc = doc            # its tokens are docs[doc][start:start + length] (their latest occurrence)
        self.start = start
        self.length = length


class SuffixTree:
    """Every suffix of at most max_depth tokens of a set of documents, with counts; documents are
    extended token by token (extend) and removed whole (remove: oldest first, see there)."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"max_depth must be at least 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(0, None, -1, 0, 0)
        self.docs: dict[int, list[int]] = {}
        self._active: dict[int, list[_Node]] = {}  # per growing document: the node each of its
        # last max_depth suffixes ends at, oldest suffix (deepest node) first

    def __len__(self) -> int:
        """Tokens held."""
        return self.root.count

    def extend(self, doc: int, tokens) -> None:
        """Append tokens to a document (a new one if `doc` is new)."""
        seq = self.docs.setdefault(doc, [])
        active = self._active.setdefault(doc, [])
        root, docs, max_depth = self.root, self.docs, self.max_depth
        for token in tokens:
            active.append(root)
            root.count += 1
            if len(active) > max_depth:
                del active[0]  # that suffix is max_depth long: it stops growing
            seq.append(token)
            n = len(seq)
            for i, node in enumerate(active):
                children = node.children
                child = children.get(token) if children else None
                if child is None:
                    if node.count == 1 and node is not root:
                        # Only this suffix reaches the node: a leaf, which grows with it.
                        node.length += 1
                    else:
                        new = _Node(1, node, doc, n - 1, 1)
                        if children is None:
                            node.children = {token: new}
                        else:
                            children[token] = new
                        active[i] = new
                elif node.count == child.count + 1 and node is not root:
                    # This suffix ends at the node and every other one that reaches it goes on
                    # into the child: the node takes the child's first token.
                    if child.length == 1:  # the child is that token alone: it replaces the node
                        parent = node.parent
                        child.count += 1
                        child.length = node.length + 1
                        child.doc, child.start = doc, n - child.length
                        child.parent = parent
                        parent.children[seq[child.start]] = child
                        active[i] = child
                    else:
                        node.length += 1
                        node.doc, node.start = doc, n - node.length
                        child.start += 1
                        child.length -= 1
                        first = docs[child.doc][child.start]
                        if first != token:
                            del children[token]
                            children[first] = child
                elif child.length == 1:
                    child.count += 1
                    child.doc, child.start = doc, n - 1
                    active[i] = child
                else:  # the suffix goes one token into the child: split it there
                    new = _Node(child.count + 1, node, doc, n - 1, 1)
                    child.start += 1
                    child.length -= 1
                    child.parent = new
                    new.children = {docs[child.doc][child.start]: child}
                    children[token] = new
                    active[i] = new

    def close(self, doc: int) -> None:
        """The document gains no more tokens (forget what extending it needed)."""
        self._active.pop(doc, None)

    def remove(self, doc: int) -> None:
        """Remove a document. Documents must leave in the order they were added (the global
        tree's oldest first): a node refers to its latest occurrence, which then is never in a
        document removed while the node stays."""
        seq = self.docs[doc]
        root, docs = self.root, self.docs
        for start in range(len(seq)):
            root.count -= 1
            node, idx = root, start
            while idx < len(seq):
                children = node.children
                child = children.get(seq[idx]) if children else None
                if child is None:
                    break
                child.count -= 1
                if child.count == 0:
                    del children[seq[idx]]
                    break
                idx += child.length
                node = child
            # No suffix may end at the node now: then it and its only child are one run.
            children = node.children
            if node is not root and children and len(children) == 1:
                (only,) = children.values()
                if only.count == node.count:
                    parent = node.parent
                    only.start -= node.length
                    only.length += node.length
                    only.parent = parent
                    parent.children[docs[only.doc][only.start]] = only
        del self.docs[doc]
        self._active.pop(doc, None)

    # ---- lookups

    def suffix_nodes(self, doc: int, max_length: int) -> list[tuple[_Node, int]]:
        """(node, length) of the document's suffixes of at most max_length tokens that occur
        elsewhere too, longest first."""
        active = self._active.get(doc, [])
        n = len(active)
        return [(node, n - i) for i, node in enumerate(active) if node.count > 1 and n - i <= max_length]

    def _find(self, context: list[int], length: int) -> tuple[_Node, int] | None:
        """Where the last `length` tokens of context end in the tree: (node, tokens of it matched)."""
        node, idx, docs = self.root, 0, self.docs
        for i in range(len(context) - length, len(context)):
            token = context[i]
            if idx == node.length:
                children = node.children
                node = children.get(token) if children else None
                if node is None:
                    return None
                idx = 0
            if docs[node.doc][node.start + idx] != token:
                return None
            idx += 1
        return node, idx

    def longest_match(self, context: list[int], max_length: int) -> tuple[_Node, int, int] | None:
        """(node, tokens of it matched, match length) of the longest suffix of context, of at most
        max_length tokens, found in the tree (None: not even its last token). A suffix found has
        all its shorter suffixes found too, so a binary search finds it."""
        lo, hi, best = 0, min(max_length, len(context)), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self._find(context, mid)
            if found is None:
                hi = mid - 1
            else:
                lo, best = mid, found
        return None if best is None else (best[0], best[1], lo)

    def walk(self, node: _Node, idx: int, limit: int, min_prob: float, ends_here: int = 0) -> tuple[list[int], float]:
        """The most frequent continuation below a match (node, idx): up to `limit` tokens while
        the path's probability stays at least min_prob; (tokens, score: the sum of their path
        probabilities). ends_here: occurrences of the match that have no continuation by
        construction (a row's own latest suffix)."""
        out: list[int] = []
        prob, score, docs = 1.0, 0.0, self.docs
        while len(out) < limit:
            if idx < node.length:  # within a run: one way on
                take = min(limit - len(out), node.length - idx)
                seq = docs[node.doc]
                out += seq[node.start + idx:node.start + idx + take]
                score += prob * take
                idx += take
                continue
            children = node.children
            if not children:
                # A leaf at max_depth (or at a document's end): the text after its latest occurrence.
                seq = docs.get(node.doc)
                if seq is not None:
                    end = node.start + node.length
                    take = seq[end:end + limit - len(out)]
                    out += take
                    score += prob * len(take)
                break
            best, count = None, 0
            for child in children.values():
                if child.count > count:
                    best, count = child, child.count
            prob *= count / max(1, node.count - ends_here)
            ends_here = 0
            if prob < min_prob:
                break
            node, idx = best, 0
        return out, score


class _Row:
    __slots__ = ("tree", "prompt", "source", "sequence", "indexed")

    def __init__(self, prompt: list[int], source: list[int] | None, max_depth: int):
        self.tree = SuffixTree(max_depth)
        self.prompt = prompt
        self.source = source     # an encoder-decoder's encoder input, indexed with the sequence
        self.sequence = prompt   # the latest sequence propose() saw
        self.indexed = 0         # tokens of the sequence in the tree


SEQUENCE, SOURCE = 0, 1  # a row tree's documents


class SuffixDrafter(Drafter):
    """max_depth: the longest suffix the trees hold (a match and the draft below it in the tree);
    max_spec_factor: a match of n tokens drafts at most max_spec_factor * n; min_prob: a draft
    stops where its path probability falls below this; max_global_tokens: the global tree's budget
    (0: no global tree), the oldest outputs dropped first (about 200 bytes a token, measured by
    bench/bench_suffix.py: the default 262,144 tokens take ~50 MB); context_tokens: tokens of each
    finished request's prompt kept before its output (default max_depth - 1)."""

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 1.0, min_prob: float = 0.1,
                 max_global_tokens: int = 1 << 18, context_tokens: int | None = None):
        if max_spec_factor <= 0:
            raise ValueError(f"max_spec_factor must be positive, got {max_spec_factor}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        if max_global_tokens < 0:
            raise ValueError(f"max_global_tokens must be >= 0, got {max_global_tokens}")
        self.global_tree = SuffixTree(max_depth)  # checks max_depth
        self.max_depth, self.max_spec_factor, self.min_prob = max_depth, max_spec_factor, min_prob
        self.max_global_tokens = max_global_tokens
        self.context_tokens = max_depth - 1 if context_tokens is None else context_tokens
        self.rows: list[_Row] = []
        self._outputs: list[tuple[int, int]] = []  # (document, tokens) in the global tree, oldest first
        self._next_doc = 0

    # ---- the Drafter protocol

    def join_rows(self, prompts: list[list[int]], capacity: int, sources: list[list[int]] | None = None):
        # Indexed when first drafted for: a row that never drafts (gamma="auto") costs nothing.
        for i, prompt in enumerate(prompts):
            self.rows.append(_Row(list(prompt), list(sources[i]) if sources is not None else None, self.max_depth))

    def propose(self, sequences: list[list[int]], budgets: list[int], sampling: SamplingBatch) -> Proposal:
        if len(sequences) != len(self.rows):
            raise RuntimeError(f"{len(sequences)} sequences for the suffix drafter's {len(self.rows)} rows")
        drafts = []
        for row, seq, budget in zip(self.rows, sequences, budgets):
            row.sequence = seq
            drafts.append(self._draft(row, seq, budget) if budget > 0 else [])
        G = max(len(d) for d in drafts)
        tokens = torch.zeros(len(drafts), G, dtype=torch.int64)
        for b, d in enumerate(drafts):
            if d:
                tokens[b, :len(d)] = torch.as_tensor(d, dtype=torch.int64)
        num = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
        device = sampling.seeds.device
        return Proposal(tokens.to(device), num.to(device), None, draft_calls=0)

    def keep_rows(self, rows):
        kept = set(rows)
        for i, row in enumerate(self.rows):
            if i not in kept:
                self._learn(row)
        self.rows = [self.rows[i] for i in rows]

    # ---- drafting

    def _index(self, row: _Row, seq: list[int]):
        """Bring the row's tree up to its sequence (the tokens gained since the last round)."""
        if row.indexed > len(seq) or (row.indexed and row.tree.docs[SEQUENCE][row.indexed - 1] != seq[row.indexed - 1]):
            # Not the sequence it grew from (never in the engine's use): start over.
            row.tree, row.indexed = SuffixTree(self.max_depth), 0
        if row.indexed == 0 and row.source:
            row.tree.extend(SOURCE, row.source)
            row.tree.close(SOURCE)
        row.tree.extend(SEQUENCE, seq[row.indexed:])
        row.indexed = len(seq)

    def _draft(self, row: _Row, seq: list[int], budget: int) -> list[int]:
        self._index(row, seq)
        best = (0, 0.0, [])  # (match length, score, draft)
        max_length = max(self.max_depth // 2, self.max_depth - budget)
        # The row's own tree: its suffixes that occurred before, the longest first (the next when
        # the longest has no continuation, as when its other occurrence ends the encoder input).
        for node, length in row.tree.suffix_nodes(SEQUENCE, max_length)[:2]:
            draft, score = row.tree.walk(node, node.length, self._limit(length, budget), self.min_prob, ends_here=1)
            if draft:
                best = (length, score, draft)
                break
        if len(self.global_tree):
            match = self.global_tree.longest_match(seq, max_length)
            if match is not None and match[2] >= best[0]:
                node, idx, length = match
                draft, score = self.global_tree.walk(node, idx, self._limit(length, budget), self.min_prob)
                # The longer match wins (it saw more of the context), the higher score between equals.
                if draft and (length, score) > best[:2]:
                    best = (length, score, draft)
        return best[2]

    def _limit(self, match_length: int, budget: int) -> int:
        return min(budget, int(match_length * self.max_spec_factor + 1e-6))

    # ---- the global tree

    def _learn(self, row: _Row):
        """A row left: its output (after the end of its prompt) into the global tree."""
        seq, prompt_length = row.sequence, len(row.prompt)
        if len(seq) <= prompt_length or self.max_global_tokens == 0:
            return
        tokens = seq[max(0, prompt_length - self.context_tokens):][-self.max_global_tokens:]
        self.learn(tokens)

    def learn(self, tokens: list[int]):
        """Add an output to the global tree, dropping the oldest ones beyond the budget."""
        tokens = list(tokens)[-self.max_global_tokens:] if self.max_global_tokens else []
        if not tokens:
            return
        while self._outputs and len(self.global_tree) + len(tokens) > self.max_global_tokens:
            doc, _ = self._outputs.pop(0)
            self.global_tree.remove(doc)
        doc, self._next_doc = self._next_doc, self._next_doc + 1
        self.global_tree.extend(doc, tokens)
        self.global_tree.close(doc)
        self._outputs.append((doc, len(tokens)))

    @property
    def global_tokens(self) -> int:
        """Tokens in the global tree now."""
        return len(self.global_tree)
