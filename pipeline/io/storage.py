"""Object storage: ``output:`` (and dataset paths) as ``s3://``, ``gs://``, ... URLs, via fsspec.

The convention of img2dataset and datatrove: a location is a local path or an fsspec URL
(``s3://bucket/run``, ``gs://bucket/run``, ``az://...``; ``s3fs`` / ``gcsfs`` / ``adlfs`` must be
installed for the scheme: ``pip install 'vlpipe[s3]'`` or ``'vlpipe[gcs]'``).

A remote location is mirrored through a local **cache** folder: ``s3://bucket/run/samples`` is
``<cache>/s3/bucket/run/samples``. The cache is ``storage.cache_dir`` of the manifest, else
``$VLPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/vlpipe/storage`` (``~/.cache/vlpipe/storage``).
Everything that needs local files works there unchanged (atomic local writes, ``flock``,
memory-mapped and ``pread`` shard readers):

* **Writers** (:class:`pipeline.io.artifacts.ArtifactWriter`, ``UnitWriter``) write each unit's
  files into the mirror with the existing atomic writes, then upload them (``put``: one atomic
  object PUT each, so an object is there whole or not at all), then the unit's errors file, and
  the completion marker ``_state/<unit>.json`` **last**: a unit is complete on the object store
  only once its marker is there. ``_manifest.json`` is uploaded last of all, at finalize, after
  ``errors/`` and the artifact's other files (e.g. a FAISS index). A crash at any point leaves at
  worst objects without a marker, which a rerun redoes.
* **Resume** reads the markers from the object store (the mirror's own ``_state`` is replaced by
  the store's at every writer start) and checks each marked unit's objects against the recorded
  sizes with one listing: a complete unit is skipped even on a fresh machine with an empty cache,
  and a unit whose marker is missing on the store is redone even when the cache still has it.
* **Readers** (:class:`pipeline.io.artifacts.Artifact`: downstream stages, ``pipeline inspect``,
  the loaders in ``pipeline.loaders`` and the trainers) download ``_manifest.json`` fresh, then
  fetch the files they ask for into the cache on first use, verified against the size and sha256
  recorded in the manifest (a file once verified is remembered in the mirror's ``_cache.json`` by
  size and mtime, so later opens cost a ``stat``), and read the local copies.
* **Locking**: ``flock`` cannot work on an object store. A writer takes the local ``flock`` of its
  mirror (two runs on one machine) and creates ``<artifact>/_lock`` on the store with a
  *conditional* put (``If-None-Match: *``: S3, GCS, MinIO and moto honour it), holding pid, host
  and start time; a second run, on any machine, gets :class:`ArtifactBusy` naming the holder.
  The object is deleted when the stage ends; a lock left by a killed run on this host (its pid is
  gone) is taken over, one left by another host must be deleted by hand (the message says how).
  Backends without conditional writes fall back to check-then-put, which does not exclude two
  writers starting in the same instant.

Configuration: credentials come from the usual places of each backend (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE`` / an instance role for S3,
``GOOGLE_APPLICATION_CREDENTIALS`` for GCS); the endpoint of an S3-compatible store (MinIO, Ceph,
moto) from ``storage.endpoint_url`` or ``AWS_ENDPOINT_URL`` / ``FSSPEC_S3_ENDPOINT_URL``; other
fsspec options from ``storage.options``. The storage section travels to the Ray workers in their
unit payloads (so options given there reach every node); credentials should come from each
node's own environment or role.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import socket
import uuid
from pathlib import Path

from pipeline.io.lock import pid_alive

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# Path("s3://b/k") is Path("s3:/b/k"): such a mangled URL (a URL passed through pathlib) is
# recognised for these schemes and given its second slash back.
_MANGLED = re.compile(r"^(s3|s3a|gs|gcs|az|abfs|abfss|adl|oss|hf|r2|memory):/(?!/)")
LOCAL_SCHEMES = {"file", "local"}

_CONFIG: dict = {"cache_dir": None, "endpoint_url": None, "options": {}}


def configure(cache_dir: str | None = None, endpoint_url: str | None = None, options: dict | None = None) -> None:
    """Set this process's storage options (the manifest's ``storage`` section; ``None``: defaults)."""
    _CONFIG.update(cache_dir=cache_dir, endpoint_url=endpoint_url, options=dict(options or {}))
    _FS.clear()


def configure_from(manifest) -> None:
    st = getattr(manifest, "storage", None)
    if st is None:
        configure()
    else:
        configure(st.cache_dir, st.endpoint_url, st.options)


def config() -> dict:
    """The current options, JSON-able: shipped to Ray workers in unit payloads."""
    return json.loads(json.dumps(_CONFIG))


def normalize(loc: str | os.PathLike) -> str:
    s = loc.url if isinstance(loc, UrlPath) else os.fspath(loc)
    return _MANGLED.sub(r"\1://", s)


def scheme(loc: str | os.PathLike) -> str | None:
    m = _SCHEME.match(normalize(loc))
    return m.group(1).lower() if m else None


def is_remote(loc: str | os.PathLike | None) -> bool:
    if loc is None:
        return False
    s = scheme(loc)
    return s is not None and s not in LOCAL_SCHEMES


def _strip(url: str) -> str:
    """``s3://bucket/key/`` -> ``bucket/key``."""
    return _SCHEME.sub("", normalize(url)).strip("/")


