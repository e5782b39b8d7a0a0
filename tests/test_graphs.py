"""The mirror of a context's captured CUDA graphs (edgerun/runtime/graphs.py): a shape replays from
its third run, a shape is its batch, its outputs, its KV length padded to 256 cells and its pick;
the least recently used go past the kept count; attaching or detaching a pick forgets them all."""
import numpy as np

from edgerun.runtime.graphs import KV_PAD, CapturedGraphs, graphs_kept


def test_a_shape_replays_from_its_third_run_at_its_kv_length():
    g = CapturedGraphs(n_cells=4096)
    for runs in range(3):
        assert g.replays(17, 17, 300, False) == (runs >= 2)
        g.ran(17, 17, 300, False)
    # the same KV length padded: any end from 257 to 512 cells
    assert g.replays(17, 17, KV_PAD + 1, False) and g.replays(17, 17, 2 * KV_PAD, False)
    assert not g.replays(17, 17, 2 * KV_PAD + 1, False), "a longer KV is another graph"
    assert not g.replays(17, 1, 300, False), "one row of logits is another graph (a prompt's chunk)"
    assert not g.replays(17, 17, 300, True), "a pick in the graph is another graph"
    # the KV length is never under one pad, nor over the stream's cells
    g.ran(5, 5, 3, False)
    g.ran(5, 5, KV_PAD, False)
    assert g.replays(5, 5, 1, False)
    small = CapturedGraphs(n_cells=300)
    small.ran(4, 4, 290, False)
    small.ran(4, 4, 300, False)
    assert small.replays(4, 4, 299, False)


def test_past_the_kept_count_the_least_recently_used_shapes_go():
    g = CapturedGraphs(n_cells=4096, kept=3)
    for n in (2, 3, 4):
        g.ran(n, n, 10, False)
        g.ran(n, n, 10, False)
    g.ran(2, 2, 10, False)  # 2 is now the most recently used
    g.ran(5, 5, 10, False)
    assert len(g) == 3
    assert g.replays(2, 2, 10, False) and g.replays(4, 4, 10, False)
    assert not g.replays(3, 3, 10, False), "the oldest went"


def test_a_pick_attached_or_detached_forgets_every_graph():
    g = CapturedGraphs(n_cells=4096)
    for picked in (False, True):
        g.ran(9, 9, 40, picked)
        g.ran(9, 9, 40, picked)
    assert g.replays(9, 9, 40, False) and g.replays(9, 9, 40, True)
    g.forget()
    assert len(g) == 0 and not g.replays(9, 9, 40, False) and not g.replays(9, 9, 40, True)


def test_the_kept_count_follows_the_patched_sweeps_setting(monkeypatch):
    monkeypatch.setenv("EDGERUN_CUDA_GRAPHS_KEPT", "12")
    assert graphs_kept() == 12 and CapturedGraphs(4096).kept == 12
    for unusable in ("0", "many"):  # upstream's timed sweep, or not a count: the default
        monkeypatch.setenv("EDGERUN_CUDA_GRAPHS_KEPT", unusable)
        assert graphs_kept() == 160


def test_a_rounds_cold_sizes_are_those_whose_batch_would_not_replay():
    """What a round's plan asks (every verify size at once, from an index of the captured ones)
    agrees with asking shape by shape, across a KV length's end, at the stream's last cells, after
    evictions and after the pick changed."""
    gen = np.random.default_rng(5)
    for case in range(60):
        g = CapturedGraphs(n_cells=int(gen.choice([700, 4096])), kept=int(gen.choice([6, 40])))
        for _ in range(int(gen.integers(0, 80))):
            n = int(gen.integers(1, 66))
            g.ran(n, n if gen.random() < 0.8 else 1, int(gen.integers(n, g.n_cells)), bool(gen.random() < 0.5))
            if gen.random() < 0.02:
                g.forget()
        held, first, picked = int(gen.integers(0, g.n_cells - 66)), int(gen.integers(0, 2)), bool(case % 2)
        most = int(gen.integers(1, 65))
        one_by_one = {n for n in range(2, most + 2) if not g.replays(n - first, n - first, held + n, picked)}
        assert g.cold_verify_sizes(held, first, most, picked) == one_by_one
    g = CapturedGraphs(n_cells=4096)
    for _ in range(2):
        g.ran(16, 16, 250, False)  # 16 tokens over 256 cells
    assert g.cold_verify_sizes(234, 0, 30, False) == frozenset(range(2, 32)) - {16}
    assert 17 not in g.cold_verify_sizes(234, 1, 30, False)  # `last` in flight: 16 tokens verify 16 drafts
