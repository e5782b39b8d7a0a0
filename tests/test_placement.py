"""The offload plan is a pure function of sizes; its memory estimate matches what llama.cpp
allocates."""

import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgerun.errors import ConfigError
from edgerun.models.gguf_check import inspect
from edgerun.runner import footprint, placement_for
from edgerun.runtime import devices, placement
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings

GiB = 2**30
MiB = 2**20
PLENTY = 64 * GiB


def fp(layers=(GiB // 4,) * 28, inp=GiB // 8, out=GiB // 8, kv=GiB // 64, compute=GiB // 4):
    return placement.Footprint(tuple(layers), inp, out, kv, compute)


def auto(target, draft=None, vram=0, ram=PLENTY, **kw):
    return placement.plan(target, draft, free_vram=vram, free_ram=ram, gpu_available=True, **kw)


def test_no_gpu_keeps_everything_on_cpu():
    t = fp()
    p = placement.plan(t, None, free_vram=0, free_ram=PLENTY, gpu_available=False)
    assert p.target.gpu_layers == 0 and p.gpu_bytes == 0
    assert p.cpu_bytes == t.total + t.compute_bytes
    assert "no GPU backend" in p.reason
    for bad in ("all", "-1"):  # a bad request is refused without a GPU too, not quietly run on the CPU
        with pytest.raises(ConfigError, match="not a number"):
            placement.plan(t, None, free_vram=0, free_ram=PLENTY, gpu_available=False, requested=bad)


def test_everything_fits_offloads_the_head_too():
    t = fp()
    p = auto(t, vram=16 * GiB)
    assert p.target.gpu_layers == t.n_layers + 1
    # only the input embeddings and the host's compute buffer stay in RAM
    assert p.target.cpu_bytes == t.input_bytes + t.compute_bytes


def test_partial_offload_counts_kv_compute_and_margin():
    t = fp()
    p = auto(t, vram=4 * GiB)
    budget = 4 * GiB - placement.VRAM_MARGIN - t.compute_bytes
    assert p.target.gpu_layers == budget // (GiB // 4 + GiB // 64)
    assert p.gpu_bytes <= 4 * GiB - placement.VRAM_MARGIN
    assert f"{p.target.gpu_layers}/28 target layers" in p.reason


def test_draft_goes_fully_on_gpu_first():
    t, d = fp(), fp(layers=(GiB // 40,) * 24, inp=GiB // 16, out=GiB // 16, kv=GiB // 256, compute=GiB // 4)
    vram = 3 * GiB
    p = auto(t, d, vram=vram)
    assert p.draft.gpu_layers == d.n_layers + 1
    alone = auto(t, vram=vram)
    assert 0 < p.target.gpu_layers < alone.target.gpu_layers  # the target got what the draft left
    assert p.gpu_bytes <= vram - placement.VRAM_MARGIN
    assert "draft fully on GPU" in p.reason


def test_draft_that_does_not_fit_stays_on_cpu_and_target_takes_the_gpu():
    t, d = fp(layers=(GiB // 8,) * 8), fp(layers=(GiB,) * 8)
    p = auto(t, d, vram=2 * GiB)
    assert p.draft.gpu_layers == 0 and p.target.gpu_layers > 0
    assert "draft on CPU" in p.reason


def test_explicit_request_is_honoured_and_clamped():
    t = fp(layers=(10,) * 4)
    assert auto(t, requested="2").target.gpu_layers == 2
    assert auto(t, requested="99").target.gpu_layers == 5  # 4 blocks + the output layer
    assert auto(t, vram=GiB, requested="0").target.gpu_layers == 0
    with pytest.raises(ConfigError, match="not a number"):
        auto(t, requested="lots")


def test_plan_that_does_not_fit_in_ram_is_refused_with_sizes():
    t = fp()
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB of RAM .* only [\d.]+ GiB of RAM is free"):
        placement.plan(t, None, free_vram=0, free_ram=2 * GiB, gpu_available=False)
    # the same model fits once most of it goes to the GPU
    assert auto(t, vram=16 * GiB, ram=2 * GiB).target.gpu_layers == 29


layer_lists = st.lists(st.integers(1, 2 * GiB), min_size=1, max_size=64)


@given(layer_lists, st.integers(0, GiB), st.integers(0, 64 * MiB), st.integers(0, GiB), st.integers(0, 96 * GiB))
def test_auto_never_exceeds_free_vram_and_conserves_bytes(layers, other, kv, compute, vram):
    t = placement.Footprint(tuple(layers), other // 2, other // 2, kv, compute)
    p = auto(t, vram=vram, ram=2**60)
    assert p.gpu_bytes <= max(0, vram - placement.VRAM_MARGIN)
    buffers = compute * (2 if p.target.gpu_layers else 1)  # each side that computes has a buffer
    assert p.gpu_bytes + p.cpu_bytes == t.total + buffers


@given(layer_lists, st.integers(0, 32 * GiB), st.integers(0, 32 * GiB), st.booleans())
def test_more_vram_never_means_fewer_layers(layers, a, b, with_draft):
    lo, hi = sorted((a, b))
    t = placement.Footprint(tuple(layers), GiB // 8, GiB // 8, MiB, 64 * MiB)
    d = fp(layers=(GiB // 16,) * 8) if with_draft else None
    n = lambda v: auto(t, d, vram=v, ram=2**60).target.gpu_layers if d is None else _total_layers(auto(t, d, vram=v, ram=2**60))
    assert n(lo) <= n(hi)


def _total_layers(p):
    return p.target.gpu_layers + p.draft.gpu_layers


def test_runner_suggests_a_context_that_fits(small_model):
    info = inspect(small_model)
    settings = EngineSettings(n_ctx=32768, gpu_layers="0")
    need = footprint(info, settings.replace(n_ctx=2048)).total + footprint(info, settings).compute_bytes
    memory = devices.Memory(free_ram=need + placement.RAM_MARGIN + MiB, free_vram=0, gpu=False)
    with pytest.raises(ConfigError, match=r"--ctx 2048 would fit"):
        placement_for(info, settings, memory=memory)


_SIZES = re.compile(r"(CPU_Mapped model|CUDA\d model|KV|compute|output) buffer size = +([\d.]+) MiB")


def _reported_bytes(lines: list[str]) -> int:
    """What llama.cpp says it allocated: weights (in their mapped or device buffers; a repacked
    CPU copy replaces pages of the mapped file, so it is not counted twice), KV, compute, output."""
    return int(sum(float(m.group(2)) for line in lines if (m := _SIZES.search(line))) * MiB)


@pytest.mark.parametrize("n_ctx,n_ubatch", [(4096, 512), (16384, 256)])
def test_estimate_is_within_ten_percent_of_llama_cpp(small_model, target_model, other_vocab_model, n_ctx, n_ubatch):
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("edgerun.llama")
    handler, level = Capture(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        for path in (small_model, target_model, other_vocab_model):
            info = inspect(path)
            settings = EngineSettings(n_ctx=n_ctx, n_ubatch=n_ubatch, gpu_layers="0")
            plan = placement_for(info, settings, memory=devices.Memory(PLENTY, 0, gpu=False))
            lines.clear()
            with Model(path, n_gpu_layers=plan.target.gpu_layers, info=info) as m, Context(m, settings):
                actual = _reported_bytes(lines)
            estimate = plan.cpu_bytes + plan.gpu_bytes
            assert abs(estimate - actual) / actual < 0.10, (path.name, estimate, actual)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_cpu_target_still_gets_a_gpu_draft():
    """--gpu-layers 0 is about the target: the draft, the latency-critical part, still goes to the GPU."""
    t, d = fp(), fp(layers=(GiB // 40,) * 24, compute=GiB // 8)
    p = auto(t, d, vram=8 * GiB, requested="0")
    assert p.target.gpu_layers == 0 and p.draft.gpu_layers == d.n_layers + 1


def test_a_draft_all_on_the_gpu_computes_on_one_cpu_thread():
    """Its step's CPU part is one embedding row: waking every thread for it cost CPU-target
    replies 5-10% on the H200 host. A draft partly or wholly on the CPU keeps every thread."""
    t, d = fp(), fp(layers=(GiB // 40,) * 24, compute=GiB // 8)
    on_gpu = auto(t, d, vram=8 * GiB, requested="0").draft
    on_cpu = auto(t, d, vram=GiB // 100, requested="0").draft
    assert on_gpu.all_on_gpu and placement.draft_threads(on_gpu, 16) == 1
    assert not on_cpu.all_on_gpu and placement.draft_threads(on_cpu, 16) == 16
    part = placement.split(d, d.n_layers)  # every block but not the output head
    assert not part.all_on_gpu and placement.draft_threads(part, 16) == 16


def test_vram_cap_limits_the_plan(small_model):
    info = inspect(small_model)
    memory = devices.Memory(free_ram=PLENTY, free_vram=80 * GiB, gpu=True)
    full = placement_for(info, EngineSettings(), memory=memory)
    capped = placement_for(info, EngineSettings(max_vram=placement.VRAM_MARGIN + 500 * MiB), memory=memory)
    assert full.target.gpu_layers == info.n_layers + 1
    assert 0 < capped.target.gpu_layers < info.n_layers and capped.gpu_bytes <= 500 * MiB
