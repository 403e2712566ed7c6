"""Per-key limits: requests per minute and requests in flight, each answered 429 with Retry-After."""

from __future__ import annotations

import threading
import uuid

import requests

from gateway_harness import auth, raw_request, read_head, stream_events

CHAT = "/v1/chat/completions"


def stream_as(gateway, key: str, **stub: str):
    """A raw streaming chat request as `key`, its socket open; `stub` sets the stub upstream's X-Stub-* headers
    (Chunks="6", Delay="0.15", Tail="2", Framing="length")."""
    body = b'{"model":"m","stream":true}'
    headers = {**auth(key), "Content-Length": str(len(body)), **{f"X-Stub-{k}": v for k, v in stub.items()}}
    return raw_request(gateway.port, "POST", CHAT, headers, body)


def test_rpm_limit_is_429_with_retry_after(gateway, stub):
    # The "rpm" key allows 3 requests per minute; only this test uses it.
    for _ in range(3):
        assert requests.get(gateway.url + "/v1/models", headers=auth("rpm")).status_code == 200
    mark = uuid.uuid4().hex
    resp = requests.get(gateway.url + "/v1/models", headers={**auth("rpm"), "X-Test-Case": mark})
    assert resp.status_code == 429
    err = resp.json()["error"]
    assert (err["code"], err["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    assert not any(seen.header("X-Test-Case") == mark for seen in list(stub.seen))
    # Other keys are not affected.
    assert requests.get(gateway.url + "/v1/models", headers=auth("agent")).status_code == 200


def test_concurrent_limit_counts_streams_in_flight(gateway, stub):
    # The "one" key may have one request in flight.
    sock = stream_as(gateway, "one", Chunks="6", Delay="0.15")
    status, head, rest = read_head(sock)
    assert status == 200
    done = threading.Event()
    events: list = []

    def drain():
        events.extend(stream_events(sock, rest))
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        resp = requests.post(gateway.url + CHAT, data=b'{"model":"m"}', headers=auth("one"))
        assert resp.status_code == 429
        assert resp.json()["error"]["code"] == "too_many_concurrent_requests"
        assert int(resp.headers["Retry-After"]) >= 1
        # Another key is not held back by this one's stream.
        assert requests.post(gateway.url + CHAT, data=b'{"model":"m"}', headers=auth("agent")).status_code == 200
        assert done.wait(5)
    finally:
        sock.close()
    assert events[-1][1] == b"[DONE]"
    # The slot came back when the stream ended.
    assert requests.post(gateway.url + CHAT, data=b'{"model":"m"}', headers=auth("one")).status_code == 200


def test_stream_gives_its_slot_back_at_done(gateway, stub):
    # A client that stops reading at [DONE] and sends its next request at once must not be refused, even
    # while the model server has not yet ended the response (here it waits 2 s after [DONE]).
    sock = stream_as(gateway, "one", Chunks="2", Delay="0.05", Tail="2")
    try:
        status, head, rest = read_head(sock)
        assert status == 200
        events = list(stream_events(sock, rest))
        assert events[-1][1] == b"[DONE]"
        assert not stub.find(head["x-request-id"]).finished.is_set()  # the upstream is still in its tail
        resp = requests.post(gateway.url + CHAT, data=b'{"model":"m"}', headers=auth("one"))
        assert resp.status_code == 200, resp.text
    finally:
        sock.close()


def test_answer_with_length_holds_slot_until_its_last_byte(gateway, stub):
    # An answer with a Content-Length gives its slot back as its final byte passes the gateway (not
    # when nginx later flags the end, which comes after the client already has everything). Counted
    # bytes, so it must neither give the slot back at the first piece nor keep it after the last.
    sock = stream_as(gateway, "one", Chunks="6", Delay="0.2", Framing="length")
    try:
        status, head, rest = read_head(sock)
        assert status == 200 and "content-length" in head
        events = stream_events(sock, rest)
        next(events)
        next(events)  # two of six pieces arrived: the slot is still taken
        resp = requests.post(gateway.url + CHAT, data=b'{"model":"m"}', headers=auth("one"))
        assert resp.status_code == 429, resp.text
        rest_events = list(events)
    finally:
        sock.close()
    assert rest_events[-1][1] == b"[DONE]"
    # The connection to the gateway is still open (keep-alive), the answer is complete: slot back.
    assert requests.post(gateway.url + CHAT, data=b'{"model":"m"}', headers=auth("one")).status_code == 200


def test_slot_given_back_after_rejected_body_and_aborted_stream(gateway, stub):
    for _ in range(3):
        resp = requests.post(gateway.url + CHAT, data=b"[1]", headers=auth("one"))
        assert resp.status_code == 400, resp.text
    sock = stream_as(gateway, "one", Chunks="40", Delay="0.05")
    status, head, rest = read_head(sock)
    assert status == 200
    list(stream_events(sock, rest, stop_after=1))
    sock.close()
    assert stub.find(head["x-request-id"]).finished.wait(5)
    gateway.log_entry(head["x-request-id"])  # the log phase (which gives the slot back) has run
    assert requests.post(gateway.url + CHAT, data=b'{"model":"m"}', headers=auth("one")).status_code == 200


def test_back_to_back_requests_never_hit_their_own_limit(gateway):
    # A client with one request at a time must never be refused by a concurrent=1 limit, even when its
    # next request lands on the other nginx worker the moment the previous answer is complete.
    statuses = []
    with requests.Session() as session, requests.Session() as other:
        for i in range(150):
            s = session if i % 2 else other  # alternate connections, and so (often) workers
            statuses.append(s.post(gateway.url + CHAT, data=b'{"model":"m"}', headers=auth("one")).status_code)
    assert statuses == [200] * 150
