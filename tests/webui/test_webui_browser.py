"""Chat as the team will: a real browser on Open WebUI, Open WebUI on the real gateway, the gateway on vLLM-CPU.

The stack, as compose wires it (bonsai_vllm.testing.devwebui reads the webui service's environment from compose.yaml):
- vLLM-CPU with our plugin, the reasoning and tool parsers bonsai-serve always passes, and an `--api-key` only
  the gateway knows, serving a *scripted* tiny multimodal model (testing.tiny.write_scripted): whatever it is
  asked, it says `<think>SCRIPT_REASONING</think>SCRIPT_ANSWER`, token by token, through vLLM's real chat
  template, reasoning parser and streaming; its vision tower is a real (tiny) one;
- the gateway (proxy/run-local.sh) with Open WebUI's own key, source `openwebui`, priority 0;
- Open WebUI from PyPI at compose's pinned version (`make webui-env`), its first admin created as on a first
  visit;
- Debian's chromium through Selenium and Debian's chromedriver (no browser download).

A person's steps: sign in, find the model preselected, send a message and watch the answer stream in with the
reasoning folded away, attach an image. Screenshots go to test-artifacts/webui/ (the README's picture is
one of them).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "proxy"))

from gateway_harness import Gateway  # noqa: E402

from bonsai_vllm.testing.tiny import SCRIPT_ANSWER, SCRIPT_REASONING, TinyVision, write_scripted, write_tiny  # noqa: E402
from bonsai_vllm.testing.devserver import VllmServer, free_port  # noqa: E402
from bonsai_vllm.testing.devwebui import WEBUI_VENV, WebUI  # noqa: E402

pytestmark = pytest.mark.slow

ARTIFACTS = REPO / "test-artifacts" / "webui"
UI_KEY = "sk-test-openwebui-4d2c9e8f1b7a6350c2"  # the operator's key for the UI (make keys SOURCE=openwebui)
UPSTREAM_KEY = "vllm-key-only-the-gateway-knows-71c3"
MODEL = "bonsai-27b"
ADMIN = ("Admin", "admin@example.com", "a-long-test-password-1")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# bonsai-serve's parsers (serve.build_command); without --enable-auto-tool-choice every Open WebUI chat is an
# error box (it sends tool_choice "auto"). Its system prompt and tools are ~25 kB: a long context.
SERVE_ARGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice",
              "--max-model-len", "32768", "--api-key", UPSTREAM_KEY]


def _missing() -> list[str]:
    return [p for p in (CHROMIUM, CHROMEDRIVER, str(WEBUI_VENV / "bin" / "open-webui")) if not os.path.exists(p)]


if _missing():
    pytest.fail(f"the web UI tests need {', '.join(_missing())}: make system-deps (chromium, chromium-driver) "
                "and make webui-env (Open WebUI)", pytrace=False)


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("scripted")
    src = write_tiny(root / "src", seed=0, vision=TinyVision())
    write_scripted(src, root / "model")
    return root / "model"


@pytest.fixture(scope="module")
def vllm(scripted_model):
    with VllmServer(scripted_model, SERVE_ARGS, served_name=MODEL) as srv:
        yield srv


class Recorder:
    """Between the gateway and vLLM: passes every request and its (streamed) response through unchanged,
    keeping the request bodies, so a test can replay what the UI really sent.

    A streamed answer is relayed one server-sent event at a time, `pace` seconds apart, and each relayed
    stream's events are kept (`streams`): the tiny model on CPU writes its ~30 tokens in a few milliseconds
    each, where the served model at 90 tok/s takes ~11 ms a token, and Open WebUI may render several of
    them at once. Pacing lets the page render each stage (reasoning, a growing answer) the way a person
    sees it; the bytes are unchanged. At 20 events a second a loaded CI machine still rendered the whole
    answer in one go (4 renders for 31 events, 2026-12-01: Open WebUI's backend and the page fell behind
    and caught up in bursts), so events come 5 a second, a slow model's pace."""

    def __init__(self, upstream: str, pace: float = 0.2):
        import http.server
        import threading

        recorder = self
        self.bodies: list[tuple[str, bytes]] = []
        self.streams: list[list[bytes]] = []  # each streamed response's events, as relayed

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the response ends when the connection closes: no re-framing

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.bodies.append((self.path, body))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                with requests.request(self.command, upstream + self.path, data=body, headers=headers,
                                      stream=True, timeout=600) as r:
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    if r.headers.get("content-type", "").startswith("text/event-stream"):
                        relayed: list[bytes] = []
                        recorder.streams.append(relayed)
                        pending = b""
                        for chunk in r.iter_content(chunk_size=None):
                            pending += chunk
                            *events, pending = pending.split(b"\n\n")
                            for event in events:
                                relayed.append(event)
                                self.wfile.write(event + b"\n\n")
                                self.wfile.flush()
                                time.sleep(pace)
                        self.wfile.write(pending)
                    else:
                        for chunk in r.iter_content(chunk_size=None):
                            self.wfile.write(chunk)
                            self.wfile.flush()

            do_GET = do_POST = _relay

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def recorder(vllm):
    r = Recorder(vllm.url)
    yield r
    r.close()


