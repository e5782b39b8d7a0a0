"""Source patches setup.sh applies to llama.cpp before it builds it (CPU and CUDA alike).

    python scripts/llama_patches.py prepare SDIST DEST --version V

SDIST is a llama-cpp-python sdist (a .tar.gz or an unpacked folder); empty means "download
llama-cpp-python==V with pip". DEST receives a patched copy; setup.sh builds from it. Each patch
names the exact upstream text it replaces: a pinned version that no longer has that text is an
error that says so, never a silent unpatched build.

The patches (each upstreamable and small):

**ggml-cuda's CUDA graph key.** ggml-cuda keeps one captured CUDA graph per key, and the key was
the graph's first node. llama.cpp builds the graph of every batch size on the same first node, so
a prompt's batch (or a speculative verify batch) overwrote the single-token graph's recorded
properties: the next decode step ran uncaptured and the one after captured the graph again, in
every reply. Keyed by shape as well, each batch size keeps its own captured graph: on an H200,
`edgerun run` replies got 1.0-1.7% faster on the 0.5B and 1.5B shapes and 0.6% on the 7B
(an A/B of `edgerun run` with the patch and without). The shape is every node's, the KV length the
attention spans among them, so a batch size keeps a graph per KV length (padded to 256 cells) and a
reply that runs where an earlier one ran (a new conversation, a regenerated reply) replays them.

**ggml-cuda's sweep of captured graphs.** Upstream evicts every captured graph unused for 10 s. With
a graph per shape, a user's pause between two replies then cost every verify batch size its graph,
and in the next reply each size ran uncaptured, then paid a capture. Patched, the sweep evicts the oldest such
graphs only while a context holds more than EDGERUN_CUDA_GRAPHS_KEPT (160; 0 restores upstream's).

**ggml-rpc: a lost server is an error, not an abort.** Upstream's RPC client aborts the whole
process when a send or receive to a server fails, and waits forever on a server that stops
answering. For `--rpc` that turns one dead helper machine into a killed chat app. Patched, the
client's connection gets a send/receive timeout (EDGERUN_RPC_TIMEOUT_S, seconds; unset: none), a
failure marks that server failed (its pending and later requests complete at once with zeroed
replies), graph computes on it return GGML_STATUS_FAILED (so llama_decode returns an error), and
`ggml_backend_rpc_edgerun_failed` tells the caller which servers failed; the engine checks it
after every decode and turns it into one error. The same function returns the bytes the client
sent and received, which `edgerun bench rpc` reports per decode step.

**ggml-rpc: a memory cap for the server.** Upstream's rpc-server reports the device's free memory
and allocates whatever a client asks. With EDGERUN_RPC_MEM_BYTES set (`edgerun rpc-server --mem`)
the server reports at most that much and refuses an allocation past it, so a client's plan and
the server's own limit agree.
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
    // compared before a captured graph is replayed. The shape is every node's: the attention's
    // nodes carry the KV length the batch attends over (llama.cpp pads it to 256 cells), so a batch
    // size keeps a graph per such length, and a reply that starts where an earlier one did finds
    // its graphs captured. EDGERUN_CUDA_GRAPH_KEY_ENDS (set to anything) keys by the first and last
    // nodes' shapes only; EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE restores the upstream key: both for
    // side-by-side measurements.
    static const bool first_node_only = getenv("EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE") != nullptr;
    static const bool ends_only = getenv("EDGERUN_CUDA_GRAPH_KEY_ENDS") != nullptr;
    uint64_t key = (uint64_t) (uintptr_t) cgraph->nodes[0];
    if (first_node_only) {
        return (const void *) (uintptr_t) key;
    }
    auto mix = [&key](int64_t v) {
        // multiply-xorshift mixing: a batch size must not cancel out against an address bit
        key = (key ^ (uint64_t) v) * UINT64_C(0x9e3779b97f4a7c15);
        key ^= key >> 29;
    };
    mix(cgraph->n_nodes);
    if (ends_only) {
        const ggml_tensor * first = cgraph->nodes[0];
        const ggml_tensor * last  = cgraph->nodes[cgraph->n_nodes - 1];
        const int64_t shape[] = { first->ne[0], first->ne[1], last->ne[0], last->ne[1] };
        for (const int64_t v : shape) {
            mix(v);
        }
    } else {
        for (int i = 0; i < cgraph->n_nodes; i++) {
            mix(cgraph->nodes[i]->ne[0]);
            mix(cgraph->nodes[i]->ne[1]);
        }
    }
    return (const void *) (uintptr_t) key;
}"""

