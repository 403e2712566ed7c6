"""Fixtures of the model-fetch tests: tiny fixture repos on a local Hub stand-in, and a fetch runner.

One tiny dense multimodal Qwen3.5-hybrid with an MTP head (`bonsai-tiny --mtp --vision`, untrained: these
tests compare tensors, not text) is published several ways, as the real sources are (model cards included):

| repo (the real one's name)                   | what it holds                                                      |
| -------------------------------------------- | ------------------------------------------------------------------ |
| `fraserprice/Ternary-Bonsai-2-27B-vllm`      | the vLLM upload: bonsai-convert of it, vision tower removed, 3 shards |
| `prism-ml/Ternary-Bonsai-2-27B-mlx-2bit`     | the official MLX 2-bit pack of the same model (same sign seed)     |
| `Qwen/Qwen3.8-27B`                           | the dense base: 3 shards, the vision tower alone in the last       |
| `Qwen/Qwen3.5-27B`                           | the same files, its model card naming another base model           |
| `bonsai-ja/Ternary-Bonsai-2-27B-mtp-ja`      | a replacement MTP head (`mtp.safetensors`) and a misfit one        |
| `someone/private-copy`                       | the vLLM upload again, readable only with a token                  |
| `someone/text-only-upload`                   | the upload as a text-only checkpoint: `model.*`, flat config, 1 file |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from fetch_repos import (
    REPO_BASE,
    REPO_OTHER_BASE,
    REPO_MTP,
    REPO_OFFICIAL,
    REPO_PRIVATE,
    REPO_TEXT_ONLY,
    REPO_VLLM,
    TOKEN,
    Fixture,
    build_fixture,
)
from hubserver import HubServer


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory) -> Fixture:
    return build_fixture(tmp_path_factory.mktemp("fetch-fixtures"))


@pytest.fixture(scope="session")
def hub_session(fixture_models) -> HubServer:
    with HubServer() as hub:
        hub.add_repo(REPO_VLLM, fixture_models.upload)
        hub.add_repo(REPO_OFFICIAL, fixture_models.pack)
        hub.add_repo(REPO_BASE, fixture_models.base)
        hub.add_repo(REPO_OTHER_BASE, fixture_models.other_base)
        hub.add_repo(REPO_MTP, fixture_models.mtp_dir)
        hub.add_repo(REPO_PRIVATE, fixture_models.upload, token=TOKEN)
        hub.add_repo(REPO_TEXT_ONLY, fixture_models.text_only)
        yield hub


@pytest.fixture()
def hub(hub_session) -> HubServer:
    hub_session.reset_faults()
    yield hub_session
    hub_session.reset_faults()


@dataclass
class Run:
    code: int
    out: str  # what bonsai-fetch printed (stderr)


@pytest.fixture()
def fetch(hub, capsys) -> Callable[..., Run]:
    """Run bonsai-fetch in this process against the local Hub; keyword `env` adds environment variables."""
    from bonsai_fetch.cli import main

    def run(*args: str, env: dict[str, str] | None = None) -> Run:
        base_env = {"HF_ENDPOINT": hub.url, "BONSAI_FETCH_RETRIES": "0", "BONSAI_MTP_REPO": "off"}
        capsys.readouterr()
        code = main(["--no-progress", *args], env={**base_env, **(env or {})})
        captured = capsys.readouterr()
        return Run(code, captured.err + captured.out)

    return run
