"""Streaming (SSE): chunks leave the gateway as they arrive, and a client that leaves ends the upstream
request. Timing is read on raw sockets so no client library buffering hides what nginx does."""

from __future__ import annotations

import json

import openai
import pytest

from gateway_harness import auth, key, raw_request, read_head, stream_events

CHAT = "/v1/chat/completions"
STREAM_BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


def start_stream(gateway, name: str, chunks: int, delay: float, extra: dict | None = None):
    headers = {**auth(name), "Content-Type": "application/json", "Content-Length": str(len(STREAM_BODY)),
               "X-Stub-Chunks": str(chunks), "X-Stub-Delay": str(delay), **(extra or {})}
    sock = raw_request(gateway.port, "POST", CHAT, headers, STREAM_BODY)
    status, head, rest = read_head(sock)
    return sock, status, head, rest


@pytest.mark.parametrize("framing", ["chunked", "close"])
def test_chunks_arrive_one_by_one_not_buffered(gateway, stub, framing):
    # vLLM sends chunked responses, which nginx forwards piece by piece even with buffering on; a
    # close-delimited stream shows whether the gateway itself holds data back (proxy_buffering).
    sock, status, head, rest = start_stream(gateway, "agent", chunks=5, delay=0.25,
                                            extra={"X-Stub-Framing": framing})
    try:
        assert status == 200
        assert head["content-type"].startswith("text/event-stream")
        events = list(stream_events(sock, rest))
    finally:
        sock.close()
    assert events[-1][1] == b"[DONE]"
    data = [(t, json.loads(p)) for t, p in events[:-1]]
    assert [d["i"] for _, d in data] == [0, 1, 2, 3, 4]
    # Each event reaches the client soon after the stand-in wrote it, not when the response ends
    # (buffering would hold the first events back by up to a second).
    lags = [arrived - d["t"] for arrived, d in data]
    assert max(lags) < 0.2, lags
    assert data[-1][0] - data[0][0] > 0.8
    seen = stub.find(head["x-request-id"])
    assert seen.chunks_sent == 5 and not seen.aborted


def test_client_disconnect_ends_upstream_request(gateway, stub):
    sock, status, head, rest = start_stream(gateway, "agent", chunks=40, delay=0.05)
    assert status == 200
    got = list(stream_events(sock, rest, stop_after=2))
    assert len(got) == 2
    sock.close()
    seen = stub.find(head["x-request-id"])
    assert seen.finished.wait(5), "upstream stream still running 5 s after the client left"
    assert seen.aborted
    assert seen.chunks_sent < 40


def test_streaming_with_openai_sdk(gateway, stub):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key("ui"), max_retries=0)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers={"X-Stub-Chunks": "3", "X-Stub-Delay": "0.01"})
    # The stand-in's events are not full chat chunks; the SDK still yields one object per event.
    assert len([chunk for chunk in stream]) == 3


def test_non_streaming_openai_sdk_and_priority(gateway, stub):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key("bench"), max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], seed=1234567890123456789, stop=[])
    assert raw.parse().choices[0].message.content == "ok"
    seen = stub.find(raw.headers["x-request-id"])
    sent = json.loads(seen.body)
    assert sent["priority"] == 10 and sent["seed"] == 1234567890123456789 and sent["stop"] == []


def test_stream_marked_in_access_log(gateway, stub):
    sock, status, head, rest = start_stream(gateway, "agent", chunks=2, delay=0.01)
    try:
        list(stream_events(sock, rest))
    finally:
        sock.close()
    entry = gateway.log_entry(head["x-request-id"])
    assert entry["stream"] is True
    resp_id = _plain_request(gateway)
    assert gateway.log_entry(resp_id)["stream"] is False


def _plain_request(gateway) -> str:
    import requests

    resp = requests.post(gateway.url + CHAT, data=b'{"model":"m","stream":false}', headers=auth("agent"))
    assert resp.status_code == 200
    return resp.headers["X-Request-Id"]