_CUDA_COMMON = "vendor/llama.cpp/ggml/src/ggml-cuda/common.cuh"

_CUDA_GRAPH_EVICT_OLD = """\
        // sweep every 5s, evicting cuda graphs unused for >=10s
        if (time_now - last_graph_eviction_sweep >= 5'000'000) {
            last_graph_eviction_sweep = time_now;
            for (auto it = cuda_graphs.begin(); it != cuda_graphs.end(); ) {
                if (time_now - it->second->last_used_time >= 10'000'000) {
                    it = cuda_graphs.erase(it);
                } else {
                    ++it;
                }
            }
        }
"""

_CUDA_GRAPH_EVICT_NEW = """\
        // edgerun patch (scripts/llama_patches.py): sweep every 5s, evicting cuda graphs unused for
        // >=10s, the oldest first, and only while more than `kept` are held. Upstream evicted each
        // such graph, so a user's pause between two replies dropped the captured graph of every
        // verify batch size, and in the next reply each size ran uncaptured, then paid a capture
        // (a new graph runs directly, and is captured on its second call). The count bounds what a
        // context holds (a prompt's last chunk can bring a new shape). EDGERUN_CUDA_GRAPHS_KEPT
        // sets it (0: upstream's sweep, for side-by-side measurements).
        static const size_t kept = [] {
            const char * v = getenv("EDGERUN_CUDA_GRAPHS_KEPT");
            return v ? (size_t) strtoull(v, nullptr, 10) : (size_t) 160;
        }();
        if (time_now - last_graph_eviction_sweep >= 5'000'000) {
            last_graph_eviction_sweep = time_now;
            while (cuda_graphs.size() > kept) {
                auto oldest = cuda_graphs.end();
                for (auto it = cuda_graphs.begin(); it != cuda_graphs.end(); ++it) {
                    if (time_now - it->second->last_used_time >= 10'000'000 &&
                        (oldest == cuda_graphs.end() || it->second->last_used_time < oldest->second->last_used_time)) {
                        oldest = it;
                    }
                }
                if (oldest == cuda_graphs.end()) {
                    break;
                }
                cuda_graphs.erase(oldest);
            }
        }
"""

_RPC = "vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp"
_RPC_TRANSPORT = "vendor/llama.cpp/ggml/src/ggml-rpc/transport.cpp"

_RPC_STATE_OLD = """\
#define RPC_STATUS_ASSERT(x) if (!(x)) GGML_ABORT("Remote RPC server crashed or returned malformed response")
"""

_RPC_STATE_NEW = _RPC_STATE_OLD + """
// edgerun patch (scripts/llama_patches.py): a server whose connection fails is recorded here, not
// an abort; the client's traffic is counted for `edgerun bench rpc`.
static std::mutex g_edgerun_failed_mu;
static std::string g_edgerun_failed;  // endpoints that failed, comma-separated
static std::atomic<uint64_t> g_edgerun_sent{0};
static std::atomic<uint64_t> g_edgerun_received{0};

static void edgerun_mark_failed(const std::string & endpoint) {
    std::lock_guard<std::mutex> lock(g_edgerun_failed_mu);
    if (!g_edgerun_failed.empty()) {
        g_edgerun_failed += ",";
    }
    g_edgerun_failed += endpoint;
}

// Copies the failed endpoints (comma-separated, NUL-terminated) into buf and the client's byte
// counts into sent/received; returns the length of the full list (0: no server failed).
extern "C" {
GGML_BACKEND_API size_t ggml_backend_rpc_edgerun_failed(char * buf, size_t size, uint64_t * sent, uint64_t * received);
}
size_t ggml_backend_rpc_edgerun_failed(char * buf, size_t size, uint64_t * sent, uint64_t * received) {
    std::lock_guard<std::mutex> lock(g_edgerun_failed_mu);
    if (buf != nullptr && size > 0) {
        snprintf(buf, size, "%s", g_edgerun_failed.c_str());
    }
    if (sent != nullptr) {
        *sent = g_edgerun_sent.load();
    }
    if (received != nullptr) {
        *received = g_edgerun_received.load();
    }
    return g_edgerun_failed.size();
}

// The server's memory cap (EDGERUN_RPC_MEM_BYTES; 0: none) and what its buffers hold now.
static size_t edgerun_mem_limit() {
    static const size_t limit = [] {
        const char * v = getenv("EDGERUN_RPC_MEM_BYTES");
        return v ? (size_t) strtoull(v, nullptr, 10) : (size_t) 0;
    }();
    return limit;
}
static std::atomic<size_t> g_edgerun_allocated{0};
"""

