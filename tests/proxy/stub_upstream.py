"""A stand-in for the model server (vLLM's OpenAI API) that records exactly what the gateway sends it.

Every request is kept as a `Seen` record: method, path, the raw header list and the exact body bytes,
plus, for streams, how many chunks went out and whether the client went away. Records are found by the
`X-Request-Id` the gateway adds (the same id comes back to the caller), so a test looks at the one
request it made even when other requests run in parallel.

Behaviour, chosen per request by headers the gateway passes through untouched:
  X-Stub-Status: N           answer status N with the body {"stub": "own error"} (upstream's own errors)
  X-Stub-Chunks / X-Stub-Delay   for "stream": true bodies: how many SSE chunks, seconds between them
  X-Stub-Framing: close      send the stream without chunked encoding, ended by closing the connection
                             (vLLM uses chunked; nginx flushes chunked pieces even when buffering, so
                             this framing is what shows whether the gateway buffers)
  X-Stub-Framing: length     send the stream with a Content-Length, still piece by piece (as a non-streamed
                             answer's body can arrive), on a connection that stays open
POST bodies with "stream": true get Server-Sent Events, other POSTs a small chat.completion JSON,
GET /v1/models a model list.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODELS = {"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": "stub"}]}


@dataclass
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    chunks_sent: int = 0
    aborted: bool = False
    finished: threading.Event = field(default_factory=threading.Event)

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


class StubUpstream:
    """port: 0 for a free one; a stopped stub's port to bring "the same server" back (a PC rejoining)."""

    def __init__(self, port: int = 0) -> None:
        self.seen: list[Seen] = []
        self._open: set[socket.socket] = set()  # connections being served, for kill()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the gateway's upstream pool expects

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                # Headers and body go out in two writes; without this, Nagle's algorithm holds the
                # second until nginx's delayed ACK (40 ms per request).
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with stub._lock:
                    stub._open.add(self.connection)

            def finish(self):
                with stub._lock:
                    stub._open.discard(self.connection)
                try:
                    super().finish()
                except OSError:  # kill() closed it under us
                    pass

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _record(self, body: bytes) -> Seen:
                seen = Seen(self.command, self.path, list(self.headers.items()), body)
                with stub._changed:
                    stub.seen.append(seen)
                    stub._changed.notify_all()
                return seen

            def _send_json(self, status: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                seen = self._record(b"")
                try:
                    if self.headers.get("X-Stub-Status"):
                        self._send_json(int(self.headers["X-Stub-Status"]), {"stub": "own error"})
                    elif self.path == "/v1/models":
                        self._send_json(200, MODELS)
                    else:
                        self._send_json(404, {"stub": "no such path"})
                finally:
                    seen.finished.set()

            def do_POST(self):
                body = self._read_body()
                seen = self._record(body)
                try:
                    if self.headers.get("X-Stub-Status"):
                        self._send_json(int(self.headers["X-Stub-Status"]), {"stub": "own error"})
                        return
                    try:
                        doc = json.loads(body)
                    except ValueError:
                        self._send_json(400, {"stub": "body is not JSON"})
                        return
                    if isinstance(doc, dict) and doc.get("stream") is True:
                        self._stream(seen)
                    else:
                        self._send_json(200, {
                            "id": "cmpl-stub", "object": "chat.completion", "model": "stub-model",
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                         "finish_reason": "stop"}],
                            "received_bytes": len(body)})
                finally:
                    seen.finished.set()

            def _stream(self, seen: Seen) -> None:
                chunks = int(self.headers.get("X-Stub-Chunks", "5"))
                delay = float(self.headers.get("X-Stub-Delay", "0.1"))
                framing = self.headers.get("X-Stub-Framing", "chunked")
                chunked = framing == "chunked"
                start = time.time()
                # With a length every event is built up front; "t" is then when it is due to go out.
                planned = [b"data: " + json.dumps({"i": i, "t": start + i * delay}).encode() + b"\n\n"
                           for i in range(chunks)] + [b"data: [DONE]\n\n"]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                elif framing == "length":
                    self.send_header("Content-Length", str(sum(map(len, planned))))
                else:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.flush()

                def frame(event: bytes) -> bytes:
                    return b"%x\r\n%s\r\n" % (len(event), event) if chunked else event

                try:
                    for i in range(chunks):
                        event = (planned[i] if framing == "length" else
                                 b"data: " + json.dumps({"i": i, "t": time.time()}).encode() + b"\n\n")
                        self.wfile.write(frame(event))
                        self.wfile.flush()
                        seen.chunks_sent = i + 1
                        time.sleep(delay)
                    self.wfile.write(frame(b"data: [DONE]\n\n"))
                    self.wfile.flush()
                    # X-Stub-Tail: seconds between [DONE] and the stream's end (the terminating chunk, or
                    # the close), as when a busy server is slow to finish the response after its last event.
                    time.sleep(float(self.headers.get("X-Stub-Tail", "0")))
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                except OSError:  # the client went away (BrokenPipe, reset), or kill() closed the socket
                    seen.aborted = True
                    self.close_connection = True

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "StubUpstream":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kill(self) -> None:
        """As a server process that dies: stop listening (new connections are refused) and drop every open
        connection mid-answer, streams included."""
        self.stop()
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def find(self, request_id: str, timeout: float = 5.0) -> Seen:
        """The request the gateway forwarded with this X-Request-Id (waits for it to arrive)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for seen in self.seen:
                    if seen.header("X-Request-Id") == request_id:
                        return seen
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"upstream never saw request {request_id}")
                self._changed.wait(left)

    def count(self) -> int:
        with self._lock:
            return len(self.seen)


def closed_port() -> int:
    """A loopback port nobody listens on (for 'upstream unreachable')."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
