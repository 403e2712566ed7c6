"""What can go wrong, as exceptions with their own exit codes, and how Hub/OS errors map onto them.

Every failure the init container can hit ends in one of these, each with a message that says what went wrong
and what to do, and a distinct exit status so that scripts (and the compose stack) can tell them apart:

| status | exception         | meaning                                                                  |
| ------ | ----------------- | ------------------------------------------------------------------------ |
| 0      | —                 | the model directory is complete (built now, or already up to date)       |
| 1      | FetchError        | anything else (a bug: the message carries the traceback hint)            |
| 2      | UsageError        | bad option or environment value, or an output place it may not write     |
| 3      | NetworkError      | the Hub cannot be reached (no network, DNS, proxy, Hub down, cut off)    |
| 4      | AuthError         | 401/403: token missing, refused, or without access to a private/gated repo |
| 5      | NotFoundError     | 404: repository, revision or file does not exist                         |
| 6      | DiskSpaceError    | not enough free disk for the plan, or the disk filled up while writing   |
| 7      | ChecksumError     | a download (or, with --verify, an output file) does not match its sha256 |
| 8      | IncompatibleError | sources that do not fit together (MTP head shapes, vision width, format) |
| 130    | Interrupted       | SIGINT/SIGTERM; nothing half-written is left, downloads resume next run   |
"""

from __future__ import annotations

import errno

import httpx2
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)


class FetchError(Exception):
    """Base class: a failure with a user-facing message and an exit status."""

    exit_code = 1
    kind = "error"


class UsageError(FetchError):
    exit_code = 2
    kind = "bad option"


class NetworkError(FetchError):
    exit_code = 3
    kind = "no network"


class AuthError(FetchError):
    exit_code = 4
    kind = "not authorized"


class NotFoundError(FetchError):
    exit_code = 5
    kind = "not found"

    def __init__(self, message: str, missing: str = "file") -> None:
        super().__init__(message)
        self.missing = missing  # "repo", "revision" or "file": only a missing repo triggers the fallback source


class DiskSpaceError(FetchError):
    exit_code = 6
    kind = "disk full"


class ChecksumError(FetchError):
    exit_code = 7
    kind = "checksum mismatch"


class IncompatibleError(FetchError):
    exit_code = 8
    kind = "incompatible sources"


class Interrupted(FetchError):
    exit_code = 130
    kind = "interrupted"


_NETWORK_ERRORS = (httpx2.TransportError, OfflineModeIsEnabled, ConnectionError, TimeoutError)
_RESUME_HINT = ("Run bonsai-fetch again when the connection is back: finished files are kept and a file cut off "
                "midway resumes where it stopped.")


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and everything it was raised from (cause or context), outermost first."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def classify(exc: BaseException, *, what: str, endpoint: str, token_given: bool) -> FetchError:
    """Turn an error from huggingface_hub/httpx/OS while handling `what` (e.g. "repo x/y") into a FetchError."""
    if isinstance(exc, FetchError):
        return exc
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, PermissionError):
            return UsageError(f"permission denied writing {e.filename or what}: run as a user who may write there, "
                              "or set BONSAI_MODEL_DIR / --out and BONSAI_FETCH_CACHE to writable directories.")
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskSpaceError(f"the disk filled up while writing ({e.filename or what}): free some space, or "
                                  "point BONSAI_FETCH_CACHE / the output directory at a larger disk, and run again. "
                                  "Nothing half-written was kept.")
    token_hint = ("The token in HF_TOKEN was refused or has no access to it: check that it is a valid read token "
                  "(https://huggingface.co/settings/tokens) and, for a gated repo, that you accepted its terms "
                  "on the repo page." if token_given else
                  "No token was sent: if the repo is private or gated, set HF_TOKEN to a read token "
                  "(https://huggingface.co/settings/tokens) and accept the repo's terms on its page.")
    for e in chain:
        if isinstance(e, GatedRepoError):
            return AuthError(f"{what} is gated and this account has no access yet. {token_hint}")
        if isinstance(e, RevisionNotFoundError):
            return NotFoundError(f"{what}: the revision does not exist on {endpoint}. Check the *_REVISION "
                                 "setting (a branch, tag or full commit hash).", "revision")
        if isinstance(e, EntryNotFoundError):
            return NotFoundError(f"{what}: the file does not exist in that repository revision. Check the file "
                                 "name (e.g. BONSAI_MTP_FILE) and the revision.")
        if isinstance(e, RepositoryNotFoundError) and _status(e) == 404:
            return NotFoundError(f"{what}: the repository does not exist on {endpoint} (or is private and "
                                 "hidden from this token). Check the repo id (owner/name).", "repo")
        if isinstance(e, HfHubHTTPError):
            status = _status(e)
            if status in (401, 403):
                word = "unauthorized" if status == 401 else "forbidden"
                return AuthError(f"{what}: the Hub answered {status} ({word}). The repo is private or gated, or "
                                 f"does not exist. {token_hint}")
            if status == 404:
                return NotFoundError(f"{what}: not found on {endpoint} (404). Check the repo id, revision and "
                                     "file name.", "repo")
            if status is not None and (status >= 500 or status in (408, 429)):
                return NetworkError(f"{what}: the Hub answered {status} (busy or down). {_RESUME_HINT}")
    for e in chain:
        if isinstance(e, _NETWORK_ERRORS):
            return NetworkError(f"cannot reach {endpoint} while fetching {what} ({type(e).__name__}: {e}). "
                                "Check the network connection, and HF_ENDPOINT / proxy settings if you use them. "
                                + _RESUME_HINT)
    return FetchError(f"unexpected error while fetching {what}: {type(exc).__name__}: {exc}")
