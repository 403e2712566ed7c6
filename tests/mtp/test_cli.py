"""bonsai-mtp-train's refusals of bad input, before any server is asked: each exits 2 with a message that
names the problem, and nothing is written."""

from __future__ import annotations

import json

import pytest

from bonsai_vllm.mtp.cli import main, read_prompts, server_args
from bonsai_vllm.mtp.io import MTPInputError


@pytest.mark.parametrize("text, message", [
    ("", "no prompts"),
    ("\n\n", "no prompts"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n', ":2: not JSON"),
    ('{"messages": "hi"}\n', ":1: expected"),
    ('{"messages": [{"content": "no role"}]}\n', ":1: expected"),
])
def test_bad_prompt_files_are_refused(tmp_path, capsys, text, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(text)
    out = tmp_path / "answers.jsonl"
    # an unreachable URL: the file is judged before any request
    assert main(["collect", "--url", "http://127.0.0.1:9", "--prompts", str(prompts), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_prompt_forms(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n"
                 + json.dumps([{"role": "user", "content": "b"}]) + "\n")
    assert [m[0]["content"] for m in read_prompts(p)] == ["a", "b"]
    with pytest.raises(MTPInputError, match="no such prompt file"):
        read_prompts(tmp_path / "missing.jsonl")


def test_train_refuses_to_write_into_the_model_folder(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert main(["train", "--model", str(model), "--hidden", str(tmp_path),
                 "--out", str(model / "mtp.safetensors")]) == 2
    assert "outside the served model's folder" in capsys.readouterr().err
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]


def test_server_args_name_the_last_layers_output():
    args = server_args(64, tmp := __import__("pathlib").Path("/data/hs"))
    spec = json.loads(args[args.index("--speculative-config") + 1])
    # the layer id is the INPUT of that layer: 64 is the output of the last of 64 layers (ids 0..63)
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [64]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp)
