"""bonsai-mtp-train: retrain the MTP head (`mtp.*`) on the served model's own answers.

    bonsai-mtp-train collect --url http://gateway:8080 --key $BENCH_KEY --prompts prompts.jsonl --out answers.jsonl
    bonsai-mtp-train server-args --model /models/bonsai --storage /data/hs   # flags of the extraction server
    bonsai-mtp-train extract --url http://127.0.0.1:8100 --answers answers.jsonl --out hidden/
    bonsai-mtp-train train --model /models/bonsai --hidden hidden/ --out mtp.safetensors

`collect` asks the running stack (greedy) for its answers and keeps the exact token ids (vLLM's
`return_token_ids`). `extract` sends each prompt + answer to a vLLM started with `server-args`' flags
(vLLM's hidden-state extraction of layer id num_hidden_layers, the last layer's output) on the same
machine, and moves each file into --out. `train` trains only mtp.* and writes mtp.safetensors in the
checkpoint's names, dtypes and shapes; model-fetch takes the folder of the file as its MTP repo (docs/mtp.md).
Nothing here touches the served model's folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

from bonsai_vllm.mtp.io import MTPInputError


def read_prompts(path: Path) -> list[list[dict]]:
    """A JSONL file, one chat per line: {"messages": [{"role": ..., "content": ...}, ...]} (or a bare list)."""
    if not path.is_file():
        raise MTPInputError(f"{path}: no such prompt file")
    chats = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise MTPInputError(f"{path}:{no}: not JSON ({e.msg})") from e
        messages = item.get("messages") if isinstance(item, dict) else item
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                           for m in messages)):
            raise MTPInputError(f"{path}:{no}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}]}}")
        chats.append(messages)
    if not chats:
        raise MTPInputError(f"{path}: no prompts (the file is empty)")
    return chats


def _post(url: str, body: dict, key: str | None, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise MTPInputError(f"{url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from e
    except urllib.error.URLError as e:
        raise MTPInputError(f"{url}: {e.reason}") from e


def collect(url: str, key: str | None, prompts: Path, out: Path, model: str, max_tokens: int) -> int:
    chats = read_prompts(prompts)
    tmp = out.with_name(f".{out.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for messages in chats:
            r = _post(url.rstrip("/") + "/v1/chat/completions",
                      {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                       "return_token_ids": True}, key)
            choice = r["choices"][0]
            if r.get("prompt_token_ids") is None or choice.get("token_ids") is None:
                raise MTPInputError(f"{url}: the answer carries no token ids (a vLLM 0.32 server with "
                                    "return_token_ids is needed behind the gateway)")
            f.write(json.dumps({"prompt_token_ids": r["prompt_token_ids"], "token_ids": choice["token_ids"]}) + "\n")
    tmp.replace(out)
    return len(chats)


def server_args(num_hidden_layers: int, storage: Path) -> list[str]:
    """vLLM flags for the extraction server: the last layer's output is layer id num_hidden_layers."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [num_hidden_layers]}}}
    kv = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "bonsai_vllm.adapters.hidden_states",
          "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]


