"""The `host` fixture for the wsl/ script tests (the fakes live in wslfakes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Import the helpers by path, whatever pytest's import mode, without clashing with tests/conftest.py.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wslfakes import FakeHost  # noqa: E402


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return FakeHost(tmp_path)
