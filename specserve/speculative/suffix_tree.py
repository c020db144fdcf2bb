"""Depth-bounded suffix trees with occurrence counts: the index behind suffix decoding.

A ``SuffixTree`` holds token sequences and indexes every substring of at most ``max_depth``
tokens with the number of times it occurs (over all sequences held). From a context (the
last tokens of a request) it finds the places that context occurred before and, at each
step of the continuation, how often each next token followed: the frequencies that give a
suffix draft its confidence.

Layout (a compressed trie of the substrings):

* a node stands for a run of tokens that all have the same count: the strings from its
  parent's depth + 1 up to its own ``depth``. Its tokens are not copied: ``(seq, start)``
  names one occurrence of the node's whole string, ``seqs[seq][start:start + depth]``;
* children are keyed by their first token. A node ends where the strings branch or where
  some occurrence ends (the end of a sequence, or ``max_depth``); chains of one child with
  the same count are merged, so a tree holds at most about two nodes per token stored;
* ``append`` extends a sequence by one token in O(max_depth): it keeps, per sequence being
  built, the node where each of its last ``max_depth`` suffixes ends and steps each of them
  by the new token; a new unique suffix usually just grows its leaf in place;
* ``remove`` takes a whole sequence out (counts go down, empty nodes go, merged chains
  are re-merged). Sequences are kept in least-recently-used order (``insert`` and
  ``touch`` make one the newest) and every node names its newest occurrence, so the
  sequence ``evict`` removes (the oldest) is named by no node that survives it: no node
  ever points at tokens that are gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class _Node:
    __slots__ = ("count", "depth", "length", "seq", "start", "parent", "children")

    def __init__(self, count: int, depth: int, length: int, seq, start: int, parent: "_Node | None"):
        self.count, self.depth, self.length = count, depth, length
        self.seq, self.start = seq, start  # an occurrence of the whole string: seqs[seq][start:start + depth]
        self.parent = parent
        self.children: dict[int, _Node] | None = None


class SuffixTree:
    """Counts of every substring (up to ``max_depth`` tokens) of the sequences held."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(0, 0, 0, None, 0, None)
        self.seqs: OrderedDict[Hashable, list[int]] = OrderedDict()  # oldest first
        self.active: dict[Hashable, list[_Node]] = {}  # sequences being appended: their suffixes' nodes
        self.num_nodes = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.seqs

    # ---- building ----------------------------------------------------------------------------
    def start(self, key: Hashable) -> None:
        """Begin an (empty) sequence that ``append`` extends; it is the newest."""
        if key in self.seqs:
            raise KeyError(f"sequence {key!r} is already in the tree")
        self.seqs[key] = []
        self.active[key] = []

    def append(self, key: Hashable, token: int) -> None:
        """Add one token to a sequence begun with ``start``: O(max_depth)."""
        toks = self.seqs[key]
        n = len(toks)
        toks.append(token)
        self.num_tokens += 1
        D, step, seqs = self.max_depth, self._step, self.seqs
        nodes = []
        for node in self.active[key]:  # longest suffixes first; one already max_depth long stops growing
            d = node.depth
            if d >= D:
                continue
            ch = node.children  # the two common cases of _step, inlined (a new passage, a repeated one)
            if ch is None:
                if node.count == 1:
                    node.depth, node.length = d + 1, node.length + 1
                    nodes.append(node)
                    continue
            elif len(ch) == 1:
                (c,) = ch.values()
                if c.count + 1 == node.count and c.length > 1 and seqs[c.seq][c.start + d] == token:
                    node.depth, node.length, node.seq, node.start = d + 1, node.length + 1, key, n - d
                    c.length -= 1
                    node.children = {seqs[c.seq][c.start + d + 1]: c}
                    nodes.append(node)
                    continue
            nodes.append(step(node, key, n - d, token))
        nodes.append(step(self.root, key, n, token))
        self.active[key] = nodes

    def extend(self, key: Hashable, tokens) -> None:
        for t in tokens:
            self.append(key, t)

    def finish(self, key: Hashable) -> None:
        """No more tokens for this sequence (drops its suffix nodes; it stays indexed)."""
        self.active.pop(key, None)

    def insert(self, key: Hashable, tokens) -> None:
        """Index a whole sequence at once (the newest)."""
        self.start(key)
        self.extend(key, tokens)
        self.finish(key)

    def suffix_nodes(self, key: Hashable) -> list[_Node]:
        """For a sequence being appended: the node where each suffix of its last max_depth
        tokens ends, longest first (its depth is the suffix's length)."""
        return self.active[key]

    def _step(self, node: _Node, key, start: int, token: int) -> _Node:
        """The occurrence at ``start`` whose string ends at ``node`` grows by ``token``: return
        the node where the longer string ends (it counts this occurrence). ``append`` handles
        the two commonest cases itself: a node whose only occurrence is this one grows in place
        (a new passage), and a node whose other occurrences all go on into its one child the
        same way moves its end down (a passage seen before, being repeated)."""
        child = node.children.get(token) if node.children is not None else None
        if child is None:
            child = _Node(1, node.depth + 1, 1, key, start, node)
            if node.children is None:
                node.children = {}
            node.children[token] = child
            self.num_nodes += 1
        else:
            if child.length > 1:
                child = self._split(child, 1)
            child.count += 1
            child.seq, child.start = key, start  # the newest occurrence
        self._merge_into_child(node)
        return child

    def _key(self, node: _Node) -> int:
        return self.seqs[node.seq][node.start + node.depth - node.length]

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s run after ``at`` tokens; returns the new upper node (the lower part
        keeps its identity, so suffix nodes that end there stay valid)."""
        parent = node.parent
        top = _Node(node.count, node.depth - node.length + at, at, node.seq, node.start, parent)
        parent.children[self._key(node)] = top
        node.length -= at
        node.parent = top
        top.children = {self._key(node): node}
        self.num_nodes += 1
        return top

    def _merge_into_child(self, node: _Node) -> None:
        """A node with one child that every occurrence continues into is the same run as the
        child: the child takes its place."""
        if node is self.root or node.children is None or len(node.children) != 1:
            return
        (child,) = node.children.values()
        if child.count != node.count:
            return
        parent = node.parent
        child.length += node.length
        child.parent = parent
        parent.children[self._key(child)] = child
        self.num_nodes -= 1

    # ---- least-recently-used order and removal ---------------------------------------------
    def _path(self, toks: list[int], i: int) -> list[_Node]:
        """The nodes of the suffix starting at toks[i] (up to max_depth tokens), top down."""
        end = min(len(toks), i + self.max_depth)
        node, path = self.root, []
        while node.depth < end - i:
            node = node.children[toks[i + node.depth]]
            path.append(node)
        return path

    def touch(self, key: Hashable) -> None:
        """Make a sequence the newest (it was useful): it is evicted last, and every node it
        occurs in names it."""
        if key not in self.seqs or key in self.active:
            return
        self.seqs.move_to_end(key)
        toks = self.seqs[key]
        for i in range(len(toks)):
            for node in self._path(toks, i):
                node.seq, node.start = key, i

    def evict(self, max_sequences: int) -> list[Hashable]:
        """Remove the oldest finished sequences until at most ``max_sequences`` are held."""
        gone = []
        while len(self.seqs) > max_sequences:
            key = next(iter(self.seqs))
            if key in self.active:  # still being built: never evicted
                break
            self._remove(key)
            gone.append(key)
        return gone

    def _remove(self, key: Hashable) -> None:
        toks = self.seqs[key]
        for i in range(len(toks)):
            path = self._path(toks, i)
            for depth_index, node in enumerate(path):
                node.count -= 1
                if node.count == 0:  # this occurrence was the last: the node and all below it go
                    del node.parent.children[self._key(node)]
                    if not node.parent.children:
                        node.parent.children = None
                    self.num_nodes -= self._size(node)
                    path = path[:depth_index]
                    break
            for node in reversed(path):
                self._merge_into_child(node)
        del self.seqs[key]
        self.num_tokens -= len(toks)

    @staticmethod
    def _size(node: _Node) -> int:
        n, stack = 0, [node]
        while stack:
            x = stack.pop()
            n += 1
            if x.children:
                stack.extend(x.children.values())
        return n

    # ---- lookup ------------------------------------------------------------------------------
    def locate(self, tokens: list[int]) -> tuple[_Node, int] | None:
        """Where ``tokens`` (at most max_depth) ends in the tree: (node whose run holds its last
        token, its length), or None when it never occurred."""
        node, d, n = self.root, 0, len(tokens)
        while d < n:
            child = node.children.get(tokens[d]) if node.children is not None else None
            if child is None:
                return None
            stop = min(child.depth, n)
            s = self.seqs[child.seq]
            if s[child.start + d + 1:child.start + stop] != tokens[d + 1:stop]:
                return None
            node, d = child, stop
        return node, d

    def continuation(self, node: _Node, d: int, budget: int, min_prob: float) -> tuple[list[int], float, bool]:
        """The likeliest continuation of the string of length ``d`` ending in ``node``.

        At each branch the most frequent next token is taken; a token's probability is the
        product of the frequency ratios (count of the child / count of all children) on the
        way to it. Stops after ``budget`` tokens, at the end of the indexed depth, or before a
        token whose probability is under ``min_prob``. Returns (tokens, score = the sum of the
        tokens' probabilities, i.e. the expected number accepted, cut = stopped by min_prob).
        """
        out: list[int] = []
        p, score = 1.0, 0.0
        while len(out) < budget:
            if d < node.depth:  # inside a run: every occurrence continues the same way
                take = min(node.depth - d, budget - len(out))
                s = self.seqs[node.seq]
                out += s[node.start + d:node.start + d + take]
                score += p * take
                d += take
                continue
            if node.children is None:
                break
            total, best = 0, None
            for c in node.children.values():
                total += c.count
                if best is None or c.count > best.count:
                    best = c
            if p * best.count / total < min_prob:
                return out, score, True
            p = p * best.count / total
            node = best
        return out, score, False

    # ---- checks (tests) ----------------------------------------------------------------------
    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """Every indexed substring with its count (for tests: compare with a brute-force count)."""
        out: dict[tuple[int, ...], int] = {}
        stack = list(self.root.children.values()) if self.root.children else []
        while stack:
            node = stack.pop()
            s = self.seqs[node.seq][node.start:node.start + node.depth]
            for L in range(node.depth - node.length + 1, node.depth + 1):
                out[tuple(s[:L])] = node.count
            if node.children:
                stack.extend(node.children.values())
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the structure is inconsistent (for tests)."""
        stack = [self.root]
        nodes = 0
        while stack:
            node = stack.pop()
            if node is not self.root:
                nodes += 1
                assert node.count > 0 and node.length > 0 and node.depth <= self.max_depth
                assert node.depth == node.parent.depth + node.length
                assert node.seq in self.seqs, "a node names a sequence that is gone"
                assert node.start + node.depth <= len(self.seqs[node.seq])
                up = node.parent
                if up is not self.root:  # the parent's string is a prefix of the node's
                    mine = self.seqs[node.seq][node.start:node.start + up.depth]
                    assert mine == self.seqs[up.seq][up.start:up.start + up.depth]
            if node.children:
                if node is not self.root:
                    assert sum(c.count for c in node.children.values()) <= node.count
                for tok, c in node.children.items():
                    assert c.parent is node and self._key(c) == tok
                stack.extend(node.children.values())
        assert nodes == self.num_nodes, (nodes, self.num_nodes)
