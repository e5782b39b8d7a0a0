"""Role gains: the pure parts (role names, probe types, weighing), and the probes' files and
scoring on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgerun.convert import gains
from edgerun.convert.sensitivity import TensorCost
from edgerun.errors import ConvertError


def cost(name: str, errors: dict[str, float], n: int = 256 * 256) -> TensorCost:
    return TensorCost(name=name, shape=(256, n // 256), n_elements=n, row_len=256, errors=errors)


def test_role_is_the_name_without_its_layer():
    assert gains.role_of("blk.12.attn_v.weight") == "attn_v.weight"
    assert gains.role_of("output.weight") == "output.weight"
    assert gains.role_of("token_embd.weight") == "token_embd.weight"


def test_probe_type_is_q4_0_else_the_cheapest_candidate():
    assert gains.probe_type(cost("a", {"Q8_0": 1e-4, "Q2_K": 0.3, "Q4_K": 0.02})) == "Q2_K"
    assert gains.probe_type(cost("a", {"Q8_0": 1e-4, "Q2_K": 0.3, "Q4_0": 0.04, "Q4_K": 0.02})) == "Q4_0"
    assert gains.probe_type(cost("b", {"Q8_0": 1e-4, "Q4_1": 0.01, "Q4_0": 0.02})) == "Q4_0"
    assert gains.probe_type(cost("c", {"Q8_0": 1e-4, "Q4_1": 0.01, "Q5_0": 0.008})) == "Q4_1"


def test_weigh_scales_each_role_and_keeps_the_order_within_it():
    costs = [cost("blk.0.attn_k.weight", {"Q2_K": 0.2, "Q4_K": 0.02}),
             cost("blk.1.attn_k.weight", {"Q2_K": 0.4, "Q4_K": 0.04}),
             cost("output.weight", {"Q2_K": 0.1, "Q6_K": 0.001})]
    weighed = gains.weigh(costs, {"attn_k.weight": 0.5, "output.weight": 20.0})
    assert weighed[0].errors == {"Q2_K": 0.1, "Q4_K": 0.01}
    assert weighed[1].errors == {"Q2_K": 0.2, "Q4_K": 0.02}
    assert weighed[2].errors == {"Q2_K": 2.0, "Q6_K": 0.02}
    assert [c.name for c in weighed] == [c.name for c in costs] and costs[0].errors["Q2_K"] == 0.2


def test_weigh_refuses_a_role_without_a_gain():
    with pytest.raises(ConvertError, match="no measured gain for output.weight"):
        gains.weigh([cost("output.weight", {"Q2_K": 0.1})], {"attn_k.weight": 1.0})


# -- probes on the tiny model: splice and the reference's scoring window ------------------------

def _weights(path) -> list[str]:
    import gguf

    return [t.name for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith("weight") and len(t.shape) == 2]


def test_splice_writes_the_file_the_quantizer_writes_for_those_overrides(tiny_model, tmp_path):
    """Two quantizes with one recipe, one of them with every weight at Q4_0: the first with the
    second's attn_v and head spliced in is, byte for byte, llama.cpp's quantize with just those
    overridden (what a probe used to cost a quantize of its own)."""
    from edgerun.convert.quantize import quantize

    names = _weights(tiny_model)
    base = quantize(tiny_model, tmp_path / "base.gguf", ftype="Q8_0", overrides={}, imatrix=None)
    cheap = quantize(tiny_model, tmp_path / "cheap.gguf", ftype="Q8_0", overrides=dict.fromkeys(names, "Q4_0"),
                     imatrix=None)
    pick = {n for n in names if ".attn_v." in n or n == "output.weight"}
    assert len(pick) == 3
    direct = quantize(tiny_model, tmp_path / "direct.gguf", ftype="Q8_0", overrides=dict.fromkeys(pick, "Q4_0"),
                      imatrix=None)
    spliced = gains.Splicer(base, cheap).write(pick, tmp_path / "spliced.gguf")
    assert spliced.read_bytes() == direct.read_bytes()
    assert spliced.read_bytes() != base.read_bytes()


def test_a_probe_is_the_f16_with_one_role_from_the_cheap_file(tiny_model, tmp_path):
    """The F16 (another tensor order, other metadata) with one role spliced in: that role's
    tensors have the cheap file's type and bytes, every other tensor the F16's, and llama.cpp
    loads and runs it: its KLD from the F16 is above zero, the F16's own is zero."""
    import gguf

    from edgerun.convert.quantize import quantize
    from edgerun.convert.report import Reference

    names = _weights(tiny_model)
    cheap = quantize(tiny_model, tmp_path / "cheap.gguf", ftype="Q8_0", overrides=dict.fromkeys(names, "Q4_0"),
                     imatrix=None)
    role = {n for n in names if gains.role_of(n) == "ffn_down.weight"}
    probe = gains.Splicer(tiny_model, cheap).write(role, tmp_path / "probe.gguf")
    f16 = {t.name: t for t in gguf.GGUFReader(str(tiny_model)).tensors}
    q = {t.name: t for t in gguf.GGUFReader(str(cheap)).tensors}
    got = gguf.GGUFReader(str(probe)).tensors
    assert [t.name for t in got] == list(f16)
    for t in got:
        src = q[t.name] if t.name in role else f16[t.name]
        assert (t.tensor_type, bytes(t.data)) == (src.tensor_type, bytes(src.data)), t.name
    text = (Path(__file__).resolve().parents[1] / "edgerun" / "data" / "calib" / "code.txt").read_text()[:6000]
    ref = Reference(tiny_model, text, n_ctx=128, max_chunks=2, first=16, n_threads=1)
    assert ref.compare(tiny_model).kld_mean == 0.0
    assert ref.compare(probe).kld_mean > 0.0


