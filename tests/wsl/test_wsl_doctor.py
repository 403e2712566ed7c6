"""wsl/doctor against recorded hosts: each profile below is one PC the field reports describe."""

from __future__ import annotations

import json

import pytest

from wslfakes import FakeHost

WSL_KERNEL = ("Linux version 6.6.87.2-microsoft-standard-WSL2 (root@439a258ad544) (gcc (GCC) 11.2.0, "
              "GNU ld (GNU Binutils) 2.37) #1 SMP PREEMPT_DYNAMIC Thu Jun  5 18:30:46 UTC 2025")
OLD_WSL_KERNEL = ("Linux version 4.19.104-microsoft-standard (oe-user@oe-host) (gcc version 8.2.0 (GCC)) "
                  "#1 SMP Wed Feb 19 06:37:35 UTC 2020")
WSL1_KERNEL = ("Linux version 4.4.0-19041-Microsoft (Microsoft@Microsoft.com) (gcc version 5.4.0 (GCC) ) "
               "#3996-Microsoft Thu Jan 01 00:00:00 PST 2020")
PLAIN_LINUX = ("Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) (x86_64-linux-gnu-gcc-13 "
               "(Ubuntu 13.2.0-23ubuntu4) 13.2.0) #45-Ubuntu SMP PREEMPT_DYNAMIC Fri Aug 30 12:02:04 UTC 2024")

RTX = "NVIDIA GeForce RTX 5070"
# index, name, gen cur, gen max, width cur, width max, MiB total, MiB used, driver
GPU0_X16 = (0, RTX, 4, 4, 16, 16, 12227, 512, "581.57")
GPU1_X16 = (1, RTX, 4, 4, 16, 16, 12227, 180, "581.57")
GPU1_X4 = (1, RTX, 4, 4, 4, 4, 12227, 180, "581.57")   # B760 chipset slot (report 000 §6, docs/field-reports.md)

SMI_HEADER = """Sat Nov 29 09:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.102.01             Driver Version: {driver}         CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|=========================================+========================+======================|
|   0  NVIDIA GeForce RTX 5070        On  |   00000000:01:00.0  On |                  N/A |
+-----------------------------------------+------------------------+----------------------+
"""

QUERY = ("--query-gpu=index,name,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
         "pcie.link.width.max,memory.total,memory.used,driver_version")

NVIDIA_RUNTIMES = ('{"io.containerd.runc.v2":{"path":"runc","status":{}},'
                   '"nvidia":{"path":"nvidia-container-runtime","status":{}},"runc":{"path":"runc","status":{}}}')
PLAIN_RUNTIMES = '{"io.containerd.runc.v2":{"path":"runc","status":{}},"runc":{"path":"runc","status":{}}}'

GB = 1_000_000_000


def smi_rows(gpus) -> str:
    return "".join(", ".join(str(v) for v in gpu) + "\n" for gpu in gpus)


def make_host(host: FakeHost, *, version=WSL_KERNEL, gpus=(GPU0_X16, GPU1_X16), cuda="13.0",
              ptrace="0", runtimes=NVIDIA_RUNTIMES, docker_os="Ubuntu 24.04.1 LTS",
              avail_kb=400_000_000, df_fs="/dev/sdd", mem_kb=65_000_000, in_container="0",
              windows_free=None, capeff="000001ffffffffff") -> FakeHost:
    host.write_proc(version, mem_kb=mem_kb, ptrace=ptrace, capeff=capeff)
    if gpus is not None:
        driver = gpus[0][8] if gpus else "581.57"
        host.fake("nvidia-smi", [
            {"contains": ["--query-gpu="], "stdout": smi_rows(gpus)},
            {"args": [], "stdout": SMI_HEADER.format(driver=driver, cuda=cuda)},
        ])
    if runtimes is not None:
        host.fake("docker", [
            {"contains": ["info", "{{json .Runtimes}}"], "stdout": runtimes + "\n"},
            {"contains": ["info", "{{.OperatingSystem}}"], "stdout": docker_os + "\n"},
            {"args": ["compose", "version"], "stdout": "Docker Compose version v2.29.7\n"},
        ])
    host.fake("df", [{"stdout": "Filesystem     1024-blocks      Used Available Capacity Mounted on\n"
                                f"{df_fs}      1055762868 123456789 {avail_kb}      13% /\n"}])
    if windows_free is not None:
        host.fake("powershell.exe", [{"contains": ["-EncodedCommand", "Get-PSDrive"],
                                      "stdout": f"C {windows_free}\r\n"}])
    cdi = host.tmp / "cdi"
    cdi.mkdir(exist_ok=True)
    host.env.update({
        "DOCTOR_PROC": str(host.proc),
        "DOCTOR_ROOT": str(host.root),
        "DOCTOR_IN_CONTAINER": in_container,
        "DOCTOR_WSL_LIB": str(host.tmp / "wsl-lib"),
        "DOCTOR_CDI_DIRS": str(cdi),
        "DOCTOR_MODEL_DIR": str(host.tmp / "models"),
        "WSL_DISTRO_NAME": "Ubuntu",
    })
    return host


