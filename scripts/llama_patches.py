"""Source patches setup.sh applies to llama.cpp before it builds the CUDA backend.

    python scripts/llama_patches.py prepare SDIST DEST --version V

SDIST is a llama-cpp-python sdist (a .tar.gz or an unpacked folder); empty means "download
llama-cpp-python==V with pip". DEST receives a patched copy; setup.sh builds from it. Each patch
names the exact upstream text it replaces: a pinned version that no longer has that text is an
error that says so, never a silent unpatched build.

The patch (upstreamable, one function):

**ggml-cuda's CUDA graph key.** ggml-cuda keeps one captured CUDA graph per key, and the key was
the graph's first node. llama.cpp builds the graph of every batch size on the same first node, so
a prompt's batch (or a speculative verify batch) overwrote the single-token graph's recorded
properties: the next decode step ran uncaptured and the one after captured the graph again, in
every reply. Keyed by shape as well, each batch size keeps its own captured graph: on an H200,
`edgerun run` replies got 1.0-1.7% faster on the 0.5B and 1.5B shapes and 0.6% on the 7B
(an A/B of `edgerun run` with the patch and without).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Patch:
    name: str
    path: str  # inside the llama-cpp-python sdist
    old: str
    new: str


_CUDA_GRAPH_KEY_OLD = """\
static const void * ggml_cuda_graph_get_key(ggml_cgraph * cgraph) {
    return cgraph->nodes[0];
}"""

_CUDA_GRAPH_KEY_NEW = """\
static const void * ggml_cuda_graph_get_key(ggml_cgraph * cgraph) {
    // edgerun patch (scripts/llama_patches.py): one captured graph per shape, not per first node.
    // llama.cpp builds every batch size on the same first node, so a prompt's batch reset the
    // single-token graph: the next decode step ran uncaptured, the one after captured again. Two
    // shapes that share a key cost a capture, never a wrong result: every node's properties are
    // compared before a captured graph is replayed. EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE (set to
    // anything) restores the upstream key, for side-by-side measurements.
    static const bool first_node_only = getenv("EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE") != nullptr;
    uint64_t key = (uint64_t) (uintptr_t) cgraph->nodes[0];
    if (!first_node_only) {
        const ggml_tensor * first = cgraph->nodes[0];
        const ggml_tensor * last  = cgraph->nodes[cgraph->n_nodes - 1];
        const int64_t shape[] = { cgraph->n_nodes, first->ne[0], first->ne[1], last->ne[0], last->ne[1] };
        for (const int64_t v : shape) {
            // multiply-xorshift mixing: a batch size must not cancel out against an address bit
            key = (key ^ (uint64_t) v) * UINT64_C(0x9e3779b97f4a7c15);
            key ^= key >> 29;
        }
    }
    return (const void *) (uintptr_t) key;
}"""

PATCHES = (
    Patch("cuda-graph-key-per-shape", "vendor/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu",
          _CUDA_GRAPH_KEY_OLD, _CUDA_GRAPH_KEY_NEW),
)


class PatchError(Exception):
    pass


def apply(text: str, patch: Patch) -> tuple[str, bool]:
    """The patched text and whether it changed; already patched text comes back unchanged."""
    if patch.new in text:
        return text, False
    count = text.count(patch.old)
    if count != 1:
        raise PatchError(f"{patch.path}: the text patch {patch.name!r} replaces occurs {count} times, not once;"
                         " the pinned llama-cpp-python changed: update scripts/llama_patches.py for it")
    return text.replace(patch.old, patch.new), True


def apply_all(tree: Path, patches=PATCHES) -> list[str]:
    """Apply every patch under an unpacked sdist; returns the names of those that changed a file."""
    changed = []
    for patch in patches:
        target = tree / patch.path
        if not target.is_file():
            raise PatchError(f"{target} is missing: is {tree} an unpacked llama-cpp-python sdist?")
        text, did = apply(target.read_text(encoding="utf-8"), patch)
        if did:
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
            changed.append(patch.name)
    return changed


def _unpack(archive: Path, dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")  # the data filter refuses links and paths out of tmp
        roots = [p for p in Path(tmp).iterdir() if p.is_dir()]
        if len(roots) != 1:
            raise PatchError(f"{archive} does not hold one top folder: is it a llama-cpp-python sdist?")
        roots[0].rename(dest)


def prepare(sdist: str, dest: Path, version: str) -> list[str]:
    """A fresh patched copy of the sdist at dest (replacing what was there)."""
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        shutil.rmtree(dest)
    if not sdist:
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "--no-build-isolation", f"llama-cpp-python=={version}", "-d", tmp], check=True)
            _unpack(next(Path(tmp).glob("*.tar.gz")), dest)
    elif Path(sdist).is_dir():
        shutil.copytree(sdist, dest, symlinks=True)
    else:
        _unpack(Path(sdist), dest)
    return apply_all(dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="copy (or download) the sdist to DEST and patch it")
    p.add_argument("sdist", help="sdist .tar.gz or folder; empty: download it with pip")
    p.add_argument("dest", type=Path)
    p.add_argument("--version", required=True)
    args = ap.parse_args()
    try:
        changed = prepare(args.sdist, args.dest, args.version)
    except (PatchError, OSError, tarfile.TarError, subprocess.CalledProcessError) as e:
        sys.exit(f"llama_patches: {e}")
    print(f"llama_patches: {args.dest}: applied {', '.join(changed) or 'nothing (already patched)'}", file=sys.stderr)


if __name__ == "__main__":
    main()
