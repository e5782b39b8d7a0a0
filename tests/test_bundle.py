"""The offline bundle: scripts/setup.sh --bundle refuses a bundle it cannot trust in one line,
before it creates or installs anything, and scripts/pack_bundle.sh refuses bad arguments.

What a good bundle installs is proven by setting up a fresh clone from one with the network cut
(docs/BENCHMARKS.md, GPU section, and the README's air-gapped section say how); that takes a
llama.cpp build, so it is no unit test."""
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"
PACK = ROOT / "scripts" / "pack_bundle.sh"
VERSION = next(line.split("=", 1)[1] for line in SETUP.read_text().splitlines() if line.startswith("LLAMA_CPP_VERSION="))


def _bundle(folder: Path, version: str = VERSION) -> Path:
    (folder / "wheels").mkdir(parents=True)
    (folder / "llama-cpp-python").mkdir()
    (folder / "llama-cpp-python" / f"llama_cpp_python-{version}.tar.gz").write_bytes(b"not really an sdist")
    (folder / "bundle.env").write_text(f'profile=lean\nextras=\nllama_cpp_python={version}\npython=3.12\nmodels=""\n')
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(folder)}"
             for p in sorted(folder.rglob("*")) if p.is_file()]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return folder


def _setup(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # EDGERUN_PYTHON points at a python that must never run: a refusal comes before any install
    env = os.environ | {"EDGERUN_PYTHON": str(tmp_path / "no-python"), "PIP_NO_INDEX": "1"}
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, env=env, timeout=60)


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_a_folder_without_bundle_env_is_refused(tmp_path):
    _one_line(_setup("--bundle", str(tmp_path), tmp_path=tmp_path), "not a bundle", "pack_bundle.sh")


def test_a_changed_file_is_refused(tmp_path):
    bundle = _bundle(tmp_path / "b")
    (bundle / "llama-cpp-python" / f"llama_cpp_python-{VERSION}.tar.gz").write_bytes(b"tampered")
    proc = _setup("--bundle", str(bundle), tmp_path=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].endswith("files do not match its SHA256SUMS")


def test_a_bundle_of_another_llama_cpp_python_is_refused(tmp_path):
    bundle = _bundle(tmp_path / "b", version="0.0.1")
    _one_line(_setup("--bundle", str(bundle), tmp_path=tmp_path), "0.0.1", VERSION, "pack it again")


def test_the_environment_variable_names_a_bundle_too(tmp_path):
    env = os.environ | {"EDGERUN_BUNDLE": str(tmp_path), "EDGERUN_PYTHON": str(tmp_path / "no-python")}
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=60)
    _one_line(proc, "not a bundle")


def test_setup_refuses_an_unknown_argument(tmp_path):
    _one_line(_setup("--offline", tmp_path=tmp_path), "--offline", "--bundle DIR")


@pytest.mark.parametrize("args, words", [
    (["--profile", "tiny", "OUT"], ["full or lean", "tiny"]),
    (["--have", "/nonexistent/have.txt", "OUT"], ["/nonexistent/have.txt"]),
    (["--frobnicate", "OUT"], ["--frobnicate"]),
])
def test_pack_refuses_bad_arguments_before_downloading(tmp_path, args, words):
    args = [str(tmp_path / a) if a == "OUT" else a for a in args]
    proc = subprocess.run(["bash", str(PACK), *args], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"PIP_NO_INDEX": "1"})
    _one_line(proc, *words)
    assert not (tmp_path / "OUT").exists()
