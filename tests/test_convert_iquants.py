"""The i-quants as plan candidates: measured only where llama.cpp can make them (rows of whole
256-blocks; the imatrix-only ones where the imatrix has the tensor), cached apart from the k-quants
so --k-quants-only reuses the other measurements, and chosen by the plan where they pay."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from edgerun.convert import pipeline, plan
from edgerun.convert.imatrix import Imatrix
from edgerun.convert.sensitivity import NEEDS_IMATRIX, measure

WIDE, NARROW = "blk.0.ffn_down.weight", "blk.0.attn_q.weight"
# ggml builds the 2-bit i-quants' lattice tables on first use (seconds on this CPU): the fast tests
# take the 3- and 4-bit ones; the 2-bit ones are covered by the model-tier conversions
CHEAP = ("IQ3_XXS", "IQ3_S", "IQ4_XS")


@pytest.fixture(scope="module")
def f16(tmp_path_factory):
    """A GGUF of two weights: rows of 512 (two 256-blocks) and of 96 (three 32-blocks)."""
    path = tmp_path_factory.mktemp("iq") / "two.gguf"
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tensor(WIDE, (rng.standard_normal((16, 512)) * 0.05).astype(np.float16))
    writer.add_tensor(NARROW, (rng.standard_normal((8, 96)) * 0.05).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def imatrix_for(*names: str) -> Imatrix:
    rng = np.random.default_rng(4)
    widths = {WIDE: 512, NARROW: 96}
    return Imatrix(values={n: rng.uniform(0.5, 2.0, widths[n]).astype(np.float32) for n in names}, tokens=1, chunks=1)


def test_i_quants_are_measured_where_llama_cpp_can_make_them(f16):
    assert set(CHEAP) < set(pipeline.I_QUANTS) and "IQ3_XXS" in NEEDS_IMATRIX
    types = pipeline.CANDIDATE_TYPES + CHEAP
    costs = {c.name: c for c in measure(f16, imatrix_for(WIDE, NARROW), types, n_threads=1)}
    assert set(CHEAP) <= set(costs[WIDE].errors)  # 512 = two 256-blocks
    assert not set(CHEAP) & set(costs[NARROW].errors)  # 96: 32-blocks only (fallback per tensor)
    assert "IQ4_NL" in costs[NARROW].errors and "Q4_0" in costs[NARROW].errors
    errs = costs[WIDE].errors
    assert errs["Q2_K"] > errs["IQ3_XXS"] > errs["IQ3_S"] > errs["IQ4_XS"] > 0  # more bits, less error

    # no importance for the tensor: the imatrix-only types are no candidates, the others are
    without = {c.name: c for c in measure(f16, imatrix_for(NARROW), types, n_threads=1)}[WIDE].errors
    assert "IQ3_XXS" not in without and {"IQ3_S", "IQ4_XS"} <= set(without)


def test_k_quants_only_reuses_the_cached_measurements(f16, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "I_QUANTS", CHEAP)
    imatrix = imatrix_for(WIDE, NARROW)
    opts = pipeline.ConvertOptions(src=str(f16), output=tmp_path / "o.gguf", quant="Q4_K_M", n_threads=1)
    seen = []
    both = pipeline.cached_costs(f16, imatrix, "k", opts, tmp_path, lambda label, d, t: seen.append(label))
    assert seen[-1] == "sensitivity (i-quants)" and "sensitivity" in seen
    seen.clear()
    k_only = pipeline.cached_costs(f16, imatrix, "k", dataclasses.replace(opts, i_quants=False),
                                   tmp_path, lambda label, d, t: seen.append(label))
    assert seen == ["sensitivity (cached)"]
    wide = {c.name: c for c in k_only}[WIDE]
    assert not set(pipeline.I_QUANTS) & set(wide.errors)
    assert {c.name: c for c in both}[WIDE].errors == {**wide.errors, **{
        t: e for t, e in {c.name: c for c in both}[WIDE].errors.items() if t in pipeline.I_QUANTS}}

    # at 3.1 bits per weight for the wide tensor the k-quants offer Q2_K, the i-quants IQ3_XXS:
    # the plan takes the i-quant, which is more accurate, unless told k-quants only
    narrow = {c.name: c for c in both}[NARROW]
    budget = int(512 * 16 * 3.1 / 8 + min(plan.type_nbytes(t, narrow.n_elements) for t in narrow.errors))
    chosen, k_chosen = plan.choose(both, budget), plan.choose(k_only, budget)
    assert chosen.types[WIDE] == "IQ3_XXS" and k_chosen.types[WIDE] == "Q2_K"
    assert chosen.error < k_chosen.error and max(chosen.nbytes, k_chosen.nbytes) <= budget


def test_i_quants_far_below_the_budget_are_not_measured(f16, tmp_path, monkeypatch):
    """At a budget's mean of 5.4 bits per weight the i-quants under 3.4 (IQ3_XXS here) are left
    out; IQ3_S (3.44) and IQ4_XS stay; without a budget (plans at several sizes) all are measured."""
    monkeypatch.setattr(pipeline, "I_QUANTS", CHEAP)
    imatrix = imatrix_for(WIDE, NARROW)
    opts = pipeline.ConvertOptions(src=str(f16), output=tmp_path / "o.gguf", quant="Q4_K_M", n_threads=1)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    near = {c.name: c for c in pipeline.cached_costs(f16, imatrix, "k", opts, tmp_path / "a", None, bpw=5.4)}
    assert {"IQ3_S", "IQ4_XS"} <= set(near[WIDE].errors) and "IQ3_XXS" not in near[WIDE].errors
    assert "Q2_K" in near[WIDE].errors  # the k-quants are all measured
    every = {c.name: c for c in pipeline.cached_costs(f16, imatrix, "k", opts, tmp_path / "b", None)}
    assert set(CHEAP) <= set(every[WIDE].errors)
    assert {t: e for t, e in every[WIDE].errors.items() if t != "IQ3_XXS"} == near[WIDE].errors


def test_of_two_plans_the_one_measured_closer_to_the_f16_is_kept(tiny_model, tmp_path):
    """A plan with i-quants must beat its k-quant rival measured whole: keep_measured_best
    quantizes each plan, measures each file against the F16 on calibration text, and leaves the
    better one as the output (here the Q8_0 plan over the Q4_0 one, named in either order)."""
    from types import SimpleNamespace

    from edgerun.convert.tensors import open_gguf

    names = [t.name for t in open_gguf(tiny_model).tensors if len(t.shape) == 2 and "norm" not in t.name]
    text = pipeline.calibration_text(["code"])
    for order in (("coarse", "fine"), ("fine", "coarse")):
        types = {"coarse": "Q4_0", "fine": "Q8_0"}
        plans = {name: SimpleNamespace(types=dict.fromkeys(names, types[name])) for name in order}
        out = tmp_path / order[0] / "out.gguf"
        out.parent.mkdir()
        kept, kld = pipeline.keep_measured_best(tiny_model, plans, out, base="Q8_0", imatrix=None, text=text,
                                                n_ctx=128, n_threads=1)
        assert kept == "fine" and 0 < kld["fine"] < kld["coarse"]
        assert [p.name for p in out.parent.iterdir()] == ["out.gguf"]  # the rival's file is gone
        assert {t.tensor_type.name for t in open_gguf(out).tensors if t.name in names} == {"Q8_0"}