def test_kld_mean_is_compares_mean_kld(tiny_model, tmp_path):
    """The probes' KL (the reference's side computed once, the quantization's logits read in
    place) is compare()'s mean KLD, to float rounding; the reference itself scores zero, and a
    probe loaded with the info it was spliced under scores what it scores validated."""
    from edgerun.convert.quantize import quantize
    from edgerun.convert.report import Reference
    from edgerun.models.gguf_check import inspect

    names = _weights(tiny_model)
    cheap = quantize(tiny_model, tmp_path / "cheap.gguf", ftype="Q8_0", overrides=dict.fromkeys(names, "Q4_0"),
                     imatrix=None)
    probe = gains.Splicer(tiny_model, cheap).write({n for n in names if ".ffn_up." in n}, tmp_path / "probe.gguf")
    text = (Path(__file__).resolve().parents[1] / "edgerun" / "data" / "calib" / "code.txt").read_text()[:6000]
    ref = Reference(tiny_model, text, n_ctx=128, max_chunks=2, first=16, n_threads=1)
    full = ref.compare(probe).kld_mean
    assert full > 0 and ref.kld_mean(probe) == pytest.approx(full, rel=1e-4)
    assert ref.kld_mean(tiny_model) == pytest.approx(0.0, abs=1e-6)
    assert ref.kld_mean(probe, info=inspect(probe)) == ref.kld_mean(probe)


def test_reference_scores_from_its_first_position(tiny_model):
    from edgerun.convert.report import Reference

    text = (Path(__file__).resolve().parents[1] / "edgerun" / "data" / "calib" / "code.txt").read_text()[:6000]
    default = Reference(tiny_model, text, n_ctx=128, max_chunks=2, n_threads=1).compare(tiny_model)
    early = Reference(tiny_model, text, n_ctx=128, max_chunks=2, first=16, n_threads=1).compare(tiny_model)
    assert (default.n_positions, early.n_positions) == (2 * (127 - 64), 2 * (127 - 16))
    with pytest.raises(ConvertError, match="first scored position 127"):
        Reference(tiny_model, text, n_ctx=128, max_chunks=1, first=127)


def test_splice_refuses_tensors_one_file_lacks(tiny_model, tmp_path):
    with pytest.raises(ConvertError, match="no tensor 'blk.9.attn_q.weight'"):
        gains.Splicer(tiny_model, tiny_model).write({"blk.9.attn_q.weight"}, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_the_probes_reference_comes_from_calibration(tiny_model):
    """Calibration evaluates every position of its chunks: the logits it hands over for the probes'
    first chunk are the ones the reference would compute (so it does not run that chunk again);
    logits of other tokens are not taken."""
    import numpy as np

    from edgerun.convert import report
    from edgerun.convert.calibrate import collect_imatrix
    from edgerun.convert.report import Reference

    text = (Path(__file__).resolve().parents[1] / "edgerun" / "data" / "calib" / "code.txt").read_text()[:6000]
    kept = []
    collect_imatrix(tiny_model, text, n_ctx=128, max_chunks=3, n_threads=1,
                    on_chunk=lambda i, tokens, ctx: kept.append((tokens, report.evaluated_logits(ctx, len(tokens), 16))))
    assert len(kept) == 3
    fresh = Reference(tiny_model, text, n_ctx=128, max_chunks=2, first=16, n_threads=1)
    given = Reference(tiny_model, text, n_ctx=128, max_chunks=2, first=16, n_threads=1, known=kept[:1])
    assert given.logits[0] is kept[0][1] and given.logits[1] is not kept[1][1]
    assert all(np.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(fresh.logits, given.logits))
    wrong = Reference(tiny_model, text, n_ctx=128, max_chunks=1, first=16, n_threads=1, known=[(kept[1][0], kept[1][1])])
    assert wrong.logits[0] is not kept[1][1] and np.allclose(wrong.logits[0], fresh.logits[0], rtol=0, atol=1e-4)
