"""Fixtures for the gateway tests: a real nginx (Debian's, with its Lua module) started by
proxy/run-local.sh on a free loopback port, in front of a recording upstream stand-in.

One gateway serves most tests (session scope); tests that need their own settings (no upstream key,
a dead upstream, a keys file they edit) start one with `make_gateway`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gateway_harness import UPSTREAM_SECRET, Gateway, keys_text  # noqa: E402
from stub_upstream import StubUpstream  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _need_nginx():
    if shutil.which("nginx") is None or not Path("/usr/lib/nginx/modules/ngx_http_lua_module.so").exists():
        pytest.skip("needs Debian's nginx + Lua: apt-get install -y nginx libnginx-mod-http-lua lua-cjson")


@pytest.fixture(scope="session")
def stub():
    upstream = StubUpstream().start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="session")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(keys_text())
    return path


@pytest.fixture(scope="session")
def gateway(stub, keys_file, tmp_path_factory):
    """The main gateway: upstream key set, body limit MAX_BODY."""
    gw = Gateway(tmp_path_factory.mktemp("gw-main"), stub.url, keys_file,
                 {"UPSTREAM_API_KEY": UPSTREAM_SECRET}).start()
    yield gw
    gw.stop()


@pytest.fixture
def make_gateway(tmp_path):
    started: list[Gateway] = []

    def make(upstream: str, keys_file: Path, env: dict[str, str] | None = None, start: bool = True):
        gw = Gateway(tmp_path / f"gw{len(started)}", upstream, keys_file, env)
        started.append(gw)
        return gw.start() if start else gw

    yield make
    for gw in started:
        gw.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Show the gateway's stderr (nginx error log) with a failing test."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "gateway" in item.fixturenames:
        gw = item.funcargs.get("gateway")
        if isinstance(gw, Gateway):
            report.sections.append(("gateway stderr (tail)", gw.stderr()[-4000:]))