def join(loc: str | os.PathLike, *parts: str) -> str:
    """Join path parts onto a location (URL or local path); returns a string."""
    loc = normalize(loc)
    if is_remote(loc):
        out = loc.rstrip("/")
        for p in parts:
            p = str(p).strip("/")
            if p:
                out = f"{out}/{p}"
        return out
    return str(Path(loc).joinpath(*[str(p) for p in parts]))


def resolve_under(output: str | os.PathLike, p: str | os.PathLike) -> str | Path:
    """``p`` if it is a URL or an absolute path, else ``<output>/p`` (a str for URLs, else a Path)."""
    p = normalize(p)
    if is_remote(p) or Path(p).is_absolute():
        return p if is_remote(p) else Path(p)
    out = join(output, p)
    return out if is_remote(out) else Path(out)


def location(loc: str | os.PathLike) -> str | Path:
    """A URL stays a (normalised) string; a local path becomes a :class:`Path`."""
    s = normalize(loc)
    return s if is_remote(s) else Path(s)


def cache_root() -> Path:
    d = _CONFIG.get("cache_dir") or os.environ.get("VLPIPE_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "vlpipe", "storage")
    return Path(os.path.abspath(os.path.expanduser(d)))


def local_path(loc: str | os.PathLike) -> Path:
    """Where a location is read and written locally: itself, or its mirror in the cache."""
    s = normalize(loc)
    if not is_remote(s):
        return Path(_SCHEME.sub("", s) if scheme(s) in LOCAL_SCHEMES else s)
    return cache_root() / scheme(s) / _strip(s)


def url_of_local(path: str | os.PathLike) -> str | None:
    """The URL a cache path mirrors (``None`` when ``path`` is not under the cache)."""
    try:
        rel = Path(os.path.abspath(path)).relative_to(cache_root())
    except ValueError:
        return None
    parts = rel.parts
    if len(parts) < 2:
        return None
    return f"{parts[0]}://" + "/".join(parts[1:])


_FS: dict = {}


def filesystem(loc: str):
    """The fsspec filesystem of a URL's scheme with the configured options (cached per process)."""
    import fsspec

    proto = scheme(loc) or "file"
    if proto in _FS:
        return _FS[proto]
    opts = dict(_CONFIG.get("options") or {})
    endpoint = _CONFIG.get("endpoint_url")
    if proto in ("s3", "s3a"):
        endpoint = endpoint or os.environ.get("FSSPEC_S3_ENDPOINT_URL")
        if endpoint:
            opts.setdefault("endpoint_url", endpoint)
        # no listing cache: markers and objects written by other processes must be seen at once
        opts.setdefault("use_listings_cache", False)
    elif endpoint:
        opts.setdefault("endpoint_url", endpoint)
    try:
        fs = fsspec.filesystem(proto, **opts)
    except ImportError as e:
        pkg = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(proto, "?")
        raise RuntimeError(f"{loc}: the {proto}:// scheme needs the {pkg} package ({e})") from None
    _FS[proto] = fs
    return fs


class Remote:
    """A folder on an object store (an artifact, say) and its local mirror.

    Relative names (``_state/00001.json``) are the same on both sides."""

    def __init__(self, url: str):
        self.url = normalize(url).rstrip("/")
        self.fs = filesystem(self.url)
        self.root = _strip(self.url)
        self.local = local_path(self.url)
        self._sizes: dict[str, int] | None = None

    def _key(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    # ---- listing
    def listing(self, refresh: bool = False) -> dict[str, int]:
        """``{relative name: size}`` of every object under the folder (one listing, cached)."""
        if self._sizes is None or refresh:
            try:
                found = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                found = {}
            sizes = {}
            for key, info in found.items():
                if info.get("type", "file") != "file":
                    continue
                rel = key[len(self.root) + 1:] if key.startswith(self.root + "/") else None
                if rel:
                    sizes[rel] = int(info.get("size") or 0)
            self._sizes = sizes
        return self._sizes

    def size(self, rel: str) -> int | None:
        """Size of an object: from the cached listing, else asked for (objects written since)."""
        sizes = self.listing()
        if rel in sizes:
            return sizes[rel]
        try:
            info = self.fs.info(self._key(rel))
        except (FileNotFoundError, OSError):
            return None
        if info.get("type", "file") != "file":
            return None
        sizes[rel] = int(info.get("size") or 0)
        return sizes[rel]

    # ---- transfers
    def put(self, rel: str, local: Path | None = None) -> None:
        """Upload a local file (one object PUT: the object appears whole or not at all)."""
        src = Path(local) if local is not None else self.local / rel
        self.fs.put_file(str(src), self._key(rel))
        if self._sizes is not None:
            self._sizes[rel] = src.stat().st_size

    def get(self, rel: str, local: Path | None = None) -> Path:
        """Download an object into the mirror atomically (temporary name, then rename)."""
        from pipeline.io.atomic import atomic_path

        dst = Path(local) if local is not None else self.local / rel
        with atomic_path(dst) as tmp:
            self.fs.get_file(self._key(rel), str(tmp))
        return dst

    def cat(self, rel: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._key(rel))
        except FileNotFoundError:
            return None

    def rm(self, rel: str) -> None:
        try:
            self.fs.rm_file(self._key(rel))
        except FileNotFoundError:
            pass
        if self._sizes is not None:
            self._sizes.pop(rel, None)

    def create(self, rel: str, data: bytes) -> bool:
        """Write an object only if there is none (conditional put); False when one exists."""
        try:
            self.fs.pipe_file(self._key(rel), data, mode="create")
            return True
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError, ValueError):  # no conditional writes: check, then put
            if self.fs.exists(self._key(rel)):
                return False
            self.fs.pipe_file(self._key(rel), data)
            return True


# ---- the lock object -------------------------------------------------------------------------

_REMOTE_HELD: dict[str, str] = {}  # artifact URL -> token of the lock object this process wrote


def acquire_remote_lock(remote: Remote) -> str | None:
    """Create ``<artifact>/_lock`` on the store, or return the holder's description when another
    live run holds it (see the module docstring)."""
    if remote.url in _REMOTE_HELD:
        return None
    token = uuid.uuid4().hex
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now, "token": token}).encode()
    for _ in range(2):
        if remote.create("_lock", body):
            _REMOTE_HELD[remote.url] = token
            return None
        raw = remote.cat("_lock")
        try:
            holder = json.loads(raw or b"{}")
        except ValueError:
            holder = {}
        if raw is None:
            continue  # released in between: try again
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"]):
            remote.rm("_lock")  # left by a killed run on this host
            continue
        return (f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}; if that run is no "
                f"longer alive, delete {remote.url}/_lock")
    return "another process (the lock object keeps reappearing)"


