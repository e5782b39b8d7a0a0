"""setup.sh's source patches to llama.cpp (scripts/llama_patches.py): they apply once, to the pinned
text only; the patched CUDA graph key compiles and separates shapes (batch sizes, KV lengths) that share a
first node, and
the patched sweep of captured graphs compiles and keeps them past a pause, up to its count."""
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "llama_patches", Path(__file__).resolve().parents[1] / "scripts" / "llama_patches.py")
llama_patches = sys.modules["llama_patches"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama_patches)

KEY = next(p for p in llama_patches.PATCHES if p.name == "cuda-graph-key-per-shape")
UPSTREAM = "#include <cstdint>\n\n" + KEY.old + "\n\nstatic bool ggml_cuda_graph_update_required() { return true; }\n"


def _sdist(tmp_path: Path, text: str) -> Path:
    """An sdist whose CUDA file is `text` and whose other patched files hold their upstream texts."""
    root = tmp_path / "src" / "llama_cpp_python-0.3.36"
    others: dict[str, list[str]] = {}
    for patch in llama_patches.PATCHES:
        if patch.path != KEY.path:
            others.setdefault(patch.path, []).append(patch.old)
    for path, text_ in [(KEY.path, text), *((p, "\n// upstream\n".join(o)) for p, o in others.items())]:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text_)
    archive = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    return archive


def test_the_patch_applies_once_from_an_archive_or_a_folder(tmp_path):
    archive = _sdist(tmp_path, UPSTREAM)
    dest = tmp_path / "patched"
    assert llama_patches.prepare(str(archive), dest, "0.3.36") == [p.name for p in llama_patches.PATCHES]
    patched = (dest / KEY.path).read_text()
    assert KEY.old not in patched and KEY.new in patched
    assert patched.endswith("static bool ggml_cuda_graph_update_required() { return true; }\n")
    # a patched folder is copied, not patched twice; the archive's own tree is left alone
    again = tmp_path / "again"
    assert llama_patches.prepare(str(dest), again, "0.3.36") == []
    assert (again / KEY.path).read_text() == patched
    assert llama_patches.apply_all(again) == []


def test_a_changed_upstream_is_an_error_not_an_unpatched_build(tmp_path):
    archive = _sdist(tmp_path, UPSTREAM.replace("return cgraph->nodes[0];", "return cgraph->nodes[1];"))
    with pytest.raises(llama_patches.PatchError, match="occurs 0 times.*update scripts/llama_patches.py"):
        llama_patches.prepare(str(archive), tmp_path / "patched", "0.3.36")
    with pytest.raises(llama_patches.PatchError, match="is missing"):
        llama_patches.apply_all(tmp_path)


HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
struct ggml_tensor { int64_t ne[4]; };
struct ggml_cgraph { int n_nodes; ggml_tensor ** nodes; };
%s
int main(int argc, char ** argv) {
    // the node array stays put, as llama.cpp's graph meta buffer does; only the shape changes.
    // Each graph: nodes, batch tokens, output rows, KV length (the attention's node between)
    static ggml_tensor embd, logits, mid, attn;
    static ggml_tensor * nodes[2000];
    for (int i = 0; i < 2000; i++) nodes[i] = &mid;
    nodes[0] = &embd;
    nodes[7] = &attn;
    ggml_cgraph g = { 0, nodes };
    for (int i = 1; i + 3 < argc; i += 4) {
        g.n_nodes = atoi(argv[i]);
        embd.ne[0] = 896; embd.ne[1] = atoi(argv[i + 1]);
        mid.ne[0] = 896; mid.ne[1] = atoi(argv[i + 1]);
        attn.ne[0] = atoi(argv[i + 3]); attn.ne[1] = atoi(argv[i + 1]);
        logits.ne[0] = 151936; logits.ne[1] = atoi(argv[i + 2]);
        nodes[g.n_nodes - 1] = &logits;
        printf("%%llu %%d\n", (unsigned long long) (uintptr_t) ggml_cuda_graph_get_key(&g),
               ggml_cuda_graph_get_key(&g) == (const void *) nodes[0]);
        nodes[g.n_nodes - 1] = &mid;
    }
}
"""


@pytest.mark.slow
def test_the_patched_key_compiles_and_tells_batch_sizes_and_kv_lengths_apart(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "setup.sh builds llama.cpp, so a C++ compiler is on this machine"
    source = tmp_path / "key.cpp"
    source.write_text(HARNESS % KEY.new)
    binary = tmp_path / "key"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-O1", str(source), "-o", str(binary)], check=True)
    # one token, then an 83-token prompt (one logits row), then 4- and 5-token verify batches
    # (every row), then one token again; then the 5-token batch past 256 cells of KV, and back
    shapes = ["1413", "1", "1", "256", "1521", "83", "1", "256", "1521", "4", "4", "256", "1521", "5", "5", "256",
              "1413", "1", "1", "256", "1521", "5", "5", "512", "1521", "5", "5", "256"]

    def keys(env):
        out = subprocess.run([str(binary), *shapes], check=True, capture_output=True, text=True, env=env).stdout
        return [tuple(map(int, line.split())) for line in out.splitlines()]

    env = {k: v for k, v in os.environ.items() if k not in ("EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE",
                                                             "EDGERUN_CUDA_GRAPH_KEY_ENDS")}
    shaped = keys(env)
    assert len({k for k, _ in shaped[:4]}) == 4, "each batch size has its own captured graph"
    assert shaped[4] == shaped[0], "the single-token key is the same before and after the others"
    assert shaped[5] not in shaped[:5], "a batch over a longer KV has a graph of its own"
    assert shaped[6] == shaped[3], "... and the batch back at the first length finds its graph"
    assert not any(first for _, first in shaped)
    ends = keys(env | {"EDGERUN_CUDA_GRAPH_KEY_ENDS": "1"})
    assert len({k for k, _ in ends[:4]}) == 4 and ends[4] == ends[0]
    assert ends[5] == ends[3] == ends[6], "keyed by the ends only, the KV length shares the batch's graph"
    upstream = keys(env | {"EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE": "1"})
    assert all(first for _, first in upstream), "the switch restores the first-node key"


EVICT = next(p for p in llama_patches.PATCHES if p.name == "cuda-graph-evict-oldest-past-count")
EVICT_HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>
static int64_t now_us = 0;
static int64_t ggml_time_us() { return now_us; }
struct ggml_cuda_graph { int64_t last_used_time = 0; };
struct context {
    std::unordered_map<const void *, std::unique_ptr<ggml_cuda_graph>> cuda_graphs;
    int64_t last_graph_eviction_sweep = 0;
    ggml_cuda_graph * cuda_graph(const void * first_node_ptr) {
        const int64_t time_now = ggml_time_us();
%s
        auto it = cuda_graphs.find(first_node_ptr);
        if (it == cuda_graphs.end()) {
            it = cuda_graphs.emplace(first_node_ptr, std::make_unique<ggml_cuda_graph>()).first;
        }
        it->second->last_used_time = time_now;
        return it->second.get();
    }
};
int main(int argc, char ** argv) {
    // each argument "T:K": at second T, use the graph of key K; then print the keys held
    context ctx;
    for (int i = 1; i < argc; i++) {
        now_us = (int64_t) atoll(argv[i]) * 1000000;
        ctx.cuda_graph((const void *) (uintptr_t) atoll(strchr(argv[i], ':') + 1));
    }
    for (uintptr_t k = 1; k < 1000; k++) {
        if (ctx.cuda_graphs.count((const void *) k)) printf("%%d\n", (int) k);
    }
}
"""


@pytest.mark.slow
def test_the_patched_sweep_keeps_the_newest_graphs_past_a_pause(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "setup.sh builds llama.cpp, so a C++ compiler is on this machine"
    source = tmp_path / "evict.cpp"
    source.write_text(EVICT_HARNESS.replace("%s", EVICT.new).replace("%%", "%"))
    binary = tmp_path / "evict"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-O1", str(source), "-o", str(binary)], check=True)
    # a reply uses graphs 1-5 at second 6, a 30-second pause, then graph 9: its sweep finds
    # 1-5 unused for 30 s
    uses = ["6:1", "6:2", "6:3", "6:4", "6:5", "36:9"]

    def held(kept: str | None) -> list[int]:
        env = {k: v for k, v in os.environ.items() if k != "EDGERUN_CUDA_GRAPHS_KEPT"}
        if kept is not None:
            env["EDGERUN_CUDA_GRAPHS_KEPT"] = kept
        out = subprocess.run([str(binary), *uses], check=True, capture_output=True, text=True, env=env).stdout
        return [int(line) for line in out.split()]

    assert held(None) == [1, 2, 3, 4, 5, 9], "under the default count nothing is evicted"
    assert held("0") == [9], "0 restores upstream's sweep: every graph unused for 10 s goes"
    # over the count, the oldest go first, down to the count (the sweep runs before the graph
    # in hand is added): graph 1 was last used at second 0, the others at 6
    uses[0] = "0:1"
    assert held("4") == [2, 3, 4, 5, 9]
    # a graph used within the last 10 s stays, over the count too
    uses = ["0:1", "0:2", "8:3", "14:9"]
    assert held("1") == [3, 9]


def _cuda_library() -> Path | None:
    import llama_cpp

    found = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cuda.so*"))
    return found[0] if found else None


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_library() is None, reason="llama.cpp was built without CUDA on this machine")
def test_the_cuda_build_carries_the_patch():
    """setup.sh built the CUDA backend from the patched tree: the patches' switches are in the library."""
    library = _cuda_library().read_bytes()
    assert b"EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE" in library and b"EDGERUN_CUDA_GRAPHS_KEPT" in library
    assert b"EDGERUN_CUDA_GRAPH_KEY_ENDS" in library
