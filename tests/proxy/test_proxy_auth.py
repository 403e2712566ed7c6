"""Who may call: keys, 401s, the caller's key never reaching the model server; what passes unchanged."""

from __future__ import annotations

import json
import uuid

import pytest
import requests

from gateway_harness import KEYS, UPSTREAM_SECRET, auth, key, keys_text
from stub_upstream import MODELS


def assert_openai_error(resp: requests.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert isinstance(err["message"], str) and len(err["message"]) > 30  # says what to do
    return err


def marker() -> dict[str, str]:
    """A header that lets a test ask the stand-in whether a request reached it."""
    return {"X-Test-Case": uuid.uuid4().hex}


def reached_upstream(stub, headers: dict[str, str]) -> bool:
    value = headers["X-Test-Case"]
    return any(seen.header("X-Test-Case") == value for seen in list(stub.seen))


@pytest.mark.parametrize("headers, code", [
    ({}, "missing_api_key"),
    ({"Authorization": "Bearer"}, "missing_api_key"),
    ({"Authorization": f"Basic {KEYS['agent'][0]}"}, "missing_api_key"),
    ({"Authorization": "Bearer sk-not-a-key"}, "invalid_api_key"),
    ({"Authorization": f"Bearer {KEYS['agent'][0]}x"}, "invalid_api_key"),
])
def test_missing_or_unknown_key_is_401_and_never_reaches_upstream(gateway, stub, headers, code):
    mark = marker()
    body = b'{"model":"m","messages":[]}'
    resp = requests.post(gateway.url + "/v1/chat/completions", data=body, headers={**headers, **mark})
    err = assert_openai_error(resp, 401, code)
    assert err["type"] == "invalid_request_error"
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert not reached_upstream(stub, mark)


def test_models_get_also_needs_a_key(gateway):
    assert_openai_error(requests.get(gateway.url + "/v1/models"), 401, "missing_api_key")


@pytest.mark.parametrize("name", ["ui", "agent", "bench"])
def test_upstream_sees_its_own_key_never_the_callers(gateway, stub, name):
    resp = requests.post(gateway.url + "/v1/chat/completions", data=b'{"model":"m"}',
                         headers={**auth(name), "Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text
    seen = stub.find(resp.headers["X-Request-Id"])
    assert seen.header("Authorization") == f"Bearer {UPSTREAM_SECRET}"
    everything = "\n".join(f"{k}: {v}" for k, v in seen.headers) + seen.body.decode()
    assert key(name) not in everything


def test_without_upstream_key_no_authorization_is_sent(stub, keys_file, make_gateway):
    gw = make_gateway(stub.url, keys_file)
    resp = requests.get(gw.url + "/v1/models", headers=auth("agent"))
    assert resp.status_code == 200
    seen = stub.find(resp.headers["X-Request-Id"])
    assert seen.header("Authorization") is None
    assert all(key("agent") not in v for _, v in seen.headers)


def test_bearer_scheme_is_case_insensitive(gateway):
    resp = requests.get(gateway.url + "/v1/models", headers={"Authorization": f"bearer {key('ui')}"})
    assert resp.status_code == 200


def test_models_passes_unchanged(gateway, stub):
    resp = requests.get(gateway.url + "/v1/models", headers=auth("ui"))
    assert resp.status_code == 200
    assert resp.json() == MODELS
    seen = stub.find(resp.headers["X-Request-Id"])
    assert (seen.method, seen.path, seen.body) == ("GET", "/v1/models", b"")


def test_query_string_and_path_pass(gateway, stub):
    resp = requests.get(gateway.url + "/v1/models/stub-model?x=1&y=%20", headers=auth("ui"))
    seen = stub.find(resp.headers["X-Request-Id"])
    assert seen.path == "/v1/models/stub-model?x=1&y=%20"


@pytest.mark.parametrize("status", [400, 404, 500, 502, 503])
def test_upstream_own_errors_pass_through_untouched(gateway, status):
    # Only errors nginx makes itself become the gateway's JSON; vLLM's own answers are the client's.
    resp = requests.post(gateway.url + "/v1/chat/completions", data=b'{"model":"m"}',
                         headers={**auth("agent"), "X-Stub-Status": str(status)})
    assert resp.status_code == status
    assert resp.json() == {"stub": "own error"}


def test_healthz_needs_no_key(gateway):
    resp = requests.get(gateway.url + "/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


@pytest.mark.parametrize("path", ["/", "/metrics", "/health", "/tokenize", "/v2/chat/completions"])
def test_other_paths_are_404_json(gateway, stub, path):
    mark = marker()
    resp = requests.get(gateway.url + path, headers={**auth("agent"), **mark})
    assert_openai_error(resp, 404, "not_found")
    assert not reached_upstream(stub, mark)


def test_unreachable_upstream_is_502_json(tmp_path, make_gateway):
    from stub_upstream import closed_port

    keys = tmp_path / "keys"
    keys.write_text(keys_text())
    gw = make_gateway(f"http://127.0.0.1:{closed_port()}", keys)
    for method in ("GET", "POST"):
        resp = requests.request(method, gw.url + "/v1/chat/completions", data=b'{"a":1}',
                                headers=auth("agent"))
        err = assert_openai_error(resp, 502, "upstream_unavailable")
        assert err["type"] == "server_error"
        assert int(resp.headers["Retry-After"]) > 0
    # The in-flight slot of a request that ended in the 502 page is given back: a concurrent=1 key
    # would otherwise get 429 from its second request on.
    for _ in range(3):
        resp = requests.post(gw.url + "/v1/chat/completions", data=b'{"a":1}', headers=auth("one_errors"))
        assert resp.status_code == 502, resp.text


def test_error_bodies_are_valid_json_with_message_unescaped(gateway):
    resp = requests.get(gateway.url + "/metrics", headers=auth("agent"))
    raw = resp.content.decode()
    assert "/v1/" in json.loads(raw)["error"]["message"]
    assert "\\/" not in raw