_RPC_HELLO_OLD = """\
    bool status = send_rpc_cmd(sock, RPC_CMD_HELLO, &request, sizeof(request), &response, sizeof(response));
    RPC_STATUS_ASSERT(status);
"""

_RPC_HELLO_NEW = """\
    bool status = send_rpc_cmd(sock, RPC_CMD_HELLO, &request, sizeof(request), &response, sizeof(response));
    if (!status) {  // edgerun patch: the caller records the failure
        return false;
    }
"""

_RPC_MEMBERS_OLD = """\
    rpc_msg_queue    queue;
    socket_ptr       sock;
    std::atomic_bool running;
"""

_RPC_MEMBERS_NEW = """\
    rpc_msg_queue    queue;
    socket_ptr       sock;
    std::atomic_bool running;
    std::string      endpoint;       // edgerun patch: for the failure record
    std::atomic_bool failed{false};  // edgerun patch: set once, by start() or work()
public:
    bool has_failed() const { return failed; }
private:
"""

_RPC_START_OLD = """\
    sock = socket_t::connect(host.c_str(), port);
    if (sock == nullptr) {
        GGML_ABORT("Failed to connect to %s\\n", endpoint.c_str());
    }
    if (!negotiate_hello(sock)) {
        GGML_ABORT("RPC handshake failed for %s\\n", endpoint.c_str());
    }
"""

_RPC_START_NEW = """\
    // edgerun patch: an unreachable server is marked failed (every request completes at once with
    // a zeroed reply) instead of aborting the process
    this->endpoint = endpoint;
    sock = socket_t::connect(host.c_str(), port);
    if (sock == nullptr || !negotiate_hello(sock)) {
        GGML_LOG_ERROR("RPC: cannot reach %s\\n", endpoint.c_str());
        failed = true;
        edgerun_mark_failed(endpoint);
    }
"""

_RPC_WORK_OLD = """\
        if (msg_ptr->cmd != RPC_CMD_NONE) {
            if (msg_ptr->output) {
                bool status = send_rpc_cmd(sock, msg_ptr->cmd, msg_ptr->input.get(), msg_ptr->input_size, msg_ptr->output, msg_ptr->output_size);
                RPC_STATUS_ASSERT(status);
            } else {
                bool status = send_rpc_cmd(sock, msg_ptr->cmd, msg_ptr->input.get(), msg_ptr->input_size);
                RPC_STATUS_ASSERT(status);
            }
        }
"""

_RPC_WORK_NEW = """\
        if (msg_ptr->cmd != RPC_CMD_NONE) {
            // edgerun patch: a failed send or receive (peer gone, timeout) marks this server failed
            // once; its requests then complete with zeroed replies and the caller is told through
            // ggml_backend_rpc_edgerun_failed and failed graph computes
            bool status = !failed;
            if (status && msg_ptr->output) {
                status = send_rpc_cmd(sock, msg_ptr->cmd, msg_ptr->input.get(), msg_ptr->input_size, msg_ptr->output, msg_ptr->output_size);
            } else if (status) {
                status = send_rpc_cmd(sock, msg_ptr->cmd, msg_ptr->input.get(), msg_ptr->input_size);
            }
            if (status) {
                g_edgerun_sent += 9 + msg_ptr->input_size;
                g_edgerun_received += msg_ptr->output ? 8 + msg_ptr->output_size : 0;
            } else {
                if (!failed) {
                    GGML_LOG_ERROR("RPC: lost the connection to %s\\n", endpoint.c_str());
                    failed = true;
                    edgerun_mark_failed(endpoint);
                }
                if (msg_ptr->output) {
                    memset(msg_ptr->output, 0, msg_ptr->output_size);
                }
            }
        }
"""

_RPC_COMPUTE_OLD = """\
    GGML_ASSERT(cgraph->n_nodes > 0);
    bool reuse = cgraph->uid != 0 && rpc_dev_ctx->last_graph_uid == cgraph->uid;
"""

_RPC_COMPUTE_NEW = """\
    GGML_ASSERT(cgraph->n_nodes > 0);
    if (rpc_ctx->dispatcher->has_failed()) {  // edgerun patch: llama_decode reports it
        return GGML_STATUS_FAILED;
    }
    bool reuse = cgraph->uid != 0 && rpc_dev_ctx->last_graph_uid == cgraph->uid;
"""

_RPC_ALLOC_OLD = """\
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backends[dev_id]);
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(buft, request.size);
    response.remote_ptr = 0;
    response.remote_size = 0;
    if (buffer != nullptr) {
"""