def release_remote_lock(url: str | None = None) -> None:
    urls = list(_REMOTE_HELD) if url is None else [normalize(url).rstrip("/")]
    for u in urls:
        token = _REMOTE_HELD.pop(u, None)
        if token is None:
            continue
        try:
            r = Remote(u)
            raw = r.cat("_lock")
            if raw is not None and json.loads(raw).get("token") == token:
                r.rm("_lock")
        except Exception:  # the store is unreachable: the lock names this host and pid
            pass


# ---- reading URLs (dataset paths) ------------------------------------------------------------


def open_file(loc: str | os.PathLike, mode: str = "rb"):
    """``open`` for a local path or a URL (fsspec, seekable, read by ranges)."""
    loc = normalize(loc)
    if is_remote(loc):
        return filesystem(loc).open(_strip_keep(loc), mode)
    return open(loc, mode)


def _strip_keep(url: str) -> str:
    return _SCHEME.sub("", normalize(url))


def read_bytes(loc: str | os.PathLike) -> bytes:
    loc = normalize(loc)
    if is_remote(loc):
        return filesystem(loc).cat_file(_strip_keep(loc))
    return Path(loc).read_bytes()


def url_info(loc: str) -> dict:
    """``{"size", "etag"/"mtime"}`` of a remote object (raises FileNotFoundError)."""
    info = filesystem(loc).info(_strip_keep(loc))
    return {"size": info.get("size"), "version": info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")}


def glob_urls(pattern: str) -> list[str]:
    """Sorted URLs matching a glob (``s3://b/shards/*.tar``), or the files in a folder URL."""
    pattern = normalize(pattern)
    fs, proto = filesystem(pattern), scheme(pattern)
    path = _strip_keep(pattern)
    if any(ch in path for ch in "*?["):
        found = fs.glob(path)
    elif fs.isdir(path):
        found = [p for p in fs.find(path.rstrip("/"), maxdepth=1)]
    elif fs.exists(path):
        found = [path]
    else:
        found = []
    return sorted(f"{proto}://{p}" for p in found)


class UrlPath:
    """The little of :class:`pathlib.Path` the dataset readers use, for a URL (``root / name``,
    ``name``, ``read_bytes``, ``is_file``, ``glob``): a reader given ``s3://...`` works unchanged."""

    def __init__(self, url: str):
        self.url = normalize(url).rstrip("/")

    def __truediv__(self, other) -> "UrlPath":
        return UrlPath(join(self.url, str(other)))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"UrlPath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, UrlPath) and other.url == self.url

    def __lt__(self, other) -> bool:
        return str(self) < str(other)

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        return self.name.rsplit(".", 1)[0] if "." in self.name else self.name

    @property
    def suffix(self) -> str:
        return "." + self.name.rsplit(".", 1)[-1] if "." in self.name else ""

    @property
    def parent(self) -> "UrlPath":
        return UrlPath(self.url.rsplit("/", 1)[0])

    def resolve(self) -> "UrlPath":
        return self

    def expanduser(self) -> "UrlPath":
        return self

    def _fs(self):
        return filesystem(self.url), _strip_keep(self.url)

    def exists(self) -> bool:
        fs, p = self._fs()
        return fs.exists(p)

    def is_file(self) -> bool:
        fs, p = self._fs()
        return fs.isfile(p)

    def is_dir(self) -> bool:
        fs, p = self._fs()
        return fs.isdir(p)

    def read_bytes(self) -> bytes:
        return read_bytes(self.url)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open(self, mode: str = "rb"):
        return open_file(self.url, mode)

    def glob(self, pattern: str) -> list["UrlPath"]:
        return [UrlPath(u) for u in glob_urls(join(self.url, pattern))]

    def iterdir(self) -> list["UrlPath"]:
        return [UrlPath(u) for u in glob_urls(self.url)]


def as_path(loc: str | os.PathLike) -> "Path | UrlPath":
    """A :class:`Path` for a local location, a :class:`UrlPath` for a URL."""
    if isinstance(loc, UrlPath):
        return loc
    s = normalize(loc)
    return UrlPath(s) if is_remote(s) else Path(s)
