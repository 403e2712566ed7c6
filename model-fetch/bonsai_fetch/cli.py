"""`bonsai-fetch`: the command line (and the init container's entry point).

Every option has a flag and an environment variable (documented in .env.example); a flag wins over the
environment, the environment over the default. Exit statuses: see `bonsai_fetch.errors`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from bonsai_fetch import __version__
from bonsai_fetch.build import Builder, Options
from bonsai_fetch.errors import FetchError, Interrupted, UsageError, classify

# The vLLM service (bonsai-serve) reads MODEL_DIR with this default: without a setting of its own,
# bonsai-fetch writes where the server looks.
DEFAULT_OUT = "/models/bonsai"
DEFAULT_MODEL_REPO = "fraserprice/Ternary-Bonsai-2-27B-vllm"
# PrismML's own MLX 2-bit pack (the fallback source), and the base model whose shards hold the vision tower:
# Ternary-Bonsai-2-27B is a ternary Qwen3.8-27B (the upload's model card), so its tower is Qwen3.8-27B's; a
# Qwen3.5-27B tower has the same shapes but belongs to another model (build.check_vision_lineage refuses it
# by the model cards). Both names are this project's best knowledge: override them in .env.
DEFAULT_OFFICIAL_REPO = "prism-ml/Ternary-Bonsai-2-27B-mlx-2bit"
DEFAULT_VISION_REPO = "Qwen/Qwen3.8-27B"
DEFAULT_ENDPOINT = "https://huggingface.co"
OFF = ("off", "none", "0", "false", "no")

# flag dest -> environment variable
ENV = {
    "out": "BONSAI_MODEL_DIR",
    "model_repo": "BONSAI_MODEL_REPO",
    "model_revision": "BONSAI_MODEL_REVISION",
    "source": "BONSAI_SOURCE",
    "official_repo": "BONSAI_OFFICIAL_REPO",
    "official_revision": "BONSAI_OFFICIAL_REVISION",
    "vision_repo": "BONSAI_VISION_REPO",
    "vision_revision": "BONSAI_VISION_REVISION",
    "vision_check": "BONSAI_VISION_CHECK",
    "mtp_repo": "BONSAI_MTP_REPO",
    "mtp_file": "BONSAI_MTP_FILE",
    "mtp_revision": "BONSAI_MTP_REVISION",
    "embed_export": "BONSAI_EMBED_EXPORT",
    "hot_vocab": "BONSAI_EMBED_HOT_VOCAB",
    "token_counts": "BONSAI_EMBED_TOKEN_COUNTS",
    "cache_dir": "BONSAI_FETCH_CACHE",
    "retries": "BONSAI_FETCH_RETRIES",
    "free_bytes": "BONSAI_FETCH_FREE_BYTES",
    "endpoint": "HF_ENDPOINT",
    "token": "HF_TOKEN",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bonsai-fetch",
        description="Download Ternary-Bonsai-2-27B and prepare the model directory vLLM serves: the prism_ternary "
                    "checkpoint (the vLLM upload, or rebuilt from PrismML's official MLX pack), the vision tower "
                    "put back under the multimodal config, an optional replacement MTP head, and the embedding "
                    "table exported for SSD lookup. Reruns with the same options do nothing; changed options "
                    "rebuild only what they affect.",
        epilog="Every option can also be set by the environment variable in brackets (see .env.example). Exit "
               "status: 0 ready, 2 bad option, 3 no network, 4 token refused (401/403), 5 not found (404), "
               "6 disk full, 7 checksum mismatch, 8 incompatible sources, 130 interrupted. Details: "
               "docs/model-fetch.md.")
    a = p.add_argument
    a("--out", metavar="DIR", help=f"the model directory to write [BONSAI_MODEL_DIR, else MODEL_DIR (the vLLM "
                                  f"service's setting); default {DEFAULT_OUT}]")
    a("--model-repo", metavar="REPO", help=f"the vLLM-format prism_ternary checkpoint [BONSAI_MODEL_REPO; default "
                                           f"{DEFAULT_MODEL_REPO}]")
    a("--model-revision", metavar="REV", help="its branch, tag or commit; pin a commit for reproducible builds "
                                               "[BONSAI_MODEL_REVISION; default main]")
    a("--source", choices=("auto", "vllm", "official"),
      help="where the weights come from: the vLLM upload, PrismML's official MLX pack, or auto (the upload, "
           "falling back to the pack when the upload is gone or refused) [BONSAI_SOURCE; default auto]")
    a("--official-repo", metavar="REPO", help=f"PrismML's official MLX 2-bit pack [BONSAI_OFFICIAL_REPO; default "
                                              f"{DEFAULT_OFFICIAL_REPO}]")
    a("--official-revision", metavar="REV", help="[BONSAI_OFFICIAL_REVISION; default main]")
    a("--vision-repo", metavar="REPO|off",
      help="where the vision tower comes from: a multimodal checkpoint whose index lists model.visual.* (only "
           "those shards are downloaded) or an MLX pack with vision_tower.*; 'off' for a text-only model "
           f"[BONSAI_VISION_REPO; default {DEFAULT_VISION_REPO}]")
    a("--vision-revision", metavar="REV", help="[BONSAI_VISION_REVISION; default main]")
    a("--vision-check", metavar="1|0", help="refuse a vision tower whose model card names another base model than "
                                            "the weights' card [BONSAI_VISION_CHECK; default 1]")
    # report 002: the field report described in docs/field-reports.md (§6, the Japanese MTP head).
    a("--mtp-repo", metavar="REPO|DIR|off",
      help="a repo, or a local folder (an absolute or ./ path, e.g. where bonsai-mtp-train wrote its "
           "mtp.safetensors), holding a replacement MTP head (e.g. a Japanese-trained one, report 002); 'off' keeps the "
           "checkpoint's own head [BONSAI_MTP_REPO; default off]")
    a("--mtp-file", metavar="FILE", help="the head's safetensors file in that repo, mtp.* tensors with the "
                                         "model's names, shapes and dtypes [BONSAI_MTP_FILE; default mtp.safetensors]")
    a("--mtp-revision", metavar="REV", help="[BONSAI_MTP_REVISION; default main]")
    a("--no-embed-export", dest="embed_export", action="store_const", const="0",
      help="do not export the embedding table for SSD lookup [BONSAI_EMBED_EXPORT=0; default 1]")
    a("--hot-vocab", dest="hot_vocab", metavar="N",
      help="rows of the embedding kept on the GPU: the N most frequent tokens [BONSAI_EMBED_HOT_VOCAB; "
           "default 32000]")
    a("--token-counts", metavar="FILE",
      help="token frequencies that pick the hot rows: JSON {\"id\": count}, a JSON list, or lines 'id count'; "
           "without it the lowest ids are hot [BONSAI_EMBED_TOKEN_COUNTS]")
    a("--cache-dir", metavar="DIR", help="where downloads are kept (resumable; same disk as --out lets the "
                                         "output hard-link them) [BONSAI_FETCH_CACHE; default "
                                         "<out's parent>/.bonsai-fetch-cache]")
    a("--prune-cache", action="store_true", help="delete the download cache after success (a later option "
                                                 "change then downloads again)")
    a("--endpoint", metavar="URL", help=f"the Hub [HF_ENDPOINT; default {DEFAULT_ENDPOINT}]")
    a("--token", metavar="TOKEN", help="Hugging Face token for private or gated repos [HF_TOKEN; default: "
                                       "the token of `hf auth login`, if any]")
    a("--retries", metavar="N", help="retries of a network failure, with backoff up to a minute; the partial "
                                     "file is kept between tries [BONSAI_FETCH_RETRIES; default 8]")
    a("--free-bytes", metavar="N", help=argparse.SUPPRESS)  # testing: pretend this much disk is free
    a("--verify", action="store_true", help="re-hash an existing output against its manifest")
    a("--force", action="store_true", help="rebuild every component even if the output is up to date")
    a("--dry-run", action="store_true", help="show what would be downloaded and built, then stop")
    a("--no-progress", action="store_true", help="no progress bars")
    a("--version", action="version", version=f"bonsai-fetch {__version__}")
    return p


def _int(value: str, name: str, minimum: int = 0) -> int:
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"{name} must be an integer, got {value!r}") from None
    if n < minimum:
        raise UsageError(f"{name} must be at least {minimum}, got {n}")
    return n


def options_from(args: argparse.Namespace, env: Mapping[str, str]) -> Options:
    """Merge flags, environment and defaults into Options (flags win)."""

    def get(dest: str, default: str | None = None) -> str | None:
        # An empty value (`NAME=` in .env, passed on by compose) means "not set": the default applies.
        value = getattr(args, dest, None)
        if value in (None, ""):
            value = env.get(ENV[dest])
        if dest == "out" and value in (None, ""):
            value = env.get("MODEL_DIR")
        return default if value in (None, "") else value

    source = get("source", "auto")
    if source not in ("auto", "vllm", "official"):
        raise UsageError(f"BONSAI_SOURCE must be auto, vllm or official, got {source!r}")
    vision = get("vision_repo", DEFAULT_VISION_REPO)
    mtp = get("mtp_repo", "off")
    embed = get("embed_export", "1")
    counts = get("token_counts")
    if counts and not Path(counts).is_file():
        raise UsageError(f"the token-count file {counts} does not exist (BONSAI_EMBED_TOKEN_COUNTS / "
                         "--token-counts)")
    free = get("free_bytes")
    return Options(
        out=Path(get("out", DEFAULT_OUT)),
        model_repo=get("model_repo", DEFAULT_MODEL_REPO),
        model_revision=get("model_revision", "main"),
        source=source,
        official_repo=get("official_repo", DEFAULT_OFFICIAL_REPO),
        official_revision=get("official_revision", "main"),
        vision_repo=None if vision.strip().lower() in OFF else vision.strip(),
        vision_revision=get("vision_revision", "main"),
        vision_check=get("vision_check", "1").strip().lower() not in OFF,
        mtp_repo=None if mtp.strip().lower() in OFF else mtp.strip(),
        mtp_file=get("mtp_file", "mtp.safetensors"),
        mtp_revision=get("mtp_revision", "main"),
        embed_export=embed.strip().lower() not in OFF,
        hot_vocab=_int(get("hot_vocab", "32000"), "BONSAI_EMBED_HOT_VOCAB / --hot-vocab", 1),
        token_counts=Path(counts) if counts else None,
        cache_dir=Path(get("cache_dir")) if get("cache_dir") else None,
        endpoint=get("endpoint", DEFAULT_ENDPOINT).rstrip("/"),
        token=get("token"),
        retries=_int(get("retries", "8"), "BONSAI_FETCH_RETRIES / --retries"),
        free_bytes_override=_int(free, "BONSAI_FETCH_FREE_BYTES") if free else None,
        verify=args.verify, force=args.force, dry_run=args.dry_run, prune_cache=args.prune_cache,
        progress=not args.no_progress,
    )


def _log(message: str) -> None:
    for line in message.splitlines():
        print(f"bonsai-fetch: {line}", file=sys.stderr, flush=True)


def _on_sigterm(signum, frame) -> None:
    # `docker stop` sends SIGTERM: unwind like Ctrl-C so temporaries are removed and partial downloads kept.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run bonsai-fetch; returns the exit status (see bonsai_fetch.errors)."""
    env = os.environ if env is None else env
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = None
    if threading_main():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        opts = options_from(args, env)
        if not opts.progress:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        return Builder(opts, log=_log).run()
    except KeyboardInterrupt:
        err: FetchError = Interrupted("interrupted: the model directory was left as it was (no half-written files); "
                                      "finished downloads are kept and a cut-off one resumes on the next run")
    except FetchError as e:
        err = e
    except Exception as e:  # noqa: BLE001 - last resort: a classified message instead of a bare traceback
        err = classify(e, what="the model", endpoint=env.get("HF_ENDPOINT", DEFAULT_ENDPOINT), token_given=False)
        if type(err) is FetchError:
            import traceback

            traceback.print_exc()
            err = FetchError(f"{err} (a bug? the traceback is above; please report it)")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    _log(f"error ({err.kind}): {err}")
    return err.exit_code


def threading_main() -> bool:
    """Signal handlers can only be installed from the main thread."""
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
