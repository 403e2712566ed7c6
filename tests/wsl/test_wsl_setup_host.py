"""wsl/setup-host: asks first, persists ptrace_scope=0, suggests (and on request merges) .wslconfig."""

from __future__ import annotations

from wslfakes import FakeHost

WSL_VERSION = "Linux version 6.6.87.2-microsoft-standard-WSL2 (root@439a258ad544) #1 SMP"
PLAIN_LINUX = "Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP"
RAM_64GB = 68_719_476_736


def make_host(host: FakeHost, *, version=WSL_VERSION, ptrace="1", init="systemd",
              ram=RAM_64GB, profile="C:\\Users\\taro") -> FakeHost:
    host.write_proc(version, ptrace=ptrace, init=init)
    sysctl_dir = host.tmp / "sysctl.d"
    sysctl_dir.mkdir(exist_ok=True)
    # sysctl --system applies the files: the fake sets the kernel value like the real one would
    host.fake("sysctl", [{"args": ["--system"], "write": {str(host.ptrace_file): "0\n"},
                          "stdout": "* Applying /etc/sysctl.d/99-bonsai-ptrace.conf ...\n"
                                    "kernel.yama.ptrace_scope = 0\n"}])
    host.fake("powershell.exe", [{"contains": ["TotalPhysicalMemory"], "stdout": f"{ram}\r\n{profile}\r\n"}])
    host.fake("wslpath", [{"args": ["-u", profile], "stdout": str(host.tmp / "winhome") + "\n"}])
    (host.tmp / "winhome").mkdir(exist_ok=True)
    host.env.update({"SETUP_PROC": str(host.proc), "SETUP_SYSCTL_DIR": str(sysctl_dir)})
    return host


def conf(host: FakeHost):
    return host.tmp / "sysctl.d" / "99-bonsai-ptrace.conf"


def wslconfig(host: FakeHost):
    return host.tmp / "winhome" / ".wslconfig"


def test_yes_persists_and_applies_ptrace_scope(host):
    make_host(host)
    r = host.run("setup-host", "--yes")
    assert r.rc == 0, r.out + r.err
    text = conf(host).read_text()
    assert "kernel.yama.ptrace_scope = 0" in text.splitlines()
    assert host.calls("sysctl") == [["--system"]]
    assert host.ptrace_file.read_text().strip() == "0"
    assert "done: kernel.yama.ptrace_scope = 0" in r.out
    # it said what it would do before doing it
    assert r.out.index("this will:") < r.out.index("wrote ")


def test_answer_no_changes_nothing(host):
    make_host(host)
    r = host.run("setup-host", input="n\n")
    assert r.rc == 0
    assert "[y/N]" in r.out and "skipped" in r.out
    assert not conf(host).exists()
    assert host.calls("sysctl") == []


def test_no_terminal_answer_means_no(host):
    make_host(host)
    r = host.run("setup-host", input="")
    assert not conf(host).exists() and host.calls("sysctl") == []
    assert "--yes" in r.out


def test_answer_yes_at_the_prompt(host):
    make_host(host)
    r = host.run("setup-host", input="y\n")
    assert r.rc == 0
    assert conf(host).exists() and host.calls("sysctl") == [["--system"]]


def test_second_run_is_idempotent(host):
    make_host(host)
    host.run("setup-host", "--yes")
    before = conf(host).read_text()
    host.clear_calls()
    r = host.run("setup-host", input="")          # must not even ask
    assert r.rc == 0
    assert "already in place" in r.out and "[y/N]" not in r.out
    assert host.calls("sysctl") == []
    assert conf(host).read_text() == before


def test_file_present_but_value_not_applied_runs_sysctl_only(host):
    make_host(host)
    conf(host).write_text("kernel.yama.ptrace_scope = 0\n")
    r = host.run("setup-host", "--yes")
    assert r.rc == 0
    assert "write " not in r.out
    assert host.calls("sysctl") == [["--system"]]


