"""Editing the keys file and reloading: new keys work, removed keys stop, nothing in flight is dropped,
and a broken file leaves the running gateway as it was."""

from __future__ import annotations

import os
import signal
import threading
import time

import requests

from gateway_harness import auth, keys_text, raw_request, read_head, stream_events

NEW_KEY = "sk-test-added-by-reload-4d5e6f7a8b9c"


def wait_for_status(url: str, headers: dict, status: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        got = requests.get(url, headers=headers).status_code
        if got == status or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_reload_picks_up_keys_and_keeps_streams(stub, tmp_path, make_gateway):
    keys = tmp_path / "keys"
    keys.write_text(keys_text(["ui", "agent"]))
    gw = make_gateway(stub.url, keys)
    models = gw.url + "/v1/models"
    new_auth = {"Authorization": f"Bearer {NEW_KEY}"}
    assert requests.get(models, headers=new_auth).status_code == 401

    body = b'{"model":"m","stream":true}'
    sock = raw_request(gw.port, "POST", "/v1/chat/completions",
                       {**auth("ui"), "Content-Length": str(len(body)), "X-Stub-Chunks": "12",
                        "X-Stub-Delay": "0.1"}, body)
    status, head, rest = read_head(sock)
    assert status == 200
    events: list = []
    done = threading.Event()

    def drain():
        events.extend(stream_events(sock, rest))
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        # Edit the way an operator would: rewrite the file, then reload. Drop "agent", add a new key.
        keys.write_text(keys_text(["ui"], extra=f"{NEW_KEY} benchmarks 10\n"))
        result = gw.reload()
        assert result.returncode == 0, result.stderr
        assert wait_for_status(models, new_auth, 200) == 200
        assert wait_for_status(models, auth("agent"), 401) == 401
        assert done.wait(5)
    finally:
        sock.close()
    # The stream that was running during the reload finished completely.
    assert [p for _, p in events][-1] == b"[DONE]"
    assert len(events) == 13
    assert not stub.find(head["x-request-id"]).aborted
    # The new key has the priority the file gives it.
    resp = requests.post(gw.url + "/v1/chat/completions", data=b'{"model":"m"}', headers=new_auth)
    assert stub.find(resp.headers["X-Request-Id"]).body == b'{"priority":10,"model":"m"}'
    assert gw.proc.poll() is None


def test_broken_keys_file_keeps_previous_keys(stub, tmp_path, make_gateway):
    keys = tmp_path / "keys"
    keys.write_text(keys_text(["agent"]))
    gw = make_gateway(stub.url, keys)
    models = gw.url + "/v1/models"
    assert requests.get(models, headers=auth("agent")).status_code == 200

    secret = "sk-test-typo-key-7e8f9a0b1c2d"
    keys.write_text(keys_text(["agent"], extra=f"{secret} agents five\n"))
    os.kill(gw.proc.pid, signal.SIGHUP)  # what `nginx -s reload` sends the master
    deadline = time.monotonic() + 5
    while "priority must be an integer" not in gw.stderr() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = gw.stderr()
    assert "line 4: priority must be an integer" in log
    assert secret not in log  # the error names the line, never the key
    # Still serving with the keys it had.
    assert gw.proc.poll() is None
    assert requests.get(models, headers=auth("agent")).status_code == 200
    assert requests.get(models, headers={"Authorization": f"Bearer {secret}"}).status_code == 401