@pytest.fixture(scope="module")
def gateway(recorder, tmp_path_factory):
    run = tmp_path_factory.mktemp("gateway")
    keys = run / "keys"
    keys.write_text(f"{UI_KEY}  openwebui  0\n")
    gw = Gateway(run, recorder.url, keys, {"UPSTREAM_API_KEY": UPSTREAM_KEY}).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def webui(gateway, tmp_path_factory):
    with WebUI(tmp_path_factory.mktemp("webui-data"), gateway.url, UI_KEY, port=free_port(), model=MODEL) as ui:
        ui.token = ui.create_admin(*ADMIN)
        yield ui


@pytest.fixture(scope="module")
def browser(webui):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800",
              "--disable-gpu", "--lang=en-US"):
        opts.add_argument(a)
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


# ------------------------------------------------------------------------------------------ helpers

def wait_for(fn, timeout: float = 60, every: float = 0.1, what: str = "condition"):
    """fn() until it is truthy; an element that the page re-rendered meanwhile counts as not yet."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = fn()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def shot(driver, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def button_with(driver, text: str):
    from selenium.webdriver.common.by import By

    return next((b for b in driver.find_elements(By.TAG_NAME, "button") if text in b.text), None)


def send(driver, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = wait_for(lambda: driver.find_elements(By.ID, "chat-input"), what="the message box")[0]
    box.click()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_response(driver):
    """(full text of the last answer's container, its body text without the reasoning toggle, toggle)."""
    from selenium.webdriver.common.by import By

    boxes = driver.find_elements(By.ID, "response-content-container")
    if not boxes:
        return "", "", None
    box = boxes[-1]
    body = " ".join(e.text for e in box.find_elements(By.CSS_SELECTOR, ".markdown-prose"))
    toggles = box.find_elements(By.CSS_SELECTOR, "button[aria-expanded]")
    return box.text, body, toggles[0] if toggles else None


def wait_for_answer(driver, timeout: float = 180) -> None:
    """Until the last answer's body holds the whole scripted answer."""
    wait_for(lambda: SCRIPT_ANSWER in last_response(driver)[1], timeout=timeout, every=0.2,
             what="the complete scripted answer")


# Every state the page renders, recorded in the page: a MutationObserver reads the last answer's text (and its
# body without the reasoning toggle) after each batch of DOM changes. Sampling from Selenium every 50 ms missed
# short states on a loaded CI machine (the reasoning, shown as "Thinking..." for under one sample, once).
_RECORD_RENDERS = """
if (window.__bonsaiObserver) window.__bonsaiObserver.disconnect();
window.__bonsaiRenders = [];
const read = () => {
  const boxes = document.querySelectorAll('#response-content-container');
  if (!boxes.length) return;
  const box = boxes[boxes.length - 1];
  const body = Array.from(box.querySelectorAll('.markdown-prose')).map(e => e.innerText).join(' ');
  const text = box.innerText;
  const renders = window.__bonsaiRenders, last = renders[renders.length - 1];
  if (!last || last[0] !== text || last[1] !== body) renders.push([text, body]);
};
window.__bonsaiObserver = new MutationObserver(read);
window.__bonsaiObserver.observe(document.body, {subtree: true, childList: true, characterData: true});
"""


def record_renders(driver) -> None:
    """From now on, keep every distinct (text, body) the last answer is rendered with (see rendered())."""
    driver.execute_script(_RECORD_RENDERS)


def rendered(driver) -> list[tuple[str, str]]:
    """The distinct (text, body) states of the last answer since record_renders(), in order."""
    return [tuple(r) for r in driver.execute_script("return window.__bonsaiRenders || [];")]


def _delta_kinds(events: list[bytes]) -> list[str]:
    """Per relayed event of a chat stream: 'r' reasoning only, 'c' content only, 'rc' both, '' neither."""
    kinds = []
    for event in events:
        data = event.decode(errors="replace").removeprefix("data: ").strip()
        try:
            delta = json.loads(data)["choices"][0]["delta"]
        except (ValueError, KeyError, IndexError, TypeError):
            kinds.append("")
            continue
        kinds.append(("r" if delta.get("reasoning") or delta.get("reasoning_content") else "")
                     + ("c" if delta.get("content") else ""))
    return kinds


def chat_entries(gateway: Gateway, since: int = 0) -> list[dict]:
    return [e for e in gateway.log_entries()[since:] if e["path"] == "/v1/chat/completions"]


def streamed_chat(gateway: Gateway, since: int) -> dict:
    """The gateway's log line of the UI's streamed chat request after entry `since`. nginx writes it when the
    stream ends, which is after the page shows the whole answer: the stream's last events (the finish
    reason, [DONE]) come after the last token, one relay pace apart."""
    return wait_for(lambda: next((e for e in chat_entries(gateway, since) if e["stream"]), None), timeout=30,
                    what="the streamed chat request in the gateway's access log")


# ------------------------------------------------------------------------------------------ the tests, in order

def test_sign_in_and_the_served_model_is_preselected(browser, webui):
    from selenium.webdriver.common.by import By

    browser.get(webui.url)
    wait_for(lambda: browser.find_elements(By.ID, "email"), what="the sign-in form")
    shot(browser, "01-sign-in")
    browser.find_element(By.ID, "email").send_keys(ADMIN[1])
    browser.find_element(By.ID, "password").send_keys(ADMIN[2])
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_for(lambda: browser.find_elements(By.ID, "chat-input"), what="the chat page")
    # The first sign-in after an install or upgrade shows the release notes over the page; a person closes them.
    try:
        wait_for(lambda: button_with(browser, "Let's Go"), timeout=10, what="the release notes").click()
    except AssertionError:
        pass  # none this time
    wait_for(lambda: not button_with(browser, "Let's Go"), timeout=10, what="the release notes to close")
    selector = wait_for(lambda: [e for e in browser.find_elements(By.XPATH, f"//*[text()='{MODEL}']")],
                        what=f"the model {MODEL} preselected")
    assert selector
    shot(browser, "02-new-chat")


def test_answer_streams_in_with_the_reasoning_folded(browser, gateway, recorder):
    seen, streams_before = len(gateway.log_entries()), len(recorder.streams)
    record_renders(browser)
    send(browser, "What comes after Monday?")
    wait_for_answer(browser)
    shot(browser, "03-answer")
    renders = rendered(browser)
    final_body = renders[-1][1]
    # How vLLM's stream reached the UI, for the messages below: vLLM merges deltas its API server has not yet
    # sent, so on a busy machine one event can carry several tokens.
    kinds = [_delta_kinds(events) for events in recorder.streams[streams_before:]]
    kinds = [k for k in kinds if any("r" in kind for kind in k)]
    arrived = f"chat stream events (r reasoning, c content): {kinds}"
    # Streamed: the page showed the answer growing (a part of it before all of it), and the reasoning as
    # "Thinking..." before it was folded.
    partial = [b for _, b in renders if b and b != final_body and SCRIPT_ANSWER.startswith(b.strip()[:10])]
    assert partial, f"the answer appeared whole: no partial text among {len(renders)} renders; {arrived}"
    assert any("Thinking" in t for t, _ in renders), \
        f"no reasoning shown while it was generated; renders: {[t[:60] for t, _ in renders]}; {arrived}"
    # The reasoning is a collapsed section, not body text; opening it shows it.
    _, body, toggle = last_response(browser)
    assert SCRIPT_ANSWER in body and SCRIPT_REASONING not in body
    assert toggle is not None and toggle.get_attribute("aria-expanded") == "false" and "Thought for" in toggle.text
    toggle.click()
    wait_for(lambda: SCRIPT_REASONING in last_response(browser)[0], what="the reasoning, opened")
    shot(browser, "04-reasoning-open")
    # The gateway streamed it: first byte long before the end (the UI's stream, not one buffered reply).
    entry = streamed_chat(gateway, seen)
    assert entry["status"] == 200 and float(entry["upstream_first_byte_s"]) < entry["latency_s"]


def _png(size: int = 128) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (size, size))
    for x in range(size):
        for y in range(size):
            img.putpixel((x, y), (x * 2 % 256, y * 2 % 256, (x * y) % 256))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _prompt_tokens(vllm, body: dict) -> int:
    """vLLM's prompt token count for a chat request body (replayed without streaming, one token)."""
    body = {**body, "stream": False, "max_tokens": 1}
    body.pop("stream_options", None)
    r = requests.post(vllm.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {UPSTREAM_KEY}"},
                      json=body, timeout=300)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def _without_images(body: dict) -> dict:
    msgs = []
    for m in body["messages"]:
        if isinstance(m.get("content"), list):
            m = {**m, "content": [p for p in m["content"] if p.get("type") != "image_url"]}
        msgs.append(m)
    return {**body, "messages": msgs}


