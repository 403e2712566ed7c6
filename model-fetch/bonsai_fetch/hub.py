"""The Hub side of bonsai-fetch: pin a revision to a commit, list its files, download them resumably.

Everything goes through `huggingface_hub` (HF_ENDPOINT, tokens, redirects, Range requests, its own retry
within a transfer, progress bars): `HfApi.model_info` for the listing (sizes, LFS sha256, git oids) and
`get_hf_file_metadata` + `http_get` for each file.

Why not `hf_hub_download`: since huggingface_hub 2.x a transfer cut off for longer than its few in-call
retries is thrown away (its temporary file is unique per process and deleted on failure). A 4 GB shard over a
home connection must survive a router restart or a container stop, so the partial file here is ours:
`<store>/<owner>--<name>/<commit>/<path>.incomplete`, appended to with a `Range` request on the next attempt
or the next run. A file is moved to its final name only after its sha256 (LFS) or git blob hash matched the
listing, so everything under a commit directory is verified content.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from tqdm import tqdm

from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers, get_token

from bonsai_fetch import __version__
from bonsai_fetch.errors import ChecksumError, FetchError, NetworkError, NotFoundError, classify

COMMIT_LEN = 40
_CHUNK = 16 << 20


def progress_bar(enabled: bool) -> Callable[..., tqdm]:
    """A tqdm factory for every bar of a run: on a terminal a live bar; in a container log (no TTY) one line
    every 10 s rather than none (huggingface_hub's own bars switch off without a TTY)."""
    return functools.partial(tqdm, disable=not enabled, mininterval=0.5 if sys.stderr.isatty() else 10.0)


def is_commit(revision: str) -> bool:
    """A full 40-hex commit hash: a pinned revision that cannot move."""
    return len(revision) == COMMIT_LEN and all(c in "0123456789abcdef" for c in revision)


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo revision as the Hub lists it."""

    path: str
    size: int | None
    sha256: str | None = None  # LFS files: the sha256 of the content
    git_oid: str | None = None  # non-LFS files: the git blob id (sha1 of "blob <size>\0" + content)


@dataclass(frozen=True)
class Snapshot:
    """A repo revision pinned to its commit, with its file listing."""

    repo: str
    revision: str
    commit: str
    files: dict[str, RemoteFile]

    def label(self) -> str:
        return f"{self.repo}@{self.commit[:12]}"


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path, progress: Callable[[int], object] | None = None) -> str:
    """sha256 of a file, read in 16 MiB chunks; `progress(n)` is called with each chunk's size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


class Hub:
    """Pins revisions and downloads files into a resumable, verified store."""

    def __init__(self, *, endpoint: str, token: str | None, store: Path, retries: int = 8,
                 backoff_s: float = 2.0, log: Callable[[str], None] = print, progress: bool = True) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.token = token
        self.store = Path(store)
        self.retries = retries
        self.backoff_s = backoff_s
        self.log = log
        self.bar = progress_bar(progress)
        self.api = HfApi(endpoint=self.endpoint, token=token, library_name="bonsai-fetch",
                         library_version=__version__)
        # Only for messages: whether a 401 happened with or without a token.
        self.token_given = bool(token) or get_token() is not None

    # ---------------------------------------------------------------------------------------- listing

    def _classify(self, exc: BaseException, what: str) -> FetchError:
        return classify(exc, what=what, endpoint=self.endpoint, token_given=self.token_given)

    def _with_retries(self, what: str, action: Callable[[], object]) -> object:
        """Run `action`, retrying network failures with exponential backoff (the partial file stays)."""
        for attempt in range(self.retries + 1):
            try:
                return action()
            except (KeyboardInterrupt, FetchError):
                raise
            except Exception as e:  # noqa: BLE001 - classified right here
                err = self._classify(e, what)
                if not isinstance(err, NetworkError) or attempt == self.retries:
                    raise err from e
                wait = min(self.backoff_s * 2 ** attempt, 60.0)
                self.log(f"network trouble with {what} ({type(e).__name__}); retry {attempt + 1}/{self.retries} "
                         f"in {wait:.0f} s")
                time.sleep(wait)
        raise AssertionError("unreachable")

    def snapshot(self, repo: str, revision: str) -> Snapshot:
        """Pin `repo@revision` to a commit and list its files (sizes, hashes)."""
        what = f"repo {repo} (revision {revision})"
        info = self._with_retries(what, lambda: self.api.model_info(repo, revision=revision, files_metadata=True))
        if not info.sha:
            raise FetchError(f"{what}: the Hub did not say which commit this revision is (no 'sha' in its answer); "
                             "is HF_ENDPOINT a Hugging Face Hub?")
        files = {}
        for s in info.siblings or []:
            lfs = s.lfs
            files[s.rfilename] = RemoteFile(path=s.rfilename, size=lfs.size if lfs else s.size,
                                            sha256=lfs.sha256 if lfs else None,
                                            git_oid=None if lfs else s.blob_id)
        return Snapshot(repo=repo, revision=revision, commit=info.sha, files=files)

    def local_snapshot(self, folder: Path) -> Snapshot:
        """A local folder (e.g. BONSAI_MTP_REPO=/data/mtp-head, where bonsai-mtp-train wrote mtp.safetensors)
        as a snapshot: pinned to the sha256 of its files, which are copied into the store so the rest of the
        build treats them as a download already done."""
        folder = folder.expanduser().resolve()
        if not folder.is_dir():
            raise NotFoundError(f"{folder}: no such folder")
        files, digest = {}, hashlib.sha256()
        for f in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
            h = hashlib.sha256()
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            files[f.name] = RemoteFile(path=f.name, size=f.stat().st_size, sha256=h.hexdigest())
            digest.update(f"{f.name}\0{h.hexdigest()}\n".encode())
        snap = Snapshot(repo="local" + str(folder), revision="local", commit=digest.hexdigest()[:40], files=files)
        for name in files:
            local = self.local_path(snap, name)
            if not self.is_cached(snap, name):
                local.parent.mkdir(parents=True, exist_ok=True)
                tmp = local.with_name(local.name + ".incomplete")
                tmp.write_bytes((folder / name).read_bytes())
                os.replace(tmp, local)
        return snap

    # --------------------------------------------------------------------------------------- the store

    def snapshot_dir(self, snap: Snapshot) -> Path:
        return self.store / snap.repo.replace("/", "--") / snap.commit

    def local_path(self, snap: Snapshot, path: str) -> Path:
        return self.snapshot_dir(snap) / path

    def is_cached(self, snap: Snapshot, path: str) -> bool:
        local = self.local_path(snap, path)
        size = snap.files[path].size if path in snap.files else None
        return local.is_file() and (size is None or local.stat().st_size == size)

    def bytes_to_download(self, snap: Snapshot, paths: list[str]) -> int:
        """Bytes still to transfer for `paths` (partial files count what they already hold)."""
        total = 0
        for p in paths:
            if self.is_cached(snap, p):
                continue
            size = snap.files[p].size or 0
            part = self._partial(self.local_path(snap, p))
            total += max(size - (part.stat().st_size if part.exists() else 0), 0)
        return total

    @staticmethod
    def _partial(local: Path) -> Path:
        return local.with_name(local.name + ".incomplete")

    # ------------------------------------------------------------------------------------- downloading

    def require(self, snap: Snapshot, path: str) -> RemoteFile:
        if path not in snap.files:
            raise NotFoundError(f"{snap.repo}@{snap.revision}: file '{path}' is not in this revision "
                                f"(it has {len(snap.files)} files, e.g. {sorted(snap.files)[:5]}). Check the file "
                                "name and the revision.")
        return snap.files[path]

    def fetch(self, snap: Snapshot, path: str) -> Path:
        """The verified local copy of `path` at the pinned commit, downloading (or resuming) it if needed."""
        remote = self.require(snap, path)
        local = self.local_path(snap, path)
        if self.is_cached(snap, path):
            return local
        local.parent.mkdir(parents=True, exist_ok=True)
        part = self._partial(local)
        what = f"{snap.repo}/{path}"
        url = hf_hub_url(snap.repo, path, revision=snap.commit, endpoint=self.endpoint)

        def transfer() -> None:
            meta = get_hf_file_metadata(url, token=self.token, endpoint=self.endpoint,
                                        library_name="bonsai-fetch", library_version=__version__)
            size = remote.size if remote.size is not None else meta.size
            have = part.stat().st_size if part.exists() else 0
            if size is not None and have > size:  # a stale partial of something else: start over
                part.unlink()
                have = 0
            if have:
                self.log(f"resuming {what} at {have / 2**20:.1f} MiB of {(size or 0) / 2**20:.1f} MiB")
            # A redirect to another host (a CDN with a signed URL) must not receive the Hub token.
            same_host = urlparse(meta.location).netloc == urlparse(url).netloc
            headers = build_hf_headers(token=self.token if same_host else False, library_name="bonsai-fetch",
                                       library_version=__version__)
            with open(part, "r+b" if have else "wb") as f:
                f.seek(have)
                try:
                    # http_get itself resumes a few times within the call (Range) when the connection drops.
                    http_get(meta.location, f, resume_size=have, headers=headers, expected_size=size,
                             displayed_filename=path, tqdm_class=self.bar)
                except OSError as e:
                    # http_get's size check ("Consistency check failed"): the transfer ended early.
                    if "Consistency check failed" in str(e):
                        raise ConnectionError(str(e)) from e
                    raise

        self._with_retries(what, transfer)
        self._verify(remote, part, what)
        os.replace(part, local)
        return local

    def _verify(self, remote: RemoteFile, part: Path, what: str) -> None:
        if remote.sha256:
            actual, expected, kind = sha256_file(part), remote.sha256, "sha256"
        elif remote.git_oid:
            actual, expected, kind = git_blob_sha1(part), remote.git_oid, "git blob sha1"
        else:
            return  # the listing gave no hash (not the Hub's behaviour); the size was checked by http_get
        if actual != expected:
            part.unlink(missing_ok=True)  # never resume onto bad bytes
            raise ChecksumError(f"{what}: downloaded content does not match the Hub's {kind} (expected "
                                f"{expected[:16]}…, got {actual[:16]}…). The bad copy was deleted; run again to "
                                "download it afresh. If it happens again, a proxy or the disk is corrupting data.")