def test_unwritable_sysctl_dir_says_run_as_root(host):
    make_host(host)
    host.env["SETUP_SYSCTL_DIR"] = str(host.tmp / "no-such-dir")
    r = host.run("setup-host", "--yes")
    assert r.rc == 1 and "sudo wsl/setup-host" in r.err
    assert host.calls("sysctl") == []


def test_without_systemd_explains_boot_persistence(host):
    make_host(host, init="init")
    r = host.run("setup-host", "--yes")
    assert "systemd=true" in r.out and "command = sysctl -w kernel.yama.ptrace_scope=0" in r.out


def test_wslconfig_is_suggested_not_written(host):
    make_host(host)
    r = host.run("setup-host", "--yes")
    assert "memory=48GB" in r.out                  # 64 GB Windows, a quarter left to Windows
    assert "swap=16GB" in r.out and "networkingMode=nat" in r.out
    assert "--write-wslconfig" in r.out and "wsl.exe --shutdown" in r.out
    assert not wslconfig(host).exists()


def test_small_pc_gets_a_note(host):
    make_host(host, ram=34_359_738_368)            # 32 GB Windows
    r = host.run("setup-host", "--yes")
    assert "memory=24GB" in r.out and "below the 32 GB" in r.out


def test_write_wslconfig_creates_the_file(host):
    make_host(host)
    r = host.run("setup-host", "--yes", "--write-wslconfig")
    assert r.rc == 0, r.out + r.err
    text = wslconfig(host).read_text()
    assert "[wsl2]" in text and "memory=48GB" in text.splitlines()
    assert host.calls("wslpath") == [["-u", "C:\\Users\\taro"]]


def test_write_wslconfig_merges_keeps_other_settings_and_backs_up(host):
    make_host(host)
    original = "[wsl2]\r\nmemory=16GB\r\nswap=64GB\r\nguiApplications=false\r\n\r\n[experimental]\r\nsparseVhd=true\r\n"
    wslconfig(host).write_text(original)
    r = host.run("setup-host", "--yes", "--write-wslconfig", "--memory", "40GB")
    assert r.rc == 0, r.out + r.err
    lines = wslconfig(host).read_text().splitlines()
    assert "memory=40GB" in lines and "memory=16GB" not in lines
    assert "swap=64GB" in lines                     # a larger swap is kept
    assert "guiApplications=false" in lines and "sparseVhd=true" in lines
    assert "networkingMode=nat" in lines
    wsl2 = lines.index("[wsl2]")
    assert lines.index("networkingMode=nat") < lines.index("[experimental]") and wsl2 == 0
    backups = list(wslconfig(host).parent.glob(".wslconfig.bak-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == original.encode()   # byte for byte
    host.clear_calls()
    r = host.run("setup-host", "--yes", "--write-wslconfig", "--memory", "40GB")
    assert "already has these settings" in r.out
    assert len(list(wslconfig(host).parent.glob(".wslconfig.bak-*"))) == 1


def test_write_wslconfig_asks_first(host):
    make_host(host, ptrace="0")
    conf(host).write_text("kernel.yama.ptrace_scope = 0\n")
    r = host.run("setup-host", "--write-wslconfig", input="n\n")
    assert "write it? [y/N]" in r.out and not wslconfig(host).exists()


def test_plain_linux_skips_wslconfig(host):
    make_host(host, version=PLAIN_LINUX)
    r = host.run("setup-host", "--yes", "--write-wslconfig")
    assert r.rc == 0
    assert "not WSL: nothing to do" in r.out
    assert host.calls("powershell.exe") == [] and not wslconfig(host).exists()
    assert conf(host).exists()                      # ptrace_scope still applies on plain Linux


def test_help_and_bad_option(host):
    make_host(host)
    r = host.run("setup-host", "--help")
    assert r.rc == 0 and "--write-wslconfig" in r.out
    assert host.run("setup-host", "--bogus").rc == 2
    assert host.run("setup-host", "--memory", "lots").rc == 1
    assert not conf(host).exists()