def extract(url: str, answers: Path, out: Path, model: str, key: str | None = None) -> int:
    if not answers.is_file():
        raise MTPInputError(f"{answers}: no such answers file; run `bonsai-mtp-train collect` first")
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for no, line in enumerate(answers.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        ids = list(rec["prompt_token_ids"]) + list(rec["token_ids"])
        r = _post(url.rstrip("/") + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1}, key)
        path = (r.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise MTPInputError(f"{url}: no hidden_states_path in the answer: start that server with "
                                "`bonsai-mtp-train server-args`' flags")
        from bonsai_vllm.mtp.train import wait_for_file
        wait_for_file(Path(path))
        shutil.move(path, out / f"{no:06d}.safetensors")
        Path(path + ".lock").unlink(missing_ok=True)
        n += 1
    return n


# bonsai-serve's SERVED_MODEL_NAME (compose hands it to the mtp services), else its default
SERVED_NAME = os.environ.get("SERVED_MODEL_NAME") or "bonsai-27b"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bonsai-mtp-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="the served model's own greedy answers to a prompt file")
    c.add_argument("--url", required=True, help="gateway or vLLM base URL")
    c.add_argument("--key", help="API key (a benchmark key at the gateway)")
    c.add_argument("--prompts", type=Path, required=True, help="JSONL, one {\"messages\": [...]} per line")
    c.add_argument("--out", type=Path, required=True, help="answers JSONL (token ids)")
    c.add_argument("--model", default=SERVED_NAME, help=f"served model name [{SERVED_NAME}]")
    c.add_argument("--max-tokens", type=int, default=256)
    a = sub.add_parser("server-args", help="print the vLLM flags of the extraction server")
    a.add_argument("--model", type=Path, required=True, help="the model folder (its config gives the layer id)")
    a.add_argument("--storage", type=Path, required=True, help="where that server writes hidden states")
    e = sub.add_parser("extract", help="last-layer hidden states of each answer, from the extraction server")
    e.add_argument("--url", required=True)
    e.add_argument("--answers", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--model", default=SERVED_NAME, help=f"served model name [{SERVED_NAME}]")
    t = sub.add_parser("train", help="train mtp.* and write mtp.safetensors")
    t.add_argument("--model", type=Path, default=os.environ.get("MODEL_DIR") or None,
                   required=not os.environ.get("MODEL_DIR"),
                   help="the served checkpoint's folder (read only) [$MODEL_DIR]")
    t.add_argument("--hidden", type=Path, required=True, help="the folder `extract` filled")
    t.add_argument("--out", type=Path, required=True, help="mtp.safetensors to write (not in the model folder)")
    t.add_argument("--checkpoint", type=Path, help="resumable training state [<out>.ckpt]")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--holdout", type=float, default=0.2)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--device", default="cuda" if __import__("torch").cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "collect":
            n = collect(args.url, args.key, args.prompts, args.out, args.model, args.max_tokens)
            print(f"{n} answers -> {args.out}")
        elif args.cmd == "server-args":
            cfg = json.loads((args.model / "config.json").read_text())
            layers = cfg.get("text_config", cfg)["num_hidden_layers"]
            print(" ".join(f"'{x}'" if x.startswith("{") else x for x in server_args(layers, args.storage)))
        elif args.cmd == "extract":
            n = extract(args.url, args.answers, args.out, args.model)
            print(f"{n} hidden-state files -> {args.out}")
        else:
            return _train(args)
    except MTPInputError as err:
        print(f"bonsai-mtp-train: {err}", file=sys.stderr)
        return 2
    return 0


def _train(args: argparse.Namespace) -> int:
    from bonsai_vllm.mtp.io import load_frozen, write_head
    from bonsai_vllm.mtp.train import TrainConfig, Trainer, load_samples

    out = args.out.resolve()
    if out.parent == args.model.resolve():
        raise MTPInputError(f"{out}: write the head outside the served model's folder; model-fetch swaps it in")
    frozen = load_frozen(args.model)
    samples = load_samples(args.hidden, frozen.shape.hidden_size)
    cfg = TrainConfig(steps=args.steps, lr=args.lr, batch=args.batch, holdout=args.holdout, seed=args.seed,
                      save_every=args.save_every)
    trainer = Trainer(frozen, samples, cfg, args.checkpoint or out.with_name(out.name + ".ckpt"), args.device)
    result = trainer.run()
    write_head(out, trainer.weights(), frozen.head)
    first = result["history"][0]
    print(json.dumps({"out": str(out), "steps": result["step"], "held_loss_before": first["held_loss"],
                      "held_loss": result["held_loss"], "held_acceptance_before": first["held_acceptance"],
                      "held_acceptance": result["held_acceptance"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
