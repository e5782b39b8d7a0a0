"""`edgerun convert --plot`: the plan against llama.cpp's stock recipes, on the tiny model."""

from __future__ import annotations

import pytest

from edgerun.convert import pipeline
from edgerun.convert.plot import points, text_chart
from edgerun.errors import ConvertError
from testkit.cli import run_cli

CODE = pipeline.CALIB_DIR / "code.txt"


@pytest.mark.slow
def test_plot_compares_the_plan_with_the_stock_recipes_near_its_size(tiny_model, tmp_path):
    calib, held_out = tmp_path / "calib.txt", tmp_path / "eval.txt"
    calib.write_text(CODE.read_text()[:1500])
    held_out.write_text(pipeline.EVAL_TEXT.read_text()[:1200])
    out, png = tmp_path / "out.gguf", tmp_path / "plan.png"
    result = pipeline.convert(pipeline.ConvertOptions(
        src=str(tiny_model), output=out, quant="Q4_K_M", calib=(str(calib),), eval_text=held_out, eval_chunks=1,
        weigh=False, n_threads=1, plot=png, work_dir=tmp_path / "work"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.part"))  # written atomically: no temporary left
    doc = result.to_json()
    stock = doc["stock"]
    # Q4_K_M's own size is the budget: the recipe itself is one of those measured, with its neighbours
    assert "Q4_K_M" in stock and 3 <= len(stock) <= 4
    sizes = [r["size_bytes"] for r in stock.values()]
    assert sizes == sorted(sizes) and min(sizes) < doc["size_bytes"] < max(sizes)
    assert all(r["kld_mean"] > 0 for r in stock.values())
    assert len(points(doc)) == len(stock) + 1
    assert "against llama.cpp's stock recipes" in result.table()
    assert sum(line.startswith("*") for line in text_chart(doc)) == 1  # the plan, marked once


def test_plot_needs_the_evaluation(tmp_path, capsys):
    with pytest.raises(ConvertError, match="drop --eval-chunks 0"):
        pipeline.check(pipeline.ConvertOptions(src=str(tmp_path), output=tmp_path / "o.gguf", quant="Q4_K_M",
                                               eval_chunks=0, plot=tmp_path / "p.png"))
    r = run_cli(capsys, "convert", str(tmp_path), "-o", str(tmp_path / "o.gguf"), "--quant", "Q4_K_M",
                "--eval-chunks", "0", "--plot", str(tmp_path / "p.png"), "--k-quants-only")
    assert r.returncode == 2 and "drop --eval-chunks 0" in r.stderr
    r = run_cli(capsys, "convert", str(tmp_path), "--name", "../x", "--quant", "Q4_K_M")
    assert r.returncode == 2 and "model name '../x'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
