"""Sharded checkpoints: the index's shard names stay inside the checkpoint directory, and a broken
index or shard is one line from `edgerun convert`, never a traceback. The checkpoints are tiny
random ones (tiny.py) split into two shards the way the hub stores large models, then broken."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest

from edgerun.convert.source import prepare_f16
from testkit import weights
from testkit.cli import one_line_error, run_cli
from testkit.tiny import write_tiny_checkpoint

INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def sharded_checkpoint(root: Path) -> Path:
    """A tiny qwen2 checkpoint whose weights are two shards and an index, as the hub has them."""
    src = write_tiny_checkpoint(root, "qwen2")
    tensors = weights.load(src / "model.safetensors")
    names = sorted(tensors)
    groups = dict(zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2:])))
    for shard, group in groups.items():
        weights.save(src / shard, {n: tensors[n] for n in group}, metadata={"format": "pt"})
    (src / "model.safetensors").unlink()
    weight_map = {n: shard for shard, group in groups.items() for n in group}
    write_index(src, {"metadata": {}, "weight_map": weight_map})
    return src


def write_index(src: Path, value) -> None:
    (src / INDEX).write_text(json.dumps(value))


def read_map(src: Path) -> dict[str, str]:
    return json.loads((src / INDEX).read_text())["weight_map"]


def remap(src: Path, shard: str, new: str) -> None:
    write_index(src, {"weight_map": {n: new if s == shard else s for n, s in read_map(src).items()}})


def move_out(src: Path, shard: str) -> Path:
    """SHARD moved to the checkpoint's parent directory: a valid file outside the checkpoint."""
    outside = src.parent / "outside.safetensors"
    shutil.move(src / shard, outside)
    return outside


def up_one_level(src: Path) -> None:
    move_out(src, SHARDS[1])
    remap(src, SHARDS[1], "../outside.safetensors")


def absolute_path(src: Path) -> None:
    remap(src, SHARDS[1], str(move_out(src, SHARDS[1])))


def symlink_out(src: Path) -> None:
    (src / SHARDS[1]).symlink_to(move_out(src, SHARDS[1]))


def symlink_out_unsharded(src: Path) -> None:
    """No index: the one weights file is itself a link out of the directory."""
    for shard in SHARDS:
        (src / shard).unlink()
    (src / INDEX).unlink()
    outside = src.parent / "outside.safetensors"
    write_tiny_checkpoint(src.parent / "other", "qwen2")
    shutil.move(src.parent / "other" / "model.safetensors", outside)
    (src / "model.safetensors").symlink_to(outside)


def missing_shard(src: Path) -> None:
    (src / SHARDS[1]).unlink()


def not_json(src: Path) -> None:
    (src / INDEX).write_text('{"weight_map": {"model.norm.weight": ')


def map_is_a_list(src: Path) -> None:
    write_index(src, {"weight_map": list(read_map(src).items())})


def shard_is_a_number(src: Path) -> None:
    weight_map = read_map(src)
    weight_map[next(iter(weight_map))] = 7
    write_index(src, {"weight_map": weight_map})


def truncated_header(src: Path) -> None:
    data = (src / SHARDS[1]).read_bytes()
    (src / SHARDS[1]).write_bytes(data[:100])


def huge_header_length(src: Path) -> None:
    data = (src / SHARDS[1]).read_bytes()
    (src / SHARDS[1]).write_bytes(struct.pack("<Q", 2**63) + data[8:])


def tensor_in_the_wrong_shard(src: Path) -> None:
    weight_map = read_map(src)
    name = next(n for n, s in weight_map.items() if s == SHARDS[1])
    weight_map[name] = SHARDS[0]
    write_index(src, {"weight_map": weight_map})


BREAKAGES: dict[Callable[[Path], None], str] = {
    up_one_level: "'../outside.safetensors' is not a file in the checkpoint directory",
    absolute_path: "outside.safetensors' is not a file in the checkpoint directory",
    symlink_out: "outside the checkpoint directory",
    symlink_out_unsharded: "outside the checkpoint directory",
    missing_shard: f"shards listed in the index are missing ({SHARDS[1]})",
    not_json: "cannot read it as JSON",
    map_is_a_list: "no weight_map",
    shard_is_a_number: "is mapped to 7, not a .safetensors file name",
    truncated_header: "not a readable safetensors file",
    huge_header_length: "not a readable safetensors file (Error while deserializing header: header too large)",
    tensor_in_the_wrong_shard: "which does not hold it",
}


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__)
def test_broken_checkpoint_is_one_line_from_the_cli(tmp_path, breakage, capsys, monkeypatch):
    """Through cli.main; the first breakage also in a real edgerun process (the exit status and
    stderr of the process itself)."""
    src = sharded_checkpoint(tmp_path / "ckpt")
    breakage(src)
    out = tmp_path / "out.gguf"
    args = ["convert", str(src), "-o", str(out), "--quant", "Q8_0", "--no-weigh", "--eval-chunks", "0"]
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    if breakage is next(iter(BREAKAGES)):
        proc = subprocess.run([sys.executable, "-m", "edgerun.cli", *args], capture_output=True, text=True,
                              timeout=300, env=os.environ.copy())
        assert proc.returncode == 1
        one_line_error(proc, BREAKAGES[breakage])
    result = run_cli(capsys, *args)
    assert result.returncode == 1
    one_line_error(result, BREAKAGES[breakage])
    assert not out.exists()


def test_sharded_checkpoint_converts_like_the_unsharded_one(tmp_path):
    whole = write_tiny_checkpoint(tmp_path / "whole", "qwen2")
    sharded = sharded_checkpoint(tmp_path / "sharded")
    a = gguf.GGUFReader(prepare_f16(str(whole), tmp_path / "work"))
    b = gguf.GGUFReader(prepare_f16(str(sharded), tmp_path / "work"))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all((x.data == y.data).all() for x, y in zip(a.tensors, b.tensors))


def test_hugging_face_cache_snapshot_links_are_inside(tmp_path):
    """A snapshot of huggingface_hub's cache (what hf:// downloads into, and what users point
    converters at): REPO/snapshots/REV/ holds links to REPO/blobs/. Those links stay inside."""
    src = sharded_checkpoint(tmp_path / "ckpt")
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, path in enumerate(sorted(src.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.move(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    out = gguf.GGUFReader(prepare_f16(str(snapshot), tmp_path / "work"))
    assert "blk.1.ffn_down.weight" in {t.name for t in out.tensors}
