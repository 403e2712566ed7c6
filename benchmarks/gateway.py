#!/usr/bin/env python3
"""Measure what the gateway adds: requests/s and p50/p99 latency through the gateway versus straight to
the same upstream stand-in, for small and 100 kB request bodies at 32 concurrent connections (wrk), and
the delay of the first SSE chunk (Python, one request at a time). Prints a table.

    python3 benchmarks/gateway.py [--duration 5] [--connections 32] [--workers 1] [--sse-samples 300]

Needs Debian's nginx + libnginx-mod-http-lua + lua-cjson (proxy/run-local.sh) and wrk. Everything runs on
this machine over loopback: the stand-in (asyncio, its own process), the gateway, and the load generator
share the CPUs, so on a small machine the numbers include that contention; run it on an idle machine.

Targets (issue 6): added p99 under 2 ms for small bodies at 32 connections; SSE first chunk within 5 ms of
direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROXY = Path(__file__).resolve().parents[1] / "proxy"
KEY = "sk-bench-0123456789abcdef0123456789"

SMALL_BODY = json.dumps({
    "model": "bonsai", "max_tokens": 64, "temperature": 0.7, "stop": [],
    "messages": [{"role": "system", "content": "You are terse."},
                 {"role": "user", "content": "Say hello in Japanese."}],
}).encode()


def big_body(size: int = 100 * 1024) -> bytes:
    head = b'{"model":"bonsai","max_tokens":64,"stop":[],"messages":[{"role":"user","content":"'
    tail = b'"}]}'
    line = "日本語のテキスト \\\"quoted\\\" and code {x: [1, 2]}\\n".encode()
    filler = (line * (size // len(line) + 1))[: size - len(head) - len(tail)]
    # Never cut a multi-byte character or an escape in half.
    while True:
        try:
            filler.decode()
            body = head + filler + tail
            json.loads(body)
            return body
        except (UnicodeDecodeError, ValueError):
            filler = filler[:-1]


# --- the upstream stand-in: a minimal HTTP/1.1 keep-alive server on asyncio, in its own process ---

RESPONSE_BODY = json.dumps({
    "id": "cmpl-bench", "object": "chat.completion", "model": "bonsai",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "こんにちは"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}).encode()
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(RESPONSE_BODY)) + RESPONSE_BODY
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def sse_chunk(data: bytes) -> bytes:
    event = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class StubProtocol(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            m = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
            length = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            if b'"stream":true' in body or b'"stream": true' in body:
                # First token at once, then a few more: the benchmark times the first.
                self.transport.write(SSE_HEAD + sse_chunk(b'{"choices":[{"delta":{"content":"a"}}]}'))
                loop = asyncio.get_running_loop()
                loop.call_later(0.002, self.transport.write,
                                sse_chunk(b'{"choices":[{"delta":{"content":"b"}}]}')
                                + sse_chunk(b"[DONE]") + b"0\r\n\r\n")
            else:
                self.transport.write(RESPONSE)


def serve_stub(port: int) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(StubProtocol, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()
    asyncio.run(main())


# --- helpers ---

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not listen on {port}")


def to_ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    value, unit = float(m.group(1)), m.group(2)
    return value * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def run_wrk(url: str, body_file: Path, duration: int, connections: int, workdir: Path,
            rate: int = 0) -> dict:
    """wrk, 1 thread. rate 0: as fast as it goes (closed loop, saturation); rate > 0: each connection
    waits a random 0..2*connections/rate s between its requests, so the offered load is about `rate`
    requests/s and the connections do not fire in lock-step bursts."""
    script = workdir / "post.lua"
    pacing = ""
    if rate:
        pacing = "function delay() return math.random(0, %d) end\n" % max(1, round(2000 * connections / rate))
    script.write_text(
        'local f = io.open("%s", "rb")\n'
        "wrk.body = f:read(\"*a\")\nf:close()\n"
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["Authorization"] = "Bearer %s"\n%s' % (body_file, KEY, pacing))
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script),
                          url], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    if non2xx or errors:
        sys.exit(f"wrk saw errors against {url}:\n{out}")
    return {"rps": rps, "p50": to_ms(pct["50"]), "p99": to_ms(pct["99"])}


def first_chunk_ms(port: int, path: str, samples: int) -> list[float]:
    body = b'{"model":"bonsai","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    times = []
    for _ in range(samples):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(request)
        buf = b""
        while b"data: " not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                sys.exit(f"stream closed before the first chunk: {buf!r}")
            buf += chunk
        times.append((time.perf_counter() - t0) * 1000)
        while b"[DONE]" not in buf:  # let the request end normally
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
        sock.close()
    return times


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk run (default 5)")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--workers", default="auto",
                    help="nginx worker processes (default auto = one per CPU, as in compose)")
    ap.add_argument("--sse-samples", type=int, default=300)
    ap.add_argument("--rate-small", type=int, default=2000,
                    help="offered requests/s of the paced small-body runs (default 2000)")
    ap.add_argument("--rate-100k", type=int, default=300,
                    help="offered requests/s of the paced 100 kB runs (default 300)")
    ap.add_argument("--stub", type=int, help=argparse.SUPPRESS)  # internal: run the stand-in on this port
    args = ap.parse_args()
    if args.stub:
        serve_stub(args.stub)
        return
    if not shutil.which("wrk"):
        sys.exit("needs wrk: apt-get install -y wrk")

    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    procs: list[subprocess.Popen] = []
    try:
        stub_port, gw_port = free_port(), free_port()
        procs.append(subprocess.Popen([sys.executable, __file__, "--stub", str(stub_port)]))
        wait_port(stub_port, procs[-1], "stand-in")
        (work / "keys").write_text(f"{KEY} benchmarks 10\n")
        env = {**os.environ, "UPSTREAM": f"http://127.0.0.1:{stub_port}", "PORT": str(gw_port),
               "METRICS_PORT": str(free_port()),
               "KEYS": str(work / "keys"), "RUN_DIR": str(work / "run"),
               "ACCESS_LOG": str(work / "access.log"), "PROXY_WORKERS": args.workers}
        gw_log = open(work / "gateway.log", "wb")
        procs.append(subprocess.Popen([str(PROXY / "run-local.sh")], env=env, stdout=gw_log, stderr=gw_log))
        wait_port(gw_port, procs[-1], "gateway")

        bodies = {"small": (SMALL_BODY, args.rate_small), "100kB": (big_body(), args.rate_100k)}
        rows = []
        for name, (body, rate) in bodies.items():
            body_file = work / f"{name}.json"
            body_file.write_bytes(body)
            for load in (0, rate):
                results = {}
                for target, port in (("direct", stub_port), ("gateway", gw_port)):
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    run_wrk(url, body_file, 1, args.connections, work, load)  # warm-up: connections, JIT
                    results[target] = run_wrk(url, body_file, args.duration, args.connections, work, load)
                rows.append((name, len(body), f"paced {load}/s" if load else "max", results))

        sse = {}
        for target, port in (("direct", stub_port), ("gateway", gw_port)):
            first_chunk_ms(port, "/v1/chat/completions", 20)  # warm-up
            sse[target] = first_chunk_ms(port, "/v1/chat/completions", args.sse_samples)

        print(f"\nGateway benchmark: {os.cpu_count()} CPUs, nginx workers {args.workers}, "
              f"{args.connections} connections, {args.duration} s per run (wrk -t1)\n")
        print("| body | bytes | load | direct req/s | gateway req/s | direct p50 / p99 ms "
              "| gateway p50 / p99 ms | added p50 / p99 ms |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for name, size, load, r in rows:
            d, g = r["direct"], r["gateway"]
            print(f"| {name} | {size} | {load} | {d['rps']:.0f} | {g['rps']:.0f} "
                  f"| {d['p50']:.2f} / {d['p99']:.2f} | {g['p50']:.2f} / {g['p99']:.2f} "
                  f"| {g['p50'] - d['p50']:+.2f} / {g['p99'] - d['p99']:+.2f} |")
        d, g = sse["direct"], sse["gateway"]
        print(f"\n| SSE first chunk ({args.sse_samples} requests, one at a time, new connection each) "
              f"| p50 ms | p99 ms |")
        print("| --- | ---: | ---: |")
        print(f"| direct | {statistics.median(d):.2f} | {pct(d, 99):.2f} |")
        print(f"| gateway | {statistics.median(g):.2f} | {pct(g, 99):.2f} |")
        print(f"| added | {statistics.median(g) - statistics.median(d):+.2f} | {pct(g, 99) - pct(d, 99):+.2f} |")
        added_sse = statistics.median(g) - statistics.median(d)
        print("\ntargets:")
        for name, size, load, r in rows[:2]:
            added_p99 = r["gateway"]["p99"] - r["direct"]["p99"]
            print(f"  added p99, small body, {load}: {added_p99:+.2f} ms (< 2 ms: "
                  f"{'met' if added_p99 < 2 else 'NOT met'})")
        print(f"  SSE first chunk, added p50: {added_sse:+.2f} ms (< 5 ms: {'met' if added_sse < 5 else 'NOT met'})")
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
