"""An ASGI middleware for test servers: when each HTTP request reached the API server and when its answer began.

Served with `--middleware bonsai_vllm.testing.http_clock.HttpClock` and `BONSAI_HTTP_TRACE=/path`, the API
server appends one JSON line per event: {"time": time.time(), "event": "arrived" | "answered", "name": the
request's X-Test-Stream header, "path"}. "arrived" is when uvicorn hands the request's head to the app;
"answered" is its response start (for a stream, before the engine has seen the request). The scheduler tests
set it beside the scheduler's trace so that a request that reached the engine late can be placed: sent late by
the client, held by the API server before its answer began, or held after it.

Pure ASGI, no vLLM import: vLLM's `--middleware` takes the class and Starlette wraps the app in it.
"""

from __future__ import annotations

import json
import time

from bonsai_vllm import settings

TRACE_ENV = "BONSAI_HTTP_TRACE"
NAME_HEADER = "X-Test-Stream"


class HttpClock:
    def __init__(self, app):
        self.app = app
        path = settings.get(TRACE_ENV)
        self.out = open(path, "a", buffering=1) if path else None  # line-buffered: readable while serving

    async def __call__(self, scope, receive, send):
        if self.out is None or scope["type"] != "http":
            return await self.app(scope, receive, send)
        name = dict(scope["headers"]).get(NAME_HEADER.lower().encode(), b"").decode()
        self._write("arrived", name, scope["path"])

        async def timed_send(message):
            if message["type"] == "http.response.start":
                self._write("answered", name, scope["path"])
            await send(message)

        await self.app(scope, receive, timed_send)

    def _write(self, event: str, name: str, path: str) -> None:
        self.out.write(json.dumps({"time": time.time(), "event": event, "name": name, "path": path}) + "\n")