def test_an_attached_image_reaches_the_model(browser, gateway, vllm, recorder, tmp_path):
    from selenium.webdriver.common.by import By

    png = _png()
    path = tmp_path / "picture.png"
    path.write_bytes(png)
    # What the image adds to a prompt when sent straight to vLLM: the tokens the UI's request must add too.
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    direct = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look."}, {"type": "image_url", "image_url": {"url": url}}]}]}
    image_tokens = _prompt_tokens(vllm, direct) - _prompt_tokens(vllm, _without_images(direct))
    assert image_tokens > 0

    seen, recorded = len(gateway.log_entries()), len(recorder.bodies)
    new_chat = wait_for(lambda: [e for e in browser.find_elements(By.CSS_SELECTOR, "[aria-label='New Chat']")
                                 if e.is_displayed()], what="the new-chat button")
    new_chat[0].click()
    wait_for(lambda: browser.find_elements(By.ID, "chat-input"), what="a new chat")
    file_input = browser.find_element(By.CSS_SELECTOR, "input[type=file][multiple]")
    # the file picker's job: reveal the input it fills in
    browser.execute_script("arguments[0].hidden = false; arguments[0].style.display = 'block';"
                           "arguments[0].classList.remove('hidden');", file_input)
    file_input.send_keys(str(path))
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "img[src^='data:image'], img[src*='/files/']"),
             what="the attached image's preview")
    shot(browser, "05-image-attached")
    send(browser, "Look.")
    wait_for_answer(browser)
    shot(browser, "06-image-answer")
    chat = streamed_chat(gateway, seen)
    assert chat["bytes_in"] > len(url), "the UI's request does not carry the image"
    # The UI's own request, replayed: its image adds to the prompt exactly what it adds to a direct call.
    sent = [json.loads(b) for p, b in recorder.bodies[recorded:] if p == "/v1/chat/completions"]
    ui = next(b for b in sent if b.get("stream") and any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
        for m in b["messages"]))
    with_image, without = _prompt_tokens(vllm, ui), _prompt_tokens(vllm, _without_images(ui))
    print(f"\nUI image request: {with_image} prompt tokens, {without} without its image "
          f"(direct call: the image is {image_tokens} tokens)")
    assert with_image - without == image_tokens


def test_every_ui_request_went_through_the_gateway_as_openwebui(gateway, vllm):
    entries = gateway.log_entries()
    assert entries, "no request reached the gateway"
    assert {(e["source"], e["priority"]) for e in entries} == {("openwebui", 0)}
    statuses = {e["status"] for e in entries}
    assert statuses <= {200}, f"the UI's calls failed at the gateway: {[e for e in entries if e['status'] != 200]}"
    paths = {(e["method"], e["path"]) for e in entries}
    assert ("GET", "/v1/models") in paths  # the UI's model list
    background = [e for e in chat_entries(gateway) if not e["stream"]]
    assert background, "no title/follow-up generation call: the UI's background tasks did not reach the model"
    # one key for all of it: the operator's (vLLM's own key is the gateway's secret, never the UI's)
    assert len({e["key_id"] for e in entries}) == 1
    # and vLLM refuses the UI's key: only the gateway's swap to the upstream key got those calls through
    assert requests.get(vllm.url + "/v1/models", headers={"Authorization": f"Bearer {UI_KEY}"},
                        timeout=10).status_code == 401
    (ARTIFACTS / "access-log.jsonl").write_text("\n".join(json.dumps(e) for e in entries) + "\n")