def doctor(host: FakeHost, *args, **env):
    return host.run("doctor", *args, env={k: str(v) for k, v in env.items()})


# --- the recorded hosts -----------------------------------------------------------------------

def test_good_host_every_check_ok(host):
    r = doctor(make_host(host, windows_free=300 * GB))
    assert r.rc == 0, r.out + r.err
    assert [f for f in r.findings if f[0] in ("WARN", "FAIL")] == []
    for check in ("platform", "gpus", "driver", "kernel", "ptrace", "docker", "compose", "disk",
                  "disk.win", "memory"):
        assert r.statuses(check) == ["OK"], (check, r.out)
    assert r.statuses("pcie") == ["OK", "OK"]
    assert r.statuses("vram") == ["OK", "OK"]
    assert "2 GPUs seen" in r.finding("gpus")[2]
    assert "CUDA 13.0" in r.finding("driver")[2]
    assert r.out.rstrip().endswith("summary: 14 OK, 0 WARN, 0 FAIL, 0 SKIP")
    # the exact query the brief asks for
    assert [QUERY, "--format=csv,noheader,nounits"] in host.calls("nvidia-smi")
    assert ["info", "--format", "{{json .Runtimes}}"] in host.calls("docker")


def test_second_gpu_on_x4_link_warns(host):
    r = doctor(make_host(host, gpus=(GPU0_X16, GPU1_X4)))
    assert r.rc == 0
    status, _, text = r.finding("pcie", "GPU 1 ")
    assert status == "WARN"
    assert "x4" in text and "TP=2" in text and "report 000" in text
    assert "CPU-attached slot" in text and "x8/x8" in text
    assert r.finding("pcie", "GPU 0 ")[0] == "OK"


def test_idle_link_generation_drop_is_not_a_warning(host):
    idle = (1, RTX, 1, 4, 16, 16, 12227, 5, "581.57")   # Gen1 while idle, x16 wired
    r = doctor(make_host(host, gpus=(GPU0_X16, idle)))
    status, _, text = r.finding("pcie", "GPU 1 ")
    assert status == "OK"
    assert "idle" in text and "Gen4 x16" in text


def test_link_narrower_than_possible_warns(host):
    x8 = (1, RTX, 4, 4, 8, 16, 12227, 5, "581.57")
    r = doctor(make_host(host, gpus=(GPU0_X16, x8)))
    status, _, text = r.finding("pcie", "GPU 1 ")
    assert status == "WARN"
    assert "x8 although x16" in text


def test_pcie_not_reported_warns_without_crashing(host):
    na = (1, RTX, "[N/A]", "[N/A]", "[N/A]", "[N/A]", 12227, 5, "581.57")
    r = doctor(make_host(host, gpus=(GPU0_X16, na)))
    assert r.rc == 0
    status, _, text = r.finding("pcie", "GPU 1 ")
    assert status == "WARN" and "not reported" in text


def test_old_wsl_kernel_fails_pinned_memory(host):
    r = doctor(make_host(host, version=OLD_WSL_KERNEL))
    assert r.rc == 1
    status, _, text = r.finding("kernel")
    assert status == "FAIL"
    assert "4.19.104" in text and "4.19.121" in text and "VLLM_WSL2_ENABLE_PIN_MEMORY" in text
    assert "wsl.exe --update" in text


def test_kernel_exactly_at_minimum_is_ok(host):
    version = OLD_WSL_KERNEL.replace("4.19.104", "4.19.121")
    r = doctor(make_host(host, version=version))
    assert r.finding("kernel")[0] == "OK"


def test_ptrace_scope_1_fails_with_fix(host):
    r = doctor(make_host(host, ptrace="1"))
    assert r.rc == 1
    status, _, text = r.finding("ptrace")
    assert status == "FAIL"
    assert "ptrace_scope = 1" in text and "pidfd_getfd" in text
    assert "wsl/setup-host" in text and "sysctl -w kernel.yama.ptrace_scope=0" in text


