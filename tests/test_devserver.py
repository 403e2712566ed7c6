"""The test servers' environment: what the test process switched on for itself must not reach vLLM; and their
mode (eager unless a test asks for vLLM's compiled forward).

CI on 2026-11-29 hung starting the ternary server: the kernel tests had left TRITON_INTERPRET=1 in the
session's environment and the server inherited it. Two guards, each tested here: the kernel modules'
interpreter scope restores the session's original value, and VllmServer drops the variable anyway.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bonsai_vllm.testing.devserver import VllmServer

sys.path.insert(0, str(Path(__file__).parent / "core"))
import interpreter_scope  # noqa: E402


def test_server_env_drops_triton_interpret(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("BONSAI_SOMETHING", "kept")
    srv = VllmServer(tmp_path, port=1)
    assert "TRITON_INTERPRET" not in srv.env
    assert srv.env["BONSAI_SOMETHING"] == "kept"  # everything else is inherited
    explicit = VllmServer(tmp_path, port=1, env={"TRITON_INTERPRET": "1"})
    assert explicit.env["TRITON_INTERPRET"] == "1"  # a test may still ask for it on purpose


def test_two_kernel_modules_restore_the_sessions_value(monkeypatch):
    # Both kernel modules enable the interpreter at collection; their teardowns must both end at the
    # value from before either of them, whatever the order.
    monkeypatch.setattr(interpreter_scope, "ORIGINAL_INTERPRET", None)
    monkeypatch.setenv("TRITON_INTERPRET", "-")  # records the session's value: put back after this test
    monkeypatch.delenv("TRITON_INTERPRET")
    interpreter_scope.enable()  # module A collected
    interpreter_scope.enable()  # module B collected
    interpreter_scope.restore([])  # module A torn down
    interpreter_scope.enable()  # module B's tests start
    interpreter_scope.restore([])  # module B torn down
    assert "TRITON_INTERPRET" not in os.environ

    monkeypatch.setattr(interpreter_scope, "ORIGINAL_INTERPRET", "0")
    interpreter_scope.enable()
    interpreter_scope.restore(["bonsai_vllm.ternary.kernels.not_a_module"])
    assert os.environ["TRITON_INTERPRET"] == "0"



def test_servers_run_eager_unless_compiled(tmp_path):
    assert "--enforce-eager" in VllmServer(tmp_path, port=1).command()
    assert "--enforce-eager" not in VllmServer(tmp_path, port=1, compiled=True).command()
    once = VllmServer(tmp_path, ["--enforce-eager"], port=1).command()
    assert once.count("--enforce-eager") == 1