_RPC_ALLOC_NEW = """\
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backends[dev_id]);
    response.remote_ptr = 0;
    response.remote_size = 0;
    const size_t limit = edgerun_mem_limit();  // edgerun patch: the server's --mem cap
    if (limit != 0 && g_edgerun_allocated + request.size > limit) {
        GGML_LOG_ERROR("[%s] refusing %" PRIu64 " bytes: the server's memory cap is %zu bytes, %zu in use\\n",
                       __func__, request.size, limit, g_edgerun_allocated.load());
        return true;
    }
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(buft, request.size);
    if (buffer != nullptr) {
        g_edgerun_allocated += ggml_backend_buffer_get_size(buffer);
"""

_RPC_FREE_OLD = """\
    ggml_backend_buffer_free(buffer);
    buffers.erase(buffer);
    return true;
}
"""

_RPC_FREE_NEW = """\
    g_edgerun_allocated -= ggml_backend_buffer_get_size(buffer);  // edgerun patch
    ggml_backend_buffer_free(buffer);
    buffers.erase(buffer);
    return true;
}
"""

_RPC_MEMORY_OLD = """\
    ggml_backend_dev_memory(dev, &free, &total);
    response.free_mem = free;
    response.total_mem = total;
"""

_RPC_MEMORY_NEW = """\
    ggml_backend_dev_memory(dev, &free, &total);
    const size_t limit = edgerun_mem_limit();  // edgerun patch: report the --mem cap
    if (limit != 0) {
        const size_t used = g_edgerun_allocated;
        total = std::min(total, limit);
        free = std::min(free, limit > used ? limit - used : 0);
    }
    response.free_mem = free;
    response.total_mem = total;
"""

_RPC_DTOR_OLD = """\
rpc_server::~rpc_server() {
    for (auto buffer : buffers) {
        ggml_backend_buffer_free(buffer);
"""

_RPC_DTOR_NEW = """\
rpc_server::~rpc_server() {
    for (auto buffer : buffers) {
        g_edgerun_allocated -= ggml_backend_buffer_get_size(buffer);  // edgerun patch
        ggml_backend_buffer_free(buffer);
"""

_RPC_TIMEOUT_OLD = """\
    struct sockaddr_in addr;
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    struct hostent * server = gethostbyname(host);
"""

_RPC_TIMEOUT_NEW = """\
#ifndef _WIN32
    // edgerun patch: a server that stops answering fails the request after this many seconds
    if (const char * t = getenv("EDGERUN_RPC_TIMEOUT_S")) {
        struct timeval tv = { (time_t) atoi(t), 0 };
        if (tv.tv_sec > 0) {
            setsockopt(sockfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
            setsockopt(sockfd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        }
    }
#endif
    struct sockaddr_in addr;
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    struct hostent * server = gethostbyname(host);
"""

PATCHES = (
    Patch("cuda-graph-key-per-shape", "vendor/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu",
          _CUDA_GRAPH_KEY_OLD, _CUDA_GRAPH_KEY_NEW),
    Patch("cuda-graph-evict-oldest-past-count", _CUDA_COMMON, _CUDA_GRAPH_EVICT_OLD, _CUDA_GRAPH_EVICT_NEW),
    Patch("rpc-failure-state", _RPC, _RPC_STATE_OLD, _RPC_STATE_NEW),
    Patch("rpc-hello-no-abort", _RPC, _RPC_HELLO_OLD, _RPC_HELLO_NEW),
    Patch("rpc-dispatcher-failed", _RPC, _RPC_MEMBERS_OLD, _RPC_MEMBERS_NEW),
    Patch("rpc-connect-no-abort", _RPC, _RPC_START_OLD, _RPC_START_NEW),
    Patch("rpc-request-no-abort", _RPC, _RPC_WORK_OLD, _RPC_WORK_NEW),
    Patch("rpc-compute-failed", _RPC, _RPC_COMPUTE_OLD, _RPC_COMPUTE_NEW),
    Patch("rpc-server-mem-alloc", _RPC, _RPC_ALLOC_OLD, _RPC_ALLOC_NEW),
    Patch("rpc-server-mem-free", _RPC, _RPC_FREE_OLD, _RPC_FREE_NEW),
    Patch("rpc-server-mem-report", _RPC, _RPC_MEMORY_OLD, _RPC_MEMORY_NEW),
    Patch("rpc-server-mem-teardown", _RPC, _RPC_DTOR_OLD, _RPC_DTOR_NEW),
    Patch("rpc-client-timeout", _RPC_TRANSPORT, _RPC_TIMEOUT_OLD, _RPC_TIMEOUT_NEW),
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