def test_missing_docker_gpu_runtime_fails(host):
    r = doctor(make_host(host, runtimes=PLAIN_RUNTIMES))
    assert r.rc == 1
    status, _, text = r.finding("docker")
    assert status == "FAIL"
    assert "no nvidia runtime" in text and "nvidia-container-toolkit" in text
    assert "nvidia-ctk runtime configure" in text


def test_nvidia_cdi_spec_is_enough(host):
    make_host(host, runtimes=PLAIN_RUNTIMES)
    (host.tmp / "cdi" / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    r = doctor(host)
    status, _, text = r.finding("docker")
    assert status == "OK" and "CDI" in text


def test_docker_desktop_counts_as_gpu_capable(host):
    r = doctor(make_host(host, runtimes=PLAIN_RUNTIMES, docker_os="Docker Desktop"))
    status, _, text = r.finding("docker")
    assert status == "OK" and "Docker Desktop" in text


def test_docker_missing_fails(host):
    r = doctor(make_host(host, runtimes=None))
    assert r.rc == 1
    status, _, text = r.finding("docker")
    assert status == "FAIL" and "docker not found" in text


def test_docker_daemon_down_fails(host):
    make_host(host)
    host.fake("docker", [{"contains": ["info"], "rc": 1,
                          "stderr": "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
                                    "Is the docker daemon running?\n"},
                         {"args": ["compose", "version"], "stdout": "Docker Compose version v2.29.7\n"}])
    r = doctor(host)
    status, _, text = r.finding("docker")
    assert status == "FAIL" and "Cannot connect" in text and "service docker start" in text


def test_display_gpu_with_3gb_used_warns(host):
    display = (0, RTX, 4, 4, 16, 16, 12227, 3072, "581.57")
    r = doctor(make_host(host, gpus=(display, GPU1_X16)))
    assert r.rc == 0
    status, _, text = r.finding("vram", "GPU 0 ")
    assert status == "WARN"
    assert "3072 MiB" in text and "30%" in text and "report 002" in text
    assert "model server is already running" not in text
    assert r.finding("vram", "GPU 1 ")[0] == "OK"


def test_vram_threshold_is_configurable(host):
    display = (0, RTX, 4, 4, 16, 16, 12227, 3072, "581.57")
    r = doctor(make_host(host, gpus=(display, GPU1_X16)), DOCTOR_VRAM_USED_WARN_MIB=4096)
    assert r.statuses("vram") == ["OK", "OK"]


def test_both_gpus_full_hints_at_running_server(host):
    full = [(i, RTX, 4, 4, 16, 16, 12227, 11000, "581.57") for i in (0, 1)]
    r = doctor(make_host(host, gpus=full))
    assert r.statuses("vram") == ["WARN", "WARN"]
    assert "model server is already running" in r.finding("vram", "GPU 0 ")[2]


def test_small_gpu_warns(host):
    small = (1, "NVIDIA GeForce RTX 4060", 4, 4, 8, 8, 8188, 100, "581.57")
    r = doctor(make_host(host, gpus=(GPU0_X16, small)))
    status, _, text = r.finding("vram", "only 8188 MiB")
    assert status == "WARN"


def test_not_wsl_skips_wsl_only_checks(host):
    r = doctor(make_host(host, version=PLAIN_LINUX, windows_free=300 * GB))
    assert r.rc == 0, r.out
    status, _, text = r.finding("platform")
    assert status == "OK" and "not WSL" in text and "plain Linux" in text
    assert r.finding("kernel")[0] == "SKIP"
    assert r.statuses("disk.win") == []          # no Windows to ask
    assert host.calls("powershell.exe") == []


def test_wsl1_fails(host):
    r = doctor(make_host(host, version=WSL1_KERNEL))
    assert r.rc == 1
    status, _, text = r.finding("platform")
    assert status == "FAIL" and "WSL 1" in text and "--set-version" in text


def test_old_driver_fails(host):
    r = doctor(make_host(host, cuda="12.8"))
    assert r.rc == 1
    status, _, text = r.finding("driver")
    assert status == "FAIL" and "CUDA 12.8" in text and "13.0" in text and "on Windows" in text


def test_newer_cuda_than_needed_is_ok(host):
    r = doctor(make_host(host, cuda="13.10"))   # 13.10 > 13.0 (not a string compare)
    assert r.finding("driver")[0] == "OK"


def test_one_gpu_fails(host):
    r = doctor(make_host(host, gpus=(GPU0_X16,)))
    assert r.rc == 1
    status, _, text = r.finding("gpus")
    assert status == "FAIL" and "TP=2" in text and "Device Manager" in text
    r = doctor(make_host(host, gpus=(GPU0_X16,), version=PLAIN_LINUX))
    assert "lspci" in r.finding("gpus")[2] and "Windows" not in r.finding("gpus")[2]


def test_nvidia_smi_error_fails(host):
    make_host(host)
    host.fake("nvidia-smi", [{"rc": 9, "stdout": "NVIDIA-SMI has failed because it couldn't communicate "
                                                 "with the NVIDIA driver.\n"}])
    r = doctor(host)
    assert r.rc == 1
    status, _, text = r.finding("gpus")
    assert status == "FAIL" and "exit 9" in text and "couldn't communicate" in text


def test_missing_nvidia_smi_in_container_is_a_fail_not_a_crash(host):
    make_host(host, gpus=None, runtimes=None, in_container="1")
    r = doctor(host)
    assert r.rc == 1
    status, _, text = r.finding("gpus")
    assert status == "FAIL" and "nvidia-smi not found" in text
    assert "--gpus all" in text
    assert r.statuses("pcie") == ["SKIP"] and r.statuses("vram") == ["SKIP"]
    assert r.statuses("docker") == ["SKIP"]
    assert "summary:" in r.out


def test_nvidia_smi_found_in_wsl_lib_when_not_on_path(host):
    make_host(host, gpus=None)
    lib = host.tmp / "wsl-lib"
    lib.mkdir()
    host.fake("nvidia-smi", [{"contains": ["--query-gpu="], "stdout": smi_rows((GPU0_X16, GPU1_X16))},
                             {"args": [], "stdout": SMI_HEADER.format(driver="581.57", cuda="13.0")}])
    (host.bin / "nvidia-smi").rename(lib / "nvidia-smi")
    r = doctor(host)
    assert r.finding("gpus")[0] == "OK"


def test_container_detected_from_dockerenv(host):
    make_host(host, in_container="auto")
    (host.root / ".dockerenv").write_text("")
    r = doctor(host)
    assert "inside a container" in r.finding("platform")[2]
    assert r.statuses("docker") == ["SKIP"]


def test_container_without_sys_ptrace_fails(host):
    # Docker's default capability set: no CAP_SYS_PTRACE (bit 19)
    r = doctor(make_host(host, in_container="1", capeff="00000000a80425fb"),
               VLLM_WSL2_ENABLE_PIN_MEMORY=1)
    assert r.rc == 1
    status, _, text = r.finding("capability")
    assert status == "FAIL" and "SYS_PTRACE" in text and "cap_add" in text


def test_container_with_sys_ptrace_ok(host):
    r = doctor(make_host(host, in_container="1", capeff="00000000a80c25fb"),
               VLLM_WSL2_ENABLE_PIN_MEMORY=1)
    assert r.finding("capability")[0] == "OK"
    assert r.finding("env")[0] == "OK"
    assert r.rc == 0, r.out


def test_container_without_pin_memory_env_warns(host):
    r = doctor(make_host(host, in_container="1"))
    status, _, text = r.finding("env", "VLLM_WSL2_ENABLE_PIN_MEMORY")
    assert status == "WARN"


def test_expandable_segments_warns_on_wsl(host):
    r = doctor(make_host(host), PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    status, _, text = r.finding("env")
    assert status == "WARN" and "dxgkio_make_resident" in text


def test_low_disk_fails(host):
    r = doctor(make_host(host, avail_kb=20_000_000))   # 20.5 GB
    assert r.rc == 1
    status, _, text = r.finding("disk")
    assert status == "FAIL" and "20.5 GB" in text and "40 GB" in text


def test_disk_is_checked_where_docker_keeps_the_models_volume(host):
    # The model is written into the compose stack's volume, not into the repo: ask Docker where it is.
    make_host(host, avail_kb=20_000_000)
    volume = host.tmp / "docker" / "volumes" / "bonsai_models" / "_data"
    volume.mkdir(parents=True)
    rules = json.loads((host.fake_dir / "docker.json").read_text())
    host.fake("docker", [{"contains": ["volume", "inspect", "bonsai_models"], "stdout": f"{volume}\n"}] + rules)
    host.env.pop("DOCTOR_MODEL_DIR")  # the default: ask Docker
    r = doctor(host)
    status, _, text = r.finding("disk")
    assert status == "FAIL" and "Docker volume bonsai_models" in text and str(volume) in text
    assert ["-Pk", "--", str(volume)] in host.calls("df")


def test_disk_before_the_volume_exists_is_dockers_data_root(host):
    make_host(host)
    root = host.tmp / "var-lib-docker"
    root.mkdir()
    rules = json.loads((host.fake_dir / "docker.json").read_text())
    host.fake("docker", [{"contains": ["volume", "inspect"], "rc": 1, "stderr": "no such volume\n"},
                         {"contains": ["info", "{{.DockerRootDir}}"], "stdout": f"{root}\n"}] + rules)
    host.env.pop("DOCTOR_MODEL_DIR")  # the default: ask Docker
    r = doctor(host)
    status, _, text = r.finding("disk")
    assert status == "OK" and "data root" in text and ["-Pk", "--", str(root)] in host.calls("df")


def test_docker_desktop_volumes_cannot_be_checked_from_the_distro(host):
    make_host(host)
    rules = json.loads((host.fake_dir / "docker.json").read_text())
    host.fake("docker", [{"contains": ["volume", "inspect"], "rc": 1},
                         {"contains": ["info", "{{.DockerRootDir}}"], "stdout": "/var/lib/docker-desktop-vm\n"}] + rules)
    host.env.pop("DOCTOR_MODEL_DIR")  # the default: ask Docker
    status, _, text = doctor(host).finding("disk")
    assert status == "WARN" and "Docker Desktop" in text


def test_disk_threshold_and_model_dir_are_configurable(host):
    make_host(host, avail_kb=20_000_000)
    model_dir = host.tmp / "big" / "models"
    r = doctor(host, DOCTOR_MIN_DISK_GB=10, DOCTOR_MODEL_DIR=model_dir)
    assert r.finding("disk")[0] == "OK"
    # df is asked about the nearest existing parent of the (not yet created) model dir
    assert ["-Pk", "--", str(host.tmp)] in host.calls("df")


def test_model_dir_on_windows_drive_warns(host):
    r = doctor(make_host(host, df_fs="C:\\"), DOCTOR_MODEL_DIR="/mnt/c/models")
    status, _, text = r.finding("disk", "Windows drive")
    assert status == "WARN" and "9P" in text


def test_windows_drive_low_fails(host):
    r = doctor(make_host(host, windows_free=12 * GB))
    status, _, text = r.finding("disk.win")
    assert status == "FAIL" and "12.0 GB" in text
    assert r.rc == 1
    # the distro's name travels inside the encoded PowerShell script
    assert any('"Ubuntu"' in s for s in host.scripts("powershell.exe"))


def test_low_wsl_memory_warns_with_wslconfig_fix(host):
    r = doctor(make_host(host, mem_kb=16_000_000))
    assert r.rc == 0
    status, _, text = r.finding("memory")
    assert status == "WARN" and ".wslconfig" in text and "memory=" in text and "wsl.exe --shutdown" in text


def test_memory_of_a_32gb_wslconfig_is_ok(host):
    # memory=32GB shows as a little less than 32 GiB MemTotal
    r = doctor(make_host(host, mem_kb=32_600_000))
    assert r.finding("memory")[0] == "OK"


def test_json_output(host):
    r = doctor(make_host(host, ptrace="1", gpus=(GPU0_X16, GPU1_X4)), "--json")
    assert r.rc == 1
    data = json.loads(r.out)
    assert data["ok"] is False
    assert data["counts"]["FAIL"] == 1 and data["counts"]["WARN"] == 1
    by_check = {(f["check"], f["status"]) for f in data["findings"]}
    assert ("ptrace", "FAIL") in by_check and ("pcie", "WARN") in by_check
    fail = next(f for f in data["findings"] if f["status"] == "FAIL")
    assert "setup-host" in fail["fix"]


def test_help_and_bad_option(host):
    make_host(host)
    r = doctor(host, "--help")
    assert r.rc == 0 and "Usage: wsl/doctor" in r.out and "DOCTOR_PROC" in r.out
    r = doctor(host, "--bogus")
    assert r.rc == 2 and "unknown option" in r.err


@pytest.mark.parametrize("version", [WSL_KERNEL, PLAIN_LINUX])
def test_doctor_changes_nothing(host, version):
    make_host(host, version=version, ptrace="1")
    doctor(host)
    assert host.ptrace_file.read_text() == "1\n"
    assert not any(c[:1] == ["run"] for c in host.calls("docker"))
