"""The offload plan is a pure function of sizes."""

from hypothesis import given
from hypothesis import strategies as st

from edgerun.runtime import placement

GiB = 2**30


def test_no_gpu_keeps_everything_on_cpu():
    p = placement.plan((100,) * 4, 50, 10, 0, gpu_available=False)
    assert p.gpu_layers == 0 and p.gpu_bytes == 0 and p.cpu_bytes == 4 * 110 + 50


def test_everything_fits():
    p = placement.plan((GiB // 10,) * 24, GiB // 5, 1 << 20, 8 * GiB, gpu_available=True)
    assert p.gpu_layers == 25 and p.cpu_bytes == 0  # 24 blocks + the output layer


def test_partial_offload_counts_kv_and_margin():
    layers = (GiB // 4,) * 28
    p = placement.plan(layers, GiB // 2, GiB // 64, 4 * GiB, gpu_available=True)
    budget = 4 * GiB - placement.MARGIN_BYTES - GiB // 2
    assert p.gpu_layers == budget // (GiB // 4 + GiB // 64)
    assert p.gpu_bytes <= 4 * GiB - placement.MARGIN_BYTES


def test_explicit_request_is_honoured_and_clamped():
    assert placement.plan((10,) * 4, 0, 0, 0, gpu_available=True, requested="2").gpu_layers == 2
    assert placement.plan((10,) * 4, 0, 0, 0, gpu_available=True, requested="99").gpu_layers == 4
    assert placement.plan((10,) * 4, 0, 0, GiB, gpu_available=True, requested="0").gpu_layers == 0


@given(
    st.lists(st.integers(1, 2 * GiB), min_size=1, max_size=64),
    st.integers(0, GiB), st.integers(0, 64 << 20), st.integers(0, 96 * GiB),
)
def test_auto_never_exceeds_free_vram_and_conserves_bytes(layers, other, kv, vram):
    p = placement.plan(tuple(layers), other, kv, vram, gpu_available=True)
    assert p.gpu_bytes <= max(0, vram - placement.MARGIN_BYTES)
    assert p.gpu_bytes + p.cpu_bytes == sum(layers) + other + kv * len(layers)


@given(st.lists(st.integers(1, GiB), min_size=1, max_size=32), st.integers(0, 32 * GiB), st.integers(0, 32 * GiB))
def test_more_vram_never_means_fewer_layers(layers, a, b):
    lo, hi = sorted((a, b))
    plan = lambda v: placement.plan(tuple(layers), GiB // 8, 1 << 20, v, gpu_available=True).gpu_layers
    assert plan(lo) <= plan(hi)
