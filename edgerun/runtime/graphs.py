"""Which batch shapes of a context have a captured CUDA graph, as the n-gram governor needs to know
to price a verify batch.

ggml-cuda runs a decode through a captured CUDA graph only from a shape's third run on: the first
runs the kernels one by one, the second captures them, later ones replay the capture (one launch).
On an H100 with the 1.5B, verify batches that replayed a capture cost 2.6-5.0 ms for 1 token
after a decode in flight (a plain step: 2.1 ms), those that did not 8-13.6 ms for 2-5 tokens and
9-26 ms for 7-48: a chance match's round that drafts many and has none accepted then loses five
to ten plain steps' time, where the load-time table (timed on captured shapes) priced it at two.

With edgerun's patched graph key (scripts/llama_patches.py) a shape is the batch's tokens, its
output rows, the KV length it attends over (llama.cpp pads the cells in use to KV_PAD) and whether
a pick runs in the graph; a context keeps up to EDGERUN_CUDA_GRAPHS_KEPT such graphs, evicting the
least recently used, and attaching or detaching the pick re-plans llama.cpp's scheduler, after
which no shape replays until it has run twice again. This mirror counts the decodes its context
reports (its own evals, and each native round's at commit; not the server's batches of several
sequences, which only make a later price wrong) under the same keys and evicts the same way. It is an estimate: the governor learns how much a shape it calls cold really costs
(governor.cold_factor), so a mirror that is wrong about a shape costs a price, never a token."""

from __future__ import annotations

import os
from collections import OrderedDict

KV_PAD = 256  # llama.cpp's KV length per decode: the cells in use rounded up to this (get_n_kv)
KEPT = 160    # graphs a context keeps (the patched sweep's EDGERUN_CUDA_GRAPHS_KEPT default)
REPLAYED = 2  # runs of a shape before its next run replays a captured graph


def graphs_kept() -> int:
    """The sweep's count as the patched library reads it (0, upstream's timed sweep, and anything
    not a count give the default)."""
    try:
        kept = int(os.environ.get("EDGERUN_CUDA_GRAPHS_KEPT", KEPT))
    except ValueError:
        return KEPT
    return kept if kept > 0 else KEPT


class CapturedGraphs:
    """Runs of each decode shape in one context's KV stream of `n_cells` cells."""

    def __init__(self, n_cells: int, kept: int | None = None):
        self.n_cells = n_cells
        self.kept = graphs_kept() if kept is None else kept
        self._runs: OrderedDict[tuple[int, int, int, bool], int] = OrderedDict()
        # (KV length, picked) -> the batch sizes with every row's logits that replay there: what a
        # round's plan asks about (cold_verify_sizes) without a lookup per size
        self._verify: dict[tuple[int, bool], set[int]] = {}

    def n_kv(self, end: int) -> int:
        """The KV length a batch attends over that fills the stream's cells up to `end`."""
        return min(self.n_cells, max(KV_PAD, -(-end // KV_PAD) * KV_PAD))

    def ran(self, tokens: int, outputs: int, end: int, picked: bool) -> None:
        """One decode of this shape ran."""
        key = (tokens, outputs, self.n_kv(end), picked)
        runs = self._runs.get(key, 0) + 1
        self._runs[key] = runs
        self._runs.move_to_end(key)
        if runs == REPLAYED and tokens == outputs:
            self._verify.setdefault((key[2], picked), set()).add(tokens)
        while len(self._runs) > self.kept:
            (t, o, n_kv, p), old = self._runs.popitem(last=False)
            if old >= REPLAYED and t == o:
                self._verify[(n_kv, p)].discard(t)

    def replays(self, tokens: int, outputs: int, end: int, picked: bool) -> bool:
        """The next decode of this shape replays a captured graph."""
        return self._runs.get((tokens, outputs, self.n_kv(end), picked), 0) >= REPLAYED

    def cold_verify_sizes(self, held: int, first: int, most: int, picked: bool) -> frozenset[int]:
        """The verify sizes n = 2..most + 1 (drafts + 1) whose batch would not replay: with `held`
        tokens in the stream and `first` (0 or 1) of them, `last`, already decoded in flight, the
        batch holds n - first tokens, each with logits, and fills the cells up to held + n."""
        cold: set[int] = set()
        n = 2
        while n <= most + 1:
            n_kv = self.n_kv(held + n)
            last = most + 1 if n_kv >= self.n_cells else min(most + 1, n_kv - held)  # sizes at this length
            replay = self._verify.get((n_kv, picked), ())
            cold.update(m for m in range(n, last + 1) if m - first not in replay)
            n = last + 1
        return frozenset(cold)

    def forget(self) -> None:
        """The pick was attached or detached: llama.cpp re-plans its scheduler, and on an H100 a
        verify size captured before ran at cold cost after it (8.1-13.6 ms against a price of 2.3-3.0)."""
        self._runs.clear()
        self._verify.clear()

    def runs(self) -> dict[tuple[int, int, int, bool], int]:
        """What was counted, oldest first: (tokens, outputs, KV length, picked) -> runs."""
        return dict(self._runs)

    def __len__(self) -> int:
        return len(self._runs)
