"""Plan and build the model directory: sources -> downloads -> rewrite -> manifest -> atomic swap.

The output is made of components, each rebuilt only when what it depends on changed:

| component | files                                                      | depends on                     |
| --------- | ---------------------------------------------------------- | ------------------------------ |
| weights   | language-model shards, tokenizer and other side files,     | weights source (repo, commit,  |
|           | `.bonsai-fetch/weights.config.json`                        | route: vLLM upload / MLX pack) |
| vision    | `visual.safetensors`, image/video processor configs,       | vision source (repo, commit)   |
|           | `.bonsai-fetch/vision.config.json`                         |                                |
| mtp       | `mtp.safetensors` (the checkpoint's head or a replacement) | weights, MTP source            |
| embed     | `embed_ssd/embed_tokens.{bin,json}`                        | weights, hot size, counts file |
| config    | `config.json`, `model.safetensors.index.json`              | weights, vision                |

Everything is written into a temporary directory beside OUT (`.OUT.partial-*`); unchanged components are
hard-linked from the current OUT, so a changed option costs only what it affects. The manifest
(`bonsai-fetch-manifest.json`: sources, options, sha256 of every file) and the completion marker
(`.bonsai-fetch-complete`, holding the manifest's sha256) are written last, then the directory replaces OUT.
A run that fails leaves OUT as it was.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from bonsai_fetch import __version__, st
from bonsai_fetch.errors import (
    AuthError,
    ChecksumError,
    DiskSpaceError,
    FetchError,
    IncompatibleError,
    NetworkError,
    NotFoundError,
    UsageError,
)
from bonsai_fetch.hub import Hub, Snapshot, is_commit, progress_bar, sha256_file
from bonsai_fetch.layout import (
    assemble_config,
    check_mtp_head,
    check_prism_config,
    check_ternary_headers,
    check_vision_tokens,
    mtp_signature,
    read_token_counts,
    text_part,
    weight_name,
)
from bonsai_vllm.checkpoint.io import atomic_directory
from bonsai_vllm.embeddings import EMBED_TENSOR_NAMES, export_embedding_table
from bonsai_vllm.checkpoint.official import (
    OfficialPackError,
    convert_mlx_pack,
    pack_files_needed,
    read_vision_tensors,
)

MANIFEST = "bonsai-fetch-manifest.json"
MARKER = ".bonsai-fetch-complete"
META_DIR = ".bonsai-fetch"
EMBED_DIR = "embed_ssd"
VISUAL_FILE = "visual.safetensors"
MTP_FILE = "mtp.safetensors"
INDEX = "model.safetensors.index.json"
MANIFEST_FORMAT = "bonsai-fetch/1"
COMPONENTS = ("weights", "vision", "mtp", "embed", "config")

# Files of a repo besides weights that a served model needs (tokenizer, templates, generation settings).
_SIDE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
EMBED_NAME = "model.language_model.embed_tokens.weight"


# ----------------------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Options:
    """Everything a run is asked to do (cli.py fills it from flags and the environment)."""

    out: Path
    model_repo: str
    model_revision: str = "main"
    source: str = "auto"  # auto: the vLLM upload, else the official pack; vllm; official
    official_repo: str = ""
    official_revision: str = "main"
    vision_repo: str | None = None  # None: no vision tower (a text-only model)
    vision_revision: str = "main"
    vision_check: bool = True  # refuse a tower whose model card names another base model (check_vision_lineage)
    mtp_repo: str | None = None  # None: keep the checkpoint's own MTP head
    mtp_file: str = "mtp.safetensors"
    mtp_revision: str = "main"
    embed_export: bool = True
    hot_vocab: int = 32000
    token_counts: Path | None = None
    cache_dir: Path | None = None
    endpoint: str = "https://huggingface.co"
    token: str | None = None
    retries: int = 8
    free_bytes_override: int | None = None
    verify: bool = False
    force: bool = False
    dry_run: bool = False
    prune_cache: bool = False
    progress: bool = True

    @property
    def store(self) -> Path:
        return self.cache_dir or self.out.absolute().parent / ".bonsai-fetch-cache"

    def counts_sha256(self) -> str | None:
        return sha256_file(self.token_counts) if self.token_counts else None

    def request(self) -> dict:
        """What determines the output (not how it is fetched): compared with the manifest's on a rerun."""
        return {
            "weights": {"source": self.source, "model_repo": self.model_repo, "model_revision": self.model_revision,
                        "official_repo": self.official_repo, "official_revision": self.official_revision},
            "vision": None if self.vision_repo is None else {"repo": self.vision_repo,
                                                             "revision": self.vision_revision},
            "mtp": None if self.mtp_repo is None else {"repo": self.mtp_repo, "revision": self.mtp_revision,
                                                       "file": self.mtp_file},
            "embed": None if not self.embed_export else {"hot_vocab": self.hot_vocab,
                                                         "token_counts_sha256": self.counts_sha256()},
        }


