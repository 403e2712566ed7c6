"""The gateway under test: proxy/run-local.sh (Debian's nginx + Lua module) on a free loopback port,
plus the test keys and small raw-HTTP helpers the tests share.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


from bonsai_vllm.testing.devserver import wait_until_healthy

REPO = Path(__file__).resolve().parents[2]
RUN_LOCAL = REPO / "proxy" / "run-local.sh"
# With BONSAI_GATEWAY_ROOT set to the filesystem of the built gateway image (tests/images), every gateway of
# these tests runs that image's run-local.sh, nginx and Lua module instead of the host's, this checkout's
# proxy/ mounted where compose mounts it, /tmp (the tests' run dirs and keys) and the checkout shared.
GATEWAY_ROOT = os.environ.get("BONSAI_GATEWAY_ROOT") or None


def _in_gateway(*argv: str) -> list[str]:
    """argv as the gateway image runs it (GATEWAY_ROOT), or on this machine."""
    if GATEWAY_ROOT is None:
        return list(argv)
    return [str(REPO / "tests" / "images" / "in-image"), GATEWAY_ROOT, "--bind", f"{REPO / 'proxy'}:/etc/bonsai-gateway",
            "--bind", "/tmp:/tmp", "--bind", f"{REPO}:{REPO}", "--", *argv]


def run_local_command() -> list[str]:
    return _in_gateway("/etc/bonsai-gateway/run-local.sh" if GATEWAY_ROOT else str(RUN_LOCAL))

# Test keys: name -> (key, source, priority, options). Priorities as the issue sets them per source.
KEYS = {
    "ui": ("sk-test-openwebui-7f3a9c2e51d84b06a1", "openwebui", 0, ""),
    "agent": ("sk-test-agents-0c4d1e9b7a6f5e3d2c1b", "agents", 5, ""),
    "bench": ("sk-test-bench-9e8d7c6b5a4f3e2d1c0b", "benchmarks", 10, ""),
    "rpm": ("sk-test-rpm-1a2b3c4d5e6f7a8b9c0d", "ratelimited", 5, "rpm=3"),
    "one": ("sk-test-one-5f4e3d2c1b0a9f8e7d6c", "single", 5, "concurrent=1"),
    "one_errors": ("sk-test-onerr-2b3c4d5e6f7a8b9c0d1e", "single", 5, "concurrent=1"),
}
UPSTREAM_SECRET = "upstream-secret-3e1f0d9c8b7a"
MAX_BODY = 4 * 1024 * 1024  # PROXY_MAX_BODY_BYTES of the test gateways


def key(name: str) -> str:
    return KEYS[name][0]


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key(name)}"}


def keys_text(names=None, extra: str = "") -> str:
    lines = ["# test keys", ""]
    for name in names or KEYS:
        k, source, prio, opts = KEYS[name]
        lines.append(f"{k}  {source}  {prio}  {opts}  # {name}")
    return "\n".join(lines) + "\n" + extra


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayFailed(RuntimeError):
    pass


class Gateway:
    """proxy/run-local.sh in its own run directory, logs kept for the assertions and for failures."""

    def __init__(self, run_dir: Path, upstream: str, keys_file: Path, env: dict[str, str] | None = None):
        """upstream: one model server's URL, or several, comma-separated (run-local.sh's UPSTREAMS)."""
        self.run_dir = run_dir
        self.upstream = upstream
        self.keys_file = keys_file
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The metrics listener (conf/metrics.conf): its own free port, so gateways can run side by side.
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.access_log = run_dir / "access.log"
        self.stderr_path = run_dir / "stderr.log"
        self.env = dict(os.environ)
        for name in ("UPSTREAM", "UPSTREAM_API_KEY", "UPSTREAM_FAIL_TIMEOUT", "PROXY_MAX_BODY_BYTES", "PROXY_RPM",
                     "PROXY_CONCURRENT"):
            self.env.pop(name, None)
        self.env.update({
            "UPSTREAMS": upstream, "PORT": str(self.port), "KEYS": str(keys_file),
            "RUN_DIR": str(run_dir), "ACCESS_LOG": str(self.access_log),
            "METRICS_PORT": str(self.metrics_port),
            "PROXY_WORKERS": "2", "PROXY_MAX_BODY_BYTES": str(MAX_BODY),
        })
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Gateway":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._stderr = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(run_local_command(), env=self.env, stdout=self._stderr,
                                     stderr=self._stderr, start_new_session=True)
        why = wait_until_healthy(self.proc, self.url + "/healthz", 10, interval=0.05)
        if why is None:
            return self
        self.stop()
        raise GatewayFailed(f"gateway {why}:\n{self.stderr()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nginx: fast shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if getattr(self, "_stderr", None):
            self._stderr.close()

    def reload(self) -> subprocess.CompletedProcess:
        """`nginx -s reload`, exactly as docs/proxy.md tells the operator."""
        return subprocess.run(_in_gateway("nginx", "-p", f"{self.run_dir}/", "-c", "nginx.conf", "-s", "reload"),
                              env=self.env, capture_output=True, text=True, timeout=10)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def log_entries(self) -> list[dict]:
        """The complete lines of the access log. A read can meet a line nginx is still writing (two workers,
        one file: a JSONDecodeError once under load, 2026-12-02); it counts as not written yet."""
        if not self.access_log.exists():
            return []
        text = self.access_log.read_text()
        lines = text.splitlines(keepends=True)
        return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]

    def next_log_entry(self, seen: int, timeout: float = 5.0) -> dict:
        """The first access-log line after the `seen` ones already there. nginx writes it in the log phase,
        after the client has the whole response, so a test reading at once can find the file a line short."""
        deadline = time.monotonic() + timeout
        while True:
            entries = self.log_entries()
            if len(entries) > seen:
                return entries[seen]
            if time.monotonic() > deadline:
                raise AssertionError(f"no access-log line after the first {seen}")
            time.sleep(0.05)

    def log_entry(self, request_id: str, timeout: float = 5.0) -> dict:
        """The access-log line of one request (nginx writes it when the request ends)."""
        deadline = time.monotonic() + timeout
        while True:
            for entry in self.log_entries():
                if entry["request_id"] == request_id:
                    return entry
            if time.monotonic() > deadline:
                raise AssertionError(f"no access-log line for {request_id}")
            time.sleep(0.05)




# --- raw HTTP, for what requests hides: exact timing of chunks, disconnects, header-only requests ---

def raw_request(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"",
                timeout: float = 10) -> socket.socket:
    """Send one HTTP/1.1 request on a fresh socket and return the socket, response unread."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


def read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read the status line and headers; returns status, headers (lower-case names), bytes after them."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before the response head: {data!r}")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, rest


def stream_events(sock: socket.socket, rest: bytes = b"", stop_after: int | None = None):
    """Yield (arrival time, SSE data payload) as bytes arrive on a chunked SSE response.

    Works on raw bytes (chunk-size lines are skipped) so the arrival time is when nginx sent the event.
    Stops after [DONE], at EOF, or after `stop_after` events.
    """
    buf = rest
    count = 0
    while True:
        while b"data: " in buf and b"\n\n" in buf[buf.index(b"data: "):]:
            start = buf.index(b"data: ")
            end = buf.index(b"\n\n", start)
            payload = buf[start + 6:end]
            buf = buf[end + 2:]
            count += 1
            yield time.time(), payload
            if payload == b"[DONE]" or (stop_after is not None and count >= stop_after):
                return
        chunk = sock.recv(65536)
        if not chunk:
            return
        buf += chunk
