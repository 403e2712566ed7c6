"""A local stand-in for the Hugging Face Hub: the part of its HTTP protocol that huggingface_hub 2.4 uses.

Point `HF_ENDPOINT` (or bonsai-fetch's `--endpoint`) at `HubServer.url`. It answers (docs/design.md §3):

- `GET /api/models/{repo}[/revision/{rev}]` — `sha` and `siblings` (with `?blobs=true`: size, git oid, LFS
  sha256), the call behind `HfApi.model_info`;
- `GET /api/models/{repo}/tree/{rev}[/{path}]` — `[{type, path, size, oid, lfs}]`;
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}` — `ETag`, `X-Repo-Commit`, `Content-Length`, and for LFS files
  `X-Linked-Etag` (the sha256) / `X-Linked-Size`; `Range: bytes=a-[b]` gives `206` with `Content-Range`;
- errors the Hub's way: `X-Error-Code` RepoNotFound (401 without a token, 404 with one), RevisionNotFound,
  EntryNotFound (404), and 401 "Invalid credentials in Authorization header" for a wrong token.

Faults, per (repo, path), for tests: `drop_once` (send N bytes of the first full GET, then cut the
connection), `die_after` (send N bytes, cut, then refuse everything until `revive()`), `corrupt` (flip a
byte of the content while advertising the true hash), `slow` (bytes per second). `log` records every
request as (method, path, Range header, status).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_THRESHOLD = 10_000  # the Hub stores binary/large files in LFS; small text files in git


@dataclass
class HubFile:
    path: str
    source: Path
    size: int
    sha256: str
    git_oid: str
    lfs: bool


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile]
    commit: str
    token: str | None = None  # private: only this token may read it
    branches: dict[str, str] = field(default_factory=dict)


def _hash_file(path: Path) -> tuple[str, str]:
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest(), hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int


class HubServer:
    """Serve repos made of local files. Use as a context manager; `url` is the endpoint."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.valid_tokens: set[str] = set()
        self.log: list[Request] = []
        self.drop_once: dict[tuple[str, str], int] = {}
        self.die_after: dict[tuple[str, str], int] = {}
        self.corrupt: set[tuple[str, str]] = set()
        self.slow: dict[tuple[str, str], int] = {}
        self.dead = False
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------------------------------- repos

    def add_repo(self, repo_id: str, root: Path, *, token: str | None = None,
                 include: list[str] | None = None) -> HubRepo:
        """Publish every file under `root` (or only `include`, paths relative to root) as `repo_id`@main."""
        root = Path(root)
        paths = include if include is not None else sorted(
            str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        files = {}
        for rel in paths:
            src = root / rel
            sha, oid = _hash_file(src)
            size = src.stat().st_size
            files[rel] = HubFile(rel, src, size, sha, oid, rel.endswith(".safetensors") or size > LFS_THRESHOLD)
        commit = hashlib.sha1(json.dumps(sorted((f.path, f.sha256) for f in files.values())).encode()
                              + repo_id.encode()).hexdigest()
        repo = HubRepo(repo_id, files, commit, token, {"main": commit})
        self.repos[repo_id] = repo
        if token:
            self.valid_tokens.add(token)
        return repo

    def reset_faults(self) -> None:
        self.drop_once.clear()
        self.die_after.clear()
        self.corrupt.clear()
        self.slow.clear()
        self.dead = False
        self.log.clear()

    def revive(self) -> None:
        self.dead = False

    def requests_for(self, repo_id: str, path: str, method: str = "GET") -> list[Request]:
        return [r for r in self.log if r.method == method and r.path.startswith(f"/{repo_id}/resolve/")
                and r.path.endswith("/" + path)]

    def resolve_gets(self) -> list[Request]:
        return [r for r in self.log if r.method == "GET" and "/resolve/" in r.path]

    # ------------------------------------------------------------------------------------------ server

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubServer:
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?P<rest>/.*)?)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_hub: HubServer

    def log_message(self, *args) -> None:  # quiet: the hub keeps its own log
        pass

    # ------------------------------------------------------------------------------------------ helpers

    def _record(self, status: int) -> None:
        hub = self.server_hub
        with hub._lock:
            hub.log.append(Request(self.command, urlparse(self.path).path, self.headers.get("Range"), status))

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers)

    def _repo(self, repo_id: str) -> HubRepo | None:
        """The repo if this request may see it; otherwise the Hub's error has been sent and None returned."""
        hub = self.server_hub
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
        if token is not None and token not in hub.valid_tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return None
        repo = hub.repos.get(repo_id)
        if repo is None or (repo.token is not None and token != repo.token):
            # The Hub hides private repos: 401 without a token, 404 with one, both "RepoNotFound".
            self._error(401 if token is None else 404, "RepoNotFound", "Repository not found")
            return None
        return repo

    def _commit(self, repo: HubRepo, rev: str) -> str | None:
        rev = unquote(rev)
        commit = repo.branches.get(rev) or (rev if rev == repo.commit else None)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    # -------------------------------------------------------------------------------------------- verbs

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_GET(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        hub = self.server_hub
        if hub.dead:  # the network is down: hang up without an answer
            self._record(0)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        url = urlparse(self.path)
        if m := _API.match(url.path):
            return self._api(m, parse_qs(url.query))
        if m := _RESOLVE.match(url.path):
            return self._resolve(m["repo"], m["rev"], unquote(m["path"]))
        self._error(404, None, "Not Found")

    def _api(self, m: re.Match, query: dict) -> None:
        repo = self._repo(m["repo"])
        if repo is None:
            return
        commit = self._commit(repo, m["rev"] or "main")
        if commit is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        if m["kind"] == "tree":
            prefix = (m["rest"] or "").strip("/")
            entries = [{"type": "file", "path": f.path, "size": f.size, "oid": f.git_oid,
                        **({"lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}} if f.lfs else {})}
                       for f in repo.files.values() if f.path.startswith(prefix)]
            return self._send(200, json.dumps(entries).encode())
        siblings = []
        for f in sorted(repo.files.values(), key=lambda f: f.path):
            s = {"rfilename": f.path}
            if blobs:
                s.update(size=f.size, blobId=f.git_oid)
                if f.lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(s)
        info = {"_id": commit[:24], "id": repo.repo_id, "modelId": repo.repo_id, "sha": commit,
                "private": repo.token is not None, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": [], "lastModified": "2026-11-29T00:00:00.000Z", "createdAt": "2026-11-01T00:00:00.000Z",
                "siblings": siblings}
        self._send(200, json.dumps(info).encode())

    def _resolve(self, repo_id: str, rev: str, path: str) -> None:
        hub = self.server_hub
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = self._commit(repo, rev)
        if commit is None:
            return
        f = repo.files.get(path)
        if f is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": commit})
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if f.lfs:
            headers.update({"ETag": f'"{f.git_oid}"', "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
        else:
            headers["ETag"] = f'"{f.git_oid}"'
        start, end = 0, f.size - 1
        status = 200
        if rng := self.headers.get("Range"):
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m[1]) >= f.size:
                return self._error(416, None, "Range Not Satisfiable", {"Content-Range": f"bytes */{f.size}"})
            start, end = int(m[1]), min(int(m[2]) if m[2] else f.size - 1, f.size - 1)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        length = end - start + 1
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD":
            return
        key = (repo_id, path)
        cut = None
        if key in hub.drop_once and status == 200:
            cut = hub.drop_once.pop(key)
        die = hub.die_after.pop(key, None) if status == 200 else None
        if die is not None:
            cut = die
        rate = hub.slow.get(key)
        sent = 0
        with open(f.source, "rb") as src:
            src.seek(start)
            while sent < length:
                n = min(1 << 20, length - sent, (cut - sent) if cut is not None else 1 << 20)
                if rate:
                    n = min(n, max(rate // 10, 1))
                chunk = bytearray(src.read(n))
                if key in hub.corrupt and start + sent <= f.size // 2 < start + sent + len(chunk):
                    chunk[f.size // 2 - start - sent] ^= 0xFF  # one flipped byte, the advertised hash unchanged
                try:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += len(chunk)
                if rate:
                    time.sleep(len(chunk) / rate)
                if cut is not None and sent >= cut:
                    # Hang up mid-body: the client sees an incomplete transfer, as on a dropped connection.
                    if die is not None:
                        hub.dead = True
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