# ------------------------------------------------------------------------------------------------ helpers


def _fmt(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _anchor(path: Path) -> Path:
    """The nearest existing ancestor of a path (for disk usage and device checks)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def _same_device(a: Path, b: Path) -> bool:
    return os.stat(_anchor(a)).st_dev == os.stat(_anchor(b)).st_dev


def _place(src: Path, dst: Path) -> None:
    """Hard-link `src` at `dst` (no extra disk, same bytes), or copy where links are not possible."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _side_files(snap: Snapshot) -> list[str]:
    """Top-level non-weight files a served model needs (tokenizer, templates, generation settings)."""
    return sorted(p for p in snap.files if "/" not in p and p != "config.json" and p != INDEX
                  and (p.endswith(_SIDE_SUFFIXES) or p.startswith(("LICENSE", "NOTICE")))
                  and not p.endswith(".safetensors.index.json") and not p.startswith("."))


# ------------------------------------------------------------------------------------- existing output


@dataclass
class Existing:
    manifest: dict
    root: Path

    def files(self, component: str) -> list[str]:
        return [f for f, e in self.manifest["files"].items() if e["component"] == component]

    def pinned(self) -> bool:
        """Every source was asked for by commit hash: the Hub cannot have moved, no need to ask it."""
        return all(is_commit(s["revision"]) for s in self.manifest["sources"].values() if s)


def load_existing(out: Path) -> Existing | None:
    """The manifest of a complete OUT (its marker holds the manifest's sha256), else None."""
    marker, manifest = out / MARKER, out / MANIFEST
    if not marker.is_file() or not manifest.is_file():
        return None
    raw = manifest.read_bytes()
    if marker.read_text().strip() != hashlib.sha256(raw).hexdigest():
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if data.get("format") != MANIFEST_FORMAT:
        return None
    for rel, entry in data.get("files", {}).items():
        path = out / rel
        if not path.is_file() or path.stat().st_size != entry["size"]:
            return None  # a file went missing or changed size: not complete any more
    return Existing(data, out)


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """One bonsai-fetch per output directory at a time (a lock file beside it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FetchError(f"another bonsai-fetch is preparing {out} (lock {lock_path}); wait for it to finish") \
                from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clean_leftovers(out: Path, log: Callable[[str], None]) -> None:
    """Remove temporaries of a run that was killed outright; restore OUT if it died mid-swap."""
    for p in sorted(out.parent.glob(f".{out.name}.old-*")):
        if not out.exists() and (p / "x").is_dir():
            (p / "x").rename(out)
            log(f"restored {out} from an interrupted swap")
        shutil.rmtree(p, ignore_errors=True)
    for p in sorted(out.parent.glob(f".{out.name}.partial-*")):
        shutil.rmtree(p, ignore_errors=True)


# -------------------------------------------------------------------------------------------------- plan


@dataclass
class Sources:
    weights: Snapshot
    route: str  # "vllm" or "official"
    vision: Snapshot | None = None
    vision_layout: str | None = None  # "hf" (model.visual.*) or "mlx" (vision_tower.*)
    mtp: Snapshot | None = None

    def keys(self, opts: Options) -> dict:
        w = {"route": self.route, "repo": self.weights.repo, "commit": self.weights.commit}
        v = None if self.vision is None else {"repo": self.vision.repo, "commit": self.vision.commit,
                                              "layout": self.vision_layout}
        head = None if self.mtp is None else {"repo": self.mtp.repo, "commit": self.mtp.commit,
                                              "file": opts.mtp_file}
        e = None if not opts.embed_export else {"weights": w, "hot_vocab": opts.hot_vocab,
                                                "token_counts_sha256": opts.counts_sha256()}
        return {"weights": w, "vision": v, "mtp": {"weights": w, "head": head}, "embed": e,
                "config": {"weights": w, "vision": v, "format": MANIFEST_FORMAT}}


@dataclass
class Plan:
    build: set[str]
    reuse: set[str]
    downloads: list[tuple[Snapshot, str]] = field(default_factory=list)
    convert_pack: bool = False  # official route: MLX pack -> prism_ternary in the store


def card_base_models(card: str) -> list[str]:
    """`base_model:` of a model card's YAML front matter (a string or a list), without a YAML parser: the
    Hub writes it as `base_model: org/name` or as a `- org/name` list under it."""
    lines = card.splitlines()
    if not lines or lines[0].strip() != "---":
        return []
    out: list[str] = []
    inside = False
    for line in lines[1:]:
        if line.strip() == "---":
            break
        if line.startswith("base_model:"):
            value = line.split(":", 1)[1].strip().strip("'\"")
            if value:
                out.append(value)
            inside = not value
        elif inside and line.lstrip().startswith("- "):
            out.append(line.lstrip()[2:].strip().strip("'\""))
        elif inside and line and not line.startswith(" "):
            inside = False
    return out


class Builder:
    """One run of bonsai-fetch over `opts` (see the module docstring)."""

    def __init__(self, opts: Options, log: Callable[[str], None] = print) -> None:
        self.opts = opts
        self.out = Path(opts.out).absolute()
        self.log = log
        self.hub = Hub(endpoint=opts.endpoint, token=opts.token, store=opts.store, retries=opts.retries, log=log,
                       progress=opts.progress)
        self.bar = progress_bar(opts.progress)

    # ------------------------------------------------------------------------------- sources and plan

    def resolve(self) -> Sources:
        o = self.opts
        route, weights = "vllm", None
        if o.source in ("auto", "vllm"):
            try:
                weights = self.hub.snapshot(o.model_repo, o.model_revision)
            except (NotFoundError, AuthError) as e:
                # Only an upload that is gone or refused falls back; a wrong revision is the user's to fix.
                if o.source == "vllm" or (isinstance(e, NotFoundError) and e.missing != "repo"):
                    raise
                self.log(f"the vLLM upload is unavailable ({e.kind}: {o.model_repo}); building the same checkpoint "
                         f"from PrismML's official pack {o.official_repo}")
        if weights is None:
            route, weights = "official", self.hub.snapshot(o.official_repo, o.official_revision)
        src = Sources(weights=weights, route=route)
        if o.vision_repo:
            src.vision = self.hub.snapshot(o.vision_repo, o.vision_revision)
            if o.vision_check:
                self.check_vision_lineage(src)
        if o.mtp_repo:
            local = o.mtp_repo.startswith(("/", ".", "~")) or Path(o.mtp_repo).is_dir()
            src.mtp = (self.hub.local_snapshot(Path(o.mtp_repo)) if local
                       else self.hub.snapshot(o.mtp_repo, o.mtp_revision))
            self.hub.require(src.mtp, o.mtp_file)
        return src

    def base_models(self, snap: Snapshot) -> list[str]:
        """The `base_model` entries of a repo's model card (README.md front matter), [] without any."""
        if "README.md" not in snap.files:
            return []
        return card_base_models(self.hub.fetch(snap, "README.md").read_text(errors="replace"))

    def check_vision_lineage(self, src: Sources) -> None:
        """Refuse a vision tower trained for another model. The weights' model card names its base model
        (Ternary-Bonsai-2-27B: Qwen3.8-27B); a tower is the model's own if its repo is that base, PrismML's
        pack of this model, or a repo whose card shares a base model with the weights. A Qwen3.5-27B tower
        passes every shape check (same architecture) and answers images through the wrong weights."""
        weights_bases = set(self.base_models(src.weights))
        vision = src.vision
        if not weights_bases or vision.repo in (src.weights.repo, self.opts.official_repo):
            if not weights_bases:
                self.log(f"note: {src.weights.label()} names no base_model in its model card; the vision tower "
                         f"from {vision.repo} is taken on trust")
            return
        related = {vision.repo} | set(self.base_models(vision))
        if related & weights_bases:
            return
        raise IncompatibleError(
            f"the vision tower in {vision.repo} does not belong to this model: {src.weights.repo} is built on "
            f"{', '.join(sorted(weights_bases))}, while {vision.repo} "
            f"{'is built on ' + ', '.join(sorted(related - {vision.repo})) if related - {vision.repo} else 'names no base model'}"
            f". Set BONSAI_VISION_REPO to {sorted(weights_bases)[0]} or to PrismML's pack "
            f"({self.opts.official_repo}), 'off' for a text-only model, or BONSAI_VISION_CHECK=0 to use it anyway.")

    def _index(self, snap: Snapshot) -> dict | None:
        if INDEX not in snap.files:
            return None
        return json.loads(self.hub.fetch(snap, INDEX).read_text())

    def _config(self, snap: Snapshot) -> dict:
        return json.loads(self.hub.fetch(snap, "config.json").read_text())

    def _shards(self, snap: Snapshot, index: dict | None, keep: Callable[[str], bool] | None = None) -> list[str]:
        if index is None:
            files = sorted(p for p in snap.files if p.endswith(".safetensors") and "/" not in p)
            if not files:
                raise IncompatibleError(f"{snap.label()} has no *.safetensors weights")
            return files
        return sorted({f for k, f in index["weight_map"].items() if keep is None or keep(k)})

    def converted_dir(self, snap: Snapshot) -> Path:
        return self.opts.store / "converted" / snap.repo.replace("/", "--") / snap.commit

    def weights_source_files(self, src: Sources, *, only_mtp: bool = False) -> tuple[list[tuple[Snapshot, str]], bool]:
        """(files to download, whether the pack must be converted) to have the weights source on disk."""
        snap = src.weights
        small = [(snap, p) for p in ["config.json", *_side_files(snap)] + ([INDEX] if INDEX in snap.files else [])]
        if src.route == "official":
            if self.converted_dir(snap).is_dir():
                return [], False
            index = self._index(snap)
            if index is None:
                raise IncompatibleError(f"{snap.label()}: the official pack has no {INDEX}")
            share_vision = src.vision is not None and src.vision.repo == snap.repo and src.vision.commit == snap.commit
            return small + [(snap, f) for f in pack_files_needed(index, vision=share_vision)], True
        index = self._index(snap)
        keep = (lambda k: k.startswith("mtp.")) if only_mtp else None
        return small + [(snap, f) for f in self._shards(snap, index, keep)], False

    def plan(self, src: Sources, existing: Existing | None) -> Plan:
        keys = src.keys(self.opts)
        old = existing.manifest["components"] if existing and not self.opts.force else {}
        reuse = {c for c in COMPONENTS if c in old and old[c] == keys[c] and c != "config"}
        build = set(COMPONENTS) - reuse
        if keys["embed"] is None:
            build.discard("embed")
        if keys["vision"] is None:
            build.discard("vision")
        plan = Plan(build=build, reuse=reuse)
        files: list[tuple[Snapshot, str]] = []
        if "weights" in build:
            more, plan.convert_pack = self.weights_source_files(src)
            files += more
        elif "mtp" in build and src.mtp is None:
            # Back to the checkpoint's own head while the weights stay: only its shards are needed.
            more, plan.convert_pack = self.weights_source_files(src, only_mtp=True)
            files += more
        if "vision" in build:
            files += self.vision_files(src)
        if "mtp" in build and src.mtp is not None:
            files.append((src.mtp, self.opts.mtp_file))
        seen = set()
        plan.downloads = [f for f in files if not ((f[0].repo, f[0].commit, f[1]) in seen
                                                    or seen.add((f[0].repo, f[0].commit, f[1])))]
        return plan

    def vision_files(self, src: Sources) -> list[tuple[Snapshot, str]]:
        snap = src.vision
        small = [(snap, "config.json")] + [(snap, p) for p in _PROCESSOR_FILES if p in snap.files]
        index = self._index(snap)
        if index is None:
            shards = self._shards(snap, None)
            src.vision_layout = src.vision_layout or "hf"
            return small + [(snap, f) for f in shards]
        keys = list(index["weight_map"])
        if any(k.startswith("model.visual.") for k in keys):
            src.vision_layout = "hf"
            shards = self._shards(snap, index, lambda k: k.startswith("model.visual."))
        elif any(k.startswith("vision_tower.") for k in keys):
            src.vision_layout = "mlx"
            shards = self._shards(snap, index, lambda k: k.startswith("vision_tower."))
        else:
            raise IncompatibleError(f"{snap.label()} has no vision tower (no model.visual.* or vision_tower.* "
                                    f"tensors in {INDEX}); set BONSAI_VISION_REPO to the base model, or 'off'")
        return small + [(snap, INDEX)] + [(snap, f) for f in shards]

    # ------------------------------------------------------------------------------------------- disk

    def check_disk(self, needs: list[tuple[Path, int]], stage: str) -> None:
        """Stop before writing when a filesystem lacks room for `needs` (path, bytes) plus a margin."""
        by_dev: dict[int, list] = {}
        for path, n in needs:
            anchor = _anchor(path)
            by_dev.setdefault(os.stat(anchor).st_dev, [anchor, 0])[1] += n
        for anchor, n in by_dev.values():
            if n <= 0:
                continue
            want = n + max(64 << 20, n // 50)  # 2% or 64 MiB of margin: filesystems need room to breathe
            free = self.opts.free_bytes_override
            if free is None:
                free = shutil.disk_usage(anchor).free
            if free < want:
                raise DiskSpaceError(
                    f"not enough free disk on {anchor} {stage}: this run needs about {_fmt(want)} there "
                    f"({_fmt(n)} plus margin) but {_fmt(free)} is free. Free some space, or put the output "
                    "directory / BONSAI_FETCH_CACHE on a larger disk, and run again. Nothing was changed.")

    def estimate(self, src: Sources, plan: Plan) -> list[tuple[Path, int]]:
        """Bytes this run writes, per place, before anything large is downloaded (vision added later)."""
        store, out = self.opts.store, self.out
        needs = [(store, sum(self.hub.bytes_to_download(s, [p]) for s, p in plan.downloads))]
        shard_bytes = sum(s.files[p].size or 0 for s, p in plan.downloads
                          if s is src.weights and p.endswith(".safetensors"))
        if plan.convert_pack:
            needs.append((store, shard_bytes))  # the converted checkpoint in the store, linked into OUT
        elif "weights" in plan.build and not _same_device(store, out):
            needs.append((out, shard_bytes))
        if "mtp" in plan.build and src.mtp is not None:
            needs.append((out, src.mtp.files[self.opts.mtp_file].size or 0))
        if "embed" in plan.build:
            text = text_part(self._config(src.weights))
            needs.append((out, int(text.get("vocab_size", 0)) * int(text.get("hidden_size", 0)) * 2))
        return needs

    def exact_needs(self, src: Sources, plan: Plan, weights_dir: Path | None) -> list[tuple[Path, int]]:
        """Bytes the build writes into OUT's filesystem, from the headers now on disk (links cost nothing)."""
        out, total = self.out, 0
        if "weights" in plan.build and weights_dir is not None:
            linkable = _same_device(weights_dir, out)
            for shard in sorted(weights_dir.glob("*.safetensors")):
                refs = st.read_header(shard)
                kept = [r for n, r in refs.items() if weight_name(n) is not None]
                unchanged = len(kept) == len(refs) and all(weight_name(n) == n for n in refs)
                if kept and not (unchanged and linkable):
                    total += sum(r.nbytes for r in kept)
            total += sum(r.nbytes for shard in weights_dir.glob("*.safetensors")
                         for n, r in st.read_header(shard).items() if n.startswith("mtp."))
        if "vision" in plan.build:
            vdir = self.hub.snapshot_dir(src.vision)
            total += sum(r.nbytes for shard in vdir.glob("*.safetensors") for n, r in st.read_header(shard).items()
                         if n.startswith(("model.visual.", "vision_tower.")))
        if "mtp" in plan.build and src.mtp is not None:
            total += self.hub.local_path(src.mtp, self.opts.mtp_file).stat().st_size
        if "embed" in plan.build:
            total += sum(e for p, e in self.estimate(src, Plan(build={"embed"}, reuse=set())) if p == out)
        return [(out, total)]

    # ------------------------------------------------------------------------------------------- run

    def run(self) -> int:
        o = self.opts
        with locked(self.out):
            clean_leftovers(self.out, self.log)
            self.refuse_foreign_directory()
            existing = load_existing(self.out)
            request = o.request()
            if existing and not o.force and existing.manifest["request"] == request and existing.pinned():
                return self.up_to_date(existing, "same options, every source pinned to a commit")
            try:
                src = self.resolve()
            except NetworkError as e:
                if existing and not o.force and existing.manifest["request"] == request:
                    self.log(f"warning: {e}")
                    return self.up_to_date(existing, "the Hub could not be asked for updates; keeping what is there")
                raise
            if src.vision is not None:
                self.vision_files(src)  # learn the vision layout (part of the component key)
            keys = src.keys(o)
            if existing and not o.force and existing.manifest["components"] == keys:
                return self.up_to_date(existing, "the sources have not moved")
            plan = self.plan(src, existing)
            needs = self.estimate(src, plan)
            self.check_disk(needs, "before downloading")
            self.log(self.describe(src, plan))
            if o.dry_run:
                return 0
            for snap, path in plan.downloads:
                self.hub.fetch(snap, path)
            weights_dir = self.prepare_weights_source(src, plan)
            self.check_disk(self.exact_needs(src, plan, weights_dir), "before writing the model directory")
            self.build(src, plan, keys, existing, weights_dir)
            if o.prune_cache:
                shutil.rmtree(o.store, ignore_errors=True)
                self.log(f"removed the download cache {o.store}")
        return 0

    def refuse_foreign_directory(self) -> None:
        """OUT is replaced wholesale: never do that to a directory bonsai-fetch did not write."""
        if self.out.exists() and (not self.out.is_dir() or (any(self.out.iterdir())
                                                             and not (self.out / MANIFEST).is_file())):
            raise UsageError(f"{self.out} exists and was not written by bonsai-fetch (no {MANIFEST}); it would be "
                             "replaced. Point BONSAI_MODEL_DIR / --out at a new or empty directory, or move it away")

    def describe(self, src: Sources, plan: Plan) -> str:
        todo = sorted(plan.build - {"config"})
        head = f"{src.mtp.label()}:{self.opts.mtp_file}" if src.mtp else "the checkpoint's own head"
        lines = [f"preparing {self.out}",
                 f"  weights: {src.weights.label()} ({'vLLM upload' if src.route == 'vllm' else 'official MLX pack'})",
                 f"  vision:  {src.vision.label() if src.vision else 'off (text only)'}",
                 f"  mtp:     {head}",
                 f"  embed:   {'hot ' + str(self.opts.hot_vocab) if self.opts.embed_export else 'no SSD export'}",
                 f"  build {', '.join(todo) or 'config only'}; reuse {', '.join(sorted(plan.reuse)) or 'nothing'}; "
                 f"download {len(plan.downloads)} files, "
                 f"{_fmt(sum(self.hub.bytes_to_download(s, [p]) for s, p in plan.downloads))}"]
        return "\n".join(lines)

    def up_to_date(self, existing: Existing, why: str) -> int:
        if self.opts.verify:
            bad = [rel for rel, e in existing.manifest["files"].items()
                   if sha256_file(self.out / rel) != e["sha256"]]
            if bad:
                raise ChecksumError(f"{len(bad)} files in {self.out} no longer match the manifest's sha256 (e.g. "
                                    f"{bad[:3]}); run bonsai-fetch --force to rebuild them")
            self.log(f"verified {len(existing.manifest['files'])} files against the manifest")
        self.log(f"{self.out} is up to date ({why}); nothing to do")
        return 0

    # ------------------------------------------------------------------------------------------ build

    def prepare_weights_source(self, src: Sources, plan: Plan) -> Path | None:
        """The directory of the prism_ternary weights source (store snapshot, or the converted pack)."""
        if src.route == "official":
            conv = self.converted_dir(src.weights)
            if plan.convert_pack and not conv.is_dir():
                self.log(f"converting the official pack {src.weights.label()} to prism_ternary")
                try:
                    convert_mlx_pack(self.hub.snapshot_dir(src.weights), conv, include_vision=False,
                                     max_shard_bytes=2 * 10**9, progress=self.opts.progress)
                except OfficialPackError as e:
                    raise IncompatibleError(f"{src.weights.label()}: {e}") from None
            return conv if conv.is_dir() else None
        snap_dir = self.hub.snapshot_dir(src.weights)
        return snap_dir if (snap_dir / "config.json").is_file() else None

    def build(self, src: Sources, plan: Plan, keys: dict, existing: Existing | None,
              weights_dir: Path | None) -> None:
        with atomic_directory(self.out, overwrite=True) as tmp:
            placed: dict[str, str] = {}  # relative path -> component
            reused_sha: dict[str, str] = {}

            def reuse(component: str) -> None:
                for rel in existing.files(component):
                    _place(existing.root / rel, tmp / rel)
                    placed[rel] = component
                    reused_sha[rel] = existing.manifest["files"][rel]["sha256"]

            if "weights" in plan.reuse:
                reuse("weights")
            else:
                self.build_weights(src, weights_dir, tmp, placed)
            if "vision" in plan.reuse:
                reuse("vision")
            elif "vision" in plan.build:
                self.build_vision(src, tmp, placed)
            if "mtp" in plan.reuse:
                reuse("mtp")
            else:
                # The original head comes from the weights source when this run built the weights or needs
                # the original back; otherwise the current OUT's head stands in for its signature.
                use_source = "weights" in plan.build or src.mtp is None
                self.build_mtp(src, weights_dir if use_source else None, tmp, placed, existing)
            if "embed" in plan.reuse:
                reuse("embed")
            elif "embed" in plan.build:
                self.build_embed(tmp, placed)
            self.build_config(src, tmp, placed)
            self.write_manifest(tmp, src, keys, placed, reused_sha)
        built = sorted(plan.build - {"config"})
        self.log(f"{self.out} is ready: built {', '.join(built) or 'config'}"
                 + (f", reused {', '.join(sorted(plan.reuse))}" if plan.reuse else ""))

    def build_weights(self, src: Sources, weights_dir: Path | None, tmp: Path, placed: dict[str, str]) -> None:
        if weights_dir is None:
            raise FetchError("internal: the weights source is not on disk")
        cfg = json.loads((weights_dir / "config.json").read_text())
        qcfg = check_prism_config(cfg, src.weights.label())
        index_path = weights_dir / INDEX
        shards = (sorted(set(json.loads(index_path.read_text())["weight_map"].values())) if index_path.is_file()
                  else sorted(p.name for p in weights_dir.glob("*.safetensors")))
        reserved = {VISUAL_FILE, MTP_FILE}
        bar = self.bar(shards, desc="language model shards", unit="shard")
        for shard in bar:
            refs = st.read_header(weights_dir / shard)
            check_ternary_headers(refs, qcfg, f"{src.weights.label()}/{shard}")
            kept = {new: ref for name, ref in refs.items() if (new := weight_name(name)) is not None}
            if not kept:
                continue
            name = f"weights-{shard}" if shard in reserved else shard
            if all(kept.get(n) is r for n, r in refs.items()):  # nothing renamed or dropped: the file as it is
                _place(weights_dir / shard, tmp / name)
            else:
                st.write(tmp / name, kept)
            placed[name] = "weights"
        if EMBED_NAME not in {n for p, c in placed.items() if c == "weights" for n in st.read_header(tmp / p)}:
            raise IncompatibleError(f"{src.weights.label()}: no {EMBED_NAME} (or model.embed_tokens.weight) in the "
                                    "checkpoint; it is not a Qwen3.5 language model")
        for rel in sorted(p.name for p in weights_dir.iterdir()):
            if (weights_dir / rel).is_file() and rel in self._side_names(weights_dir):
                _place(weights_dir / rel, tmp / rel)
                placed[rel] = "weights"
        (tmp / META_DIR).mkdir(exist_ok=True)
        shutil.copyfile(weights_dir / "config.json", tmp / META_DIR / "weights.config.json")
        placed[f"{META_DIR}/weights.config.json"] = "weights"

    @staticmethod
    def _side_names(d: Path) -> set[str]:
        return {p.name for p in d.iterdir() if p.is_file() and p.name not in ("config.json", INDEX)
                and not p.name.startswith(".") and not p.name.endswith((".safetensors", ".incomplete"))
                and (p.name.endswith(_SIDE_SUFFIXES) or p.name.startswith(("LICENSE", "NOTICE")))}

    def build_vision(self, src: Sources, tmp: Path, placed: dict[str, str]) -> None:
        snap = src.vision
        vdir = self.hub.snapshot_dir(snap)
        vcfg = json.loads((vdir / "config.json").read_text())
        index = json.loads((vdir / INDEX).read_text()) if (vdir / INDEX).is_file() else None
        prefix = "model.visual." if src.vision_layout == "hf" else "vision_tower."
        shards = self._shards(snap, index, lambda k: k.startswith(prefix))
        if src.vision_layout == "hf":
            tensors: dict = {}
            for shard in shards:
                tensors.update({n: r for n, r in st.read_header(vdir / shard).items() if n.startswith(prefix)})
        else:
            try:
                tensors = read_vision_tensors([vdir / s for s in shards], vcfg)
            except OfficialPackError as e:
                raise IncompatibleError(f"{snap.label()}: {e}") from None
        if not tensors:
            raise IncompatibleError(f"{snap.label()}: no vision tensors found in {shards}")
        st.write(tmp / VISUAL_FILE, tensors)
        placed[VISUAL_FILE] = "vision"
        for name in _PROCESSOR_FILES:
            if (vdir / name).is_file():
                _place(vdir / name, tmp / name)
                placed[name] = "vision"  # the vision source's processor settings go with its tower
        (tmp / META_DIR).mkdir(exist_ok=True)
        shutil.copyfile(vdir / "config.json", tmp / META_DIR / "vision.config.json")
        placed[f"{META_DIR}/vision.config.json"] = "vision"

    def _original_mtp(self, weights_dir: Path | None, existing: Existing | None
                      ) -> tuple[dict[str, st.TensorRef], bool]:
        """The checkpoint's own MTP head (tensor refs), and whether they are the original (not a swapped one)."""
        if weights_dir is not None:
            refs: dict[str, st.TensorRef] = {}
            for shard in sorted(weights_dir.glob("*.safetensors")):
                refs.update({n: r for n, r in st.read_header(shard).items() if n.startswith("mtp.")})
            return refs, True
        if existing and MTP_FILE in existing.manifest["files"]:
            # Same names, shapes and dtypes as the original by construction (a swap is checked against it).
            return st.read_header(existing.root / MTP_FILE), False
        return {}, True

    def build_mtp(self, src: Sources, weights_dir: Path | None, tmp: Path, placed: dict[str, str],
                  existing: Existing | None) -> None:
        original, is_original = self._original_mtp(weights_dir, existing)
        if src.mtp is None:
            if not original:
                self.log("note: the checkpoint has no MTP head (mtp.*): MTP speculative decoding will not be "
                         "available")
                return
            if not is_original:
                raise FetchError("internal: the checkpoint's own MTP head is not on disk")
            st.write(tmp / MTP_FILE, original)
        else:
            head_path = self.hub.local_path(src.mtp, self.opts.mtp_file)
            where = f"{src.mtp.repo}/{self.opts.mtp_file}"
            try:
                head = st.read_header(head_path)
            except st.SafetensorsError as e:
                raise IncompatibleError(f"{where}: {e}; the MTP head must be a safetensors file of mtp.* tensors") \
                    from None
            check_mtp_head(head, mtp_signature(original), where)
            st.write(tmp / MTP_FILE, head)
            self.log(f"MTP head replaced by {where} ({len(head)} tensors checked: names, shapes, dtypes)")
        placed[MTP_FILE] = "mtp"

    def build_embed(self, tmp: Path, placed: dict[str, str]) -> None:
        o = self.opts
        counts = read_token_counts(o.token_counts) if o.token_counts else None
        for rel, comp in placed.items():
            if comp == "weights" and rel.endswith(".safetensors"):
                refs = st.read_header(tmp / rel)
                name = next((n for n in EMBED_TENSOR_NAMES if n in refs), None)
                if name is not None:
                    with safe_open(tmp / rel, framework="pt") as f:
                        table = f.get_tensor(name)
                    break
        else:
            raise IncompatibleError("no embed_tokens tensor in the language model shards")
        how = f"by the token counts in {o.token_counts}" if counts else "lowest ids (no counts file)"
        self.log(f"exporting the embedding table {list(table.shape)} for SSD lookup "
                 f"(hot {min(o.hot_vocab, table.shape[0])}, {how})")
        export_embedding_table(table, tmp / EMBED_DIR, tensor_name=name, hot_size=o.hot_vocab, token_counts=counts)
        del table
        for p in sorted((tmp / EMBED_DIR).iterdir()):
            placed[f"{EMBED_DIR}/{p.name}"] = "embed"

    def build_config(self, src: Sources, tmp: Path, placed: dict[str, str]) -> None:
        weights_cfg = json.loads((tmp / META_DIR / "weights.config.json").read_text())
        vision_cfg = None
        if src.vision is not None:
            vision_cfg = json.loads((tmp / META_DIR / "vision.config.json").read_text())
            check_vision_tokens(vision_cfg, tmp / "tokenizer.json")
        config = assemble_config(weights_cfg, vision_cfg)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        placed["config.json"] = "config"
        weight_map, total = {}, 0
        for rel in sorted(r for r in placed if r.endswith(".safetensors") and "/" not in r):
            for name, ref in st.read_header(tmp / rel).items():
                if name in weight_map:
                    raise IncompatibleError(f"tensor {name} is in both {weight_map[name]} and {rel}")
                weight_map[name] = rel
                total += ref.nbytes
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        placed[INDEX] = "config"

    def write_manifest(self, tmp: Path, src: Sources, keys: dict, placed: dict[str, str],
                       reused_sha: dict[str, str]) -> None:
        o = self.opts
        files = {}
        todo = sorted(placed)
        new_bytes = sum((tmp / rel).stat().st_size for rel in todo if rel not in reused_sha)
        with self.bar(total=new_bytes, desc="sha256 of the output", unit="B", unit_scale=True) as bar:
            for rel in todo:
                path = tmp / rel
                files[rel] = {"size": path.stat().st_size, "component": placed[rel],
                              "sha256": reused_sha.get(rel) or sha256_file(path, bar.update)}
        sources = {"weights": {"route": src.route, "repo": src.weights.repo, "revision": src.weights.revision,
                               "commit": src.weights.commit},
                   "vision": None if src.vision is None else {"repo": src.vision.repo, "revision": src.vision.revision,
                                                              "commit": src.vision.commit,
                                                              "layout": src.vision_layout},
                   "mtp": None if src.mtp is None else {"repo": src.mtp.repo, "revision": src.mtp.revision,
                                                        "commit": src.mtp.commit, "file": o.mtp_file}}
        manifest = {"format": MANIFEST_FORMAT, "tool": f"bonsai-fetch {__version__}",
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "endpoint": o.endpoint, "request": o.request(), "sources": sources, "components": keys,
                    "embed": None if not o.embed_export else {"dir": EMBED_DIR, "hot_vocab": o.hot_vocab,
                                                              "token_counts": str(o.token_counts or "") or None},
                    "files": files}
        raw = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
        (tmp / MANIFEST).write_bytes(raw)
        # The marker last: it vouches for this exact manifest, so a torn write can never look complete.
        (tmp / MARKER).write_text(hashlib.sha256(raw).hexdigest() + "\n")
        for p in (tmp / MANIFEST, tmp / MARKER):
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def tensors_of(out: Path) -> dict[str, torch.Tensor]:
    """All tensors of an output directory by name (tests and debugging)."""
    index = json.loads((Path(out) / INDEX).read_text())
    result = {}
    for rel in sorted(set(index["weight_map"].values())):
        with safe_open(Path(out) / rel, framework="pt") as f:
            result.update({k: f.get_tensor(k) for k in f.keys()})
    return result
