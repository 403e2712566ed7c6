"""Request bodies: the priority rule, byte-exact forwarding, invalid bodies, size limits.

Every valid body is compared byte for byte with what the upstream stand-in received, minus the one
change the gateway is allowed to make: the top-level "priority" value. Python's json (what vLLM uses)
also checks the meaning: 19-digit integers stay exact and `[]` stays a list, which is where a
decode-and-re-encode gateway on Debian's cjson fails.
"""

from __future__ import annotations

import json
import socket
import uuid

import pytest
import requests

from gateway_harness import MAX_BODY, auth, raw_request, read_head

CHAT = "/v1/chat/completions"


def send(gateway, stub, body: bytes, name: str = "agent", path: str = CHAT):
    resp = requests.post(gateway.url + path, data=body,
                         headers={**auth(name), "Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text
    return stub.find(resp.headers["X-Request-Id"])


def with_inserted_priority(body: bytes, priority: int) -> bytes:
    """What the gateway must forward for a body without a top-level priority: the member right after `{`."""
    i = body.index(b"{")
    rest = body[i + 1:]
    member = b'"priority":%d' % priority
    return body[:i + 1] + (member if rest.lstrip().startswith(b"}") else member + b",") + rest


VALID = {
    "stop_empty_array": b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":[]}',
    "seed_19_digits": b'{"model": "m", "seed": 1234567890123456789, "max_tokens": 5, "logit_bias": {}}',
    "big_numbers": b'{"a":-0,"b":1.5e-10,"c":12345678901234567890123,"d":0.1000000000000000055511151231257827,'
                   b'"e":-9223372036854775808,"f":1E2}',
    "unicode_raw": '{"messages":[{"role":"user","content":"日本語のテスト 🚀 é ÿ"}]}'.encode(),
    "unicode_escapes": b'{"content":"\\u65e5\\u672c \\ud83d\\ude80 \\"quoted\\" back\\\\slash \\/ \\n\\t\\b\\f\\r",'
                       b'"model":"m"}',
    "nested_priority": b'{"messages":[{"role":"user","content":"x","priority":-100}],"tools":[{"type":"function",'
                       b'"function":{"name":"f","parameters":{"type":"object","properties":{"priority":'
                       b'{"type":"integer"}},"required":["priority"]}}}],"metadata":{"priority":0}}',
    "whitespace_newlines": b'\n  {\n\t"model" : "m" ,\r\n  "messages" : [ ] ,"n" : 1\n}\n  ',
    "key_order": b'{"z":1,"a":2,"m":{"y":[],"b":{}},"stream":false,"A":[[],[{}]]}',
    "tool_schemas_empty": b'{"tools":[{"type":"function","function":{"name":"noop","description":"",'
                          b'"parameters":{"type":"object","properties":{},"required":[]}}}],"tool_choice":"auto",'
                          b'"stop":[],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":'
                          b'{"type":"object","properties":{"a":{"type":"array","items":{}}}}}}}',
    "priority_text_in_strings": b'{"content":"{\\"priority\\": 0, [}]\\" , \\"priority\\":0","n":null,'
                                b'"t":true,"f":false,"priority_hint":0,"x_priority":1}',
    "escaped_quote_in_key": b'{"a\\"priority":1,"priority\\"":2}',
    "empty_object": b"{}",
    "empty_object_spaced": b"{ \n }",
    "deep_nesting": b'{"d":' + b"[" * 60 + b'{"priority":0}' + b"]" * 60 + b"}",
    "long_escaped_content": b'{"messages":[{"role":"user","content":"'
                            + b'line \\"q\\" \\\\ \\u00e9\\n' * 6000 + b'"}],"model":"m"}',
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_bodies_pass_byte_exact_with_priority_inserted(gateway, stub, name):
    body = VALID[name]
    seen = send(gateway, stub, body)
    assert seen.body == with_inserted_priority(body, 5)
    assert int(seen.header("Content-Length")) == len(seen.body)
    assert json.loads(seen.body) == {**json.loads(body), "priority": 5}


def test_same_body_different_sources_get_their_priorities(gateway, stub):
    body = VALID["stop_empty_array"]
    for name, expected in (("ui", 0), ("agent", 5), ("bench", 10)):
        assert send(gateway, stub, body, name).body == with_inserted_priority(body, expected)


# (key name, body sent, body the upstream must receive). The rule: a caller may ask for a larger
# number (lower priority) than its key's, never a smaller one.
PRIORITY_CASES = {
    "larger_kept": ("agent", b'{"priority": 7, "model":"m"}', b'{"priority": 7, "model":"m"}'),
    "equal_kept": ("agent", b'{"model":"m","priority":5}', b'{"model":"m","priority":5}'),
    "smaller_replaced": ("agent", b'{"model":"m","priority":0}', b'{"model":"m","priority":5}'),
    "negative_replaced": ("agent", b'{"priority" :  -3 ,"x":[]}', b'{"priority" :  5 ,"x":[]}'),
    "null_replaced": ("agent", b'{"priority":null,"stop":[]}', b'{"priority":5,"stop":[]}'),
    "huge_kept": ("agent", b'{"priority":99999999999999999999}', b'{"priority":99999999999999999999}'),
    "last_member_ws": ("agent", b'{"a":1,"priority":1\n}', b'{"a":1,"priority":5\n}'),
    "escaped_key_replaced": ("agent", b'{"pri\\u006frity":0}', b'{"pri\\u006frity":5}'),
    "duplicates_last_smaller": ("agent", b'{"priority":9,"a":1,"priority":1}', b'{"priority":5,"a":1,"priority":5}'),
    "duplicates_last_larger": ("agent", b'{"priority":1,"priority":9}', b'{"priority":9,"priority":9}'),
    "nested_and_top": ("agent", b'{"messages":[{"priority":0}],"priority":2}',
                       b'{"messages":[{"priority":0}],"priority":5}'),
    "openwebui_may_lower_itself": ("ui", b'{"priority":3}', b'{"priority":3}'),
    "openwebui_floor": ("ui", b'{"priority":-1}', b'{"priority":0}'),
    "bench_cannot_jump": ("bench", b'{"priority":7,"seed":1234567890123456789}',
                          b'{"priority":10,"seed":1234567890123456789}'),
}


@pytest.mark.parametrize("case", list(PRIORITY_CASES))
def test_priority_rule(gateway, stub, case):
    name, body, expected = PRIORITY_CASES[case]
    assert send(gateway, stub, body, name).body == expected


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/responses"])
def test_priority_set_on_every_json_post(gateway, stub, path):
    body = b'{"model":"m","input":"x"}'
    assert send(gateway, stub, body, "bench", path).body == with_inserted_priority(body, 10)


INVALID = {
    "not_json": (b"not json", "invalid_json"),
    "json_array": (b'[{"model":"m"}]', "not_an_object"),
    "empty_array": (b"[]", "not_an_object"),
    "string": (b'"a string"', "not_an_object"),
    "number": (b"42", "not_an_object"),
    "null": (b"null", "not_an_object"),
    "true": (b"true", "not_an_object"),
    "truncated": (b'{"model":"m","messages":[{"role":"user","content":"hi', "invalid_json"),
    "truncated_after_key": (b'{"a":', "invalid_json"),
    "empty": (b"", "empty_body"),
    "whitespace_only": (b"  \n ", "empty_body"),
    "trailing_garbage": (b'{"a":1}x', "invalid_json"),
    "two_objects": (b'{"a":1}{"b":2}', "invalid_json"),
    "trailing_comma": (b'{"a":1,}', "invalid_json"),
    "single_quotes": (b"{'a':1}", "invalid_json"),
    "hex_number": (b'{"a":0x10}', "invalid_json"),
    "nan": (b'{"a":NaN}', "invalid_json"),
    "unquoted_key": (b"{a:1}", "invalid_json"),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_bodies_are_400_and_never_forwarded(gateway, stub, name):
    body, code = INVALID[name]
    mark = uuid.uuid4().hex
    resp = requests.post(gateway.url + CHAT, data=body, headers={**auth("agent"), "X-Test-Case": mark})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["type"]) == (code, "invalid_request_error")
    assert not any(seen.header("X-Test-Case") == mark for seen in list(stub.seen))


@pytest.mark.parametrize("value", [b'"5"', b"5.5", b"1e3", b"true", b"[]", b"{}", b'"high"'])
def test_non_integer_priority_is_400(gateway, value):
    resp = requests.post(gateway.url + CHAT, data=b'{"model":"m","priority":' + value + b"}",
                         headers=auth("agent"))
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_priority", "priority")


def test_chunked_request_body_is_forwarded_with_content_length(gateway, stub):
    body = VALID["tool_schemas_empty"]
    pieces = [body[i:i + 37] for i in range(0, len(body), 37)]
    resp = requests.post(gateway.url + CHAT, data=iter(pieces), headers=auth("agent"))
    assert resp.status_code == 200, resp.text
    seen = stub.find(resp.headers["X-Request-Id"])
    assert seen.body == with_inserted_priority(body, 5)
    assert seen.header("Transfer-Encoding") is None
    assert int(seen.header("Content-Length")) == len(seen.body)


def test_body_spooled_to_disk_passes_byte_exact(gateway, stub):
    # Over client_body_buffer_size (1 MiB), nginx keeps the body in a temp file; still under MAX_BODY.
    content = ("日本語 \\u00e9 \"q\" " * 50000).encode()
    body = b'{"model":"m","messages":[{"role":"user","content":"' + content.replace(b'"', b'\\"') + b'"}],"stop":[]}'
    assert 1024 * 1024 < len(body) < MAX_BODY
    seen = send(gateway, stub, body)
    assert seen.body == with_inserted_priority(body, 5)


def test_oversize_announced_body_is_413_before_reading(gateway):
    sock = raw_request(gateway.port, "POST", CHAT, {**auth("agent"), "Content-Length": str(MAX_BODY + 1)})
    try:
        status, headers, rest = read_head(sock)  # answered without a byte of the body sent
        assert status == 413
        assert headers["content-type"].startswith("application/json")
    finally:
        sock.close()


def test_oversize_chunked_body_is_413(gateway, stub):
    body = b'{"model":"m","pad":"' + b"x" * (MAX_BODY + 10) + b'"}'
    pieces = (body[i:i + 65536] for i in range(0, len(body), 65536))
    mark = uuid.uuid4().hex
    resp = requests.post(gateway.url + CHAT, data=pieces, headers={**auth("agent"), "X-Test-Case": mark})
    assert resp.status_code == 413
    err = resp.json()["error"]
    assert err["code"] == "request_too_large"
    assert str(MAX_BODY) in err["message"]
    assert not any(seen.header("X-Test-Case") == mark for seen in list(stub.seen))


def test_body_at_the_limit_passes(gateway, stub):
    head, tail = b'{"model":"m","pad":"', b'"}'
    body = head + b"x" * (MAX_BODY - len(head) - len(tail)) + tail
    assert len(body) == MAX_BODY
    seen = send(gateway, stub, body)
    assert seen.body == with_inserted_priority(body, 5)


def test_nginx_ceiling_413_is_json_too(gateway):
    # Beyond client_max_body_size (64m) nginx answers before any Lua runs; error_page makes it JSON.
    sock = raw_request(gateway.port, "POST", CHAT, {**auth("agent"), "Content-Length": str(100 * 1024 * 1024)})
    try:
        status, headers, rest = read_head(sock)
        assert status == 413
        body = rest
        sock.settimeout(2)
        try:
            while b"}}" not in body:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                body += chunk
        except socket.timeout:
            pass
        assert b'"code":"request_too_large"' in body
    finally:
        sock.close()


def test_get_requests_carry_no_priority_and_no_body(gateway, stub):
    resp = requests.get(gateway.url + "/v1/models", headers=auth("agent"))
    assert stub.find(resp.headers["X-Request-Id"]).body == b""

