"""Open WebUI on a machine without Docker (the browser tests, `make demo`), started as compose starts it.

`WebUI` runs `open-webui serve` from its own environment (`make webui-env`: `.webui-venv`, the PyPI release
of the version compose pins) with the `webui` service's environment from compose.yaml: the same switches
(no Ollama, settings read from the environment at every start, the UI's name), with the gateway's URL, the
UI's key and a session secret filled in. On top, only what a machine without internet needs: no model
downloads (its document-search embedder is never loaded), data in a directory of the caller's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import requests

from bonsai_vllm import settings
from bonsai_vllm.testing.devserver import wait_until_healthy

REPO = Path(__file__).resolve().parents[3]
WEBUI_VENV = settings.get("BONSAI_WEBUI_VENV") or REPO / ".webui-venv"


class WebUIFailed(RuntimeError):
    pass


def compose_image_version() -> str:
    """The Open WebUI version compose.yaml pins (ghcr.io/open-webui/open-webui:vX.Y.Z)."""
    m = re.search(r"ghcr\.io/open-webui/open-webui:v([0-9.]+)", (REPO / "compose.yaml").read_text())
    if not m:
        raise WebUIFailed("compose.yaml pins no ghcr.io/open-webui/open-webui:vX.Y.Z image")
    return m.group(1)


def compose_environment(values: dict[str, str]) -> dict[str, str]:
    """The webui service's `environment:` from compose.yaml, ${VAR:-default} resolved from `values`."""
    import yaml

    env = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["webui"]["environment"]

    def resolve(v: str) -> str:
        def one(m: re.Match) -> str:
            name, _, default = m.group(1).partition(":-")
            return values.get(name, default)
        return re.sub(r"\$\{([^}]+)\}", one, str(v))

    return {k: resolve(v) for k, v in env.items()}


class WebUI:
    """One Open WebUI server wired to a gateway. Use as a context manager."""

    def __init__(self, data_dir: Path, gateway_url: str, api_key: str, *, port: int, model: str,
                 secret: str = "bonsai-test-secret", log_path: Path | None = None, startup_timeout: float = 300):
        self.data_dir = Path(data_dir)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path or self.data_dir / "webui.log"
        self.startup_timeout = startup_timeout
        exe = WEBUI_VENV / "bin" / "open-webui"
        if not exe.exists():
            raise WebUIFailed(f"no Open WebUI at {exe}: run `make webui-env` (open-webui=={compose_image_version()} "
                              "from PyPI into .webui-venv)")
        self.exe = exe
        env = compose_environment({"WEBUI_API_KEY": api_key, "WEBUI_SECRET_KEY": secret, "SERVED_MODEL_NAME": model})
        env["OPENAI_API_BASE_URL"] = gateway_url.rstrip("/") + "/v1"  # compose: http://proxy:8080/v1
        offline = {
            "DATA_DIR": str(self.data_dir), "HOST": "127.0.0.1", "PORT": str(port),
            # Nothing leaves this machine: no Hub downloads, no update check, no embedding model.
            "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "ENABLE_VERSION_UPDATE_CHECK": "false",
            "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false", "RAG_RERANKING_MODEL_AUTO_UPDATE": "false",
            "BYPASS_EMBEDDING_AND_RETRIEVAL": "true", "ENABLE_WEB_SEARCH": "false",
            "ANONYMIZED_TELEMETRY": "false", "DO_NOT_TRACK": "true", "SCARF_NO_ANALYTICS": "true",
        }
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "WEBUI_", "VIRTUAL_ENV"))}
        base["PATH"] = f"{WEBUI_VENV / 'bin'}:{base.get('PATH', '/usr/bin:/bin')}"
        self.env = {**base, **env, **offline}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "WebUI":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(self.exe), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.data_dir,
                                     start_new_session=True)
        why = wait_until_healthy(self.proc, self.url + "/health", self.startup_timeout, interval=0.5)
        if why is None:
            return self
        self.stop()
        raise WebUIFailed(f"Open WebUI {why}:\n{self.log_tail()}")

    def create_admin(self, name: str, email: str, password: str) -> str:
        """The first account becomes the admin (what a person does on the first visit). Returns its token."""
        r = requests.post(self.url + "/api/v1/auths/signup", json={"name": name, "email": email,
                                                                   "password": password}, timeout=30)
        if r.status_code != 200:
            raise WebUIFailed(f"signup failed: {r.status_code} {r.text[:300]}")
        return r.json()["token"]

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "log", None):
            self.log.close()

    def __enter__(self) -> "WebUI":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
