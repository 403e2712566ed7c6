"""Shared fixtures: tiny models generated once per session, and the server-log hook.

A test module that needs a vLLM server starts one module-scoped (see `bonsai_vllm.devserver`): vLLM takes about
a minute to start on this CPU, so tests share servers wherever their arguments allow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bonsai_vllm.devserver import RUNNING


# Enough AdamW steps (~2 min here) that the tiny model continues its corpus's counting line decisively,
# even after ternary quantization; tests that compare greedy tokens rely on it.
TINY_TRAIN_STEPS = 80


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny dense Qwen3.5-hybrid checkpoint (seed 0), briefly trained on the built-in corpus."""
    from bonsai_vllm.core.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny-dense"), seed=0, train_steps=TINY_TRAIN_STEPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the log of every vLLM server still running to a failing test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in RUNNING:
            report.sections.append((f"vLLM server log ({server.url}, tail)", server.log_tail()))
