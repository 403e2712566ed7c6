"""Fakes for testing the wsl/ scripts without Windows, WSL, GPUs or Docker.

A FakeHost (in a tmp dir; conftest.py hands one to each test as `host`) has:

- fake executables (nvidia-smi, docker, df, ip, sysctl, powershell.exe, wslinfo, netsh.exe) in a
  bin dir that is first in PATH; every call's argv is appended to calls.jsonl;
- the generic fake answers from a list of rules (first match wins) written as JSON next to it;
- netsh.exe is a small stateful simulator of `interface portproxy` and `advfirewall firewall`
  (state.json), answering like Windows does (CRLF, exit 1 for "no rules match", elevation errors);
- a fake /proc (version, meminfo, yama/ptrace_scope, 1/comm, self/status);
- a PATH that holds only the fakes and a few real tools, so a developer running the tests on a
  real WSL machine never reaches the real netsh.exe, powershell.exe or nvidia-smi.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WSL_DIR = REPO / "wsl"

# Real tools the scripts use; everything else on PATH is a fake.
REAL_TOOLS = [
    "bash", "env", "dirname", "basename", "mktemp", "rm", "awk", "tail", "timeout", "tr", "sed",
    "grep", "iconv", "base64", "cat", "date", "cp", "mv", "head", "sort",
]

GENERIC_FAKE = r'''#!{python} -S
import base64, json, os, re, subprocess, sys
name = os.path.basename(sys.argv[0])
fake_dir = os.environ["FAKE_DIR"]
args = sys.argv[1:]
script = ""
if "-EncodedCommand" in args:
    i = args.index("-EncodedCommand")
    script = base64.b64decode(args[i + 1]).decode("utf-16-le")
with open(os.path.join(fake_dir, "calls.jsonl"), "a") as log:
    log.write(json.dumps({{"cmd": name, "argv": args, "script": script}}) + "\n")
with open(os.path.join(fake_dir, name + ".json")) as f:
    rules = json.load(f)
joined = " ".join(args) + "\n" + script
for rule in rules:
    if "args" in rule and rule["args"] != args:
        continue
    if not all(c in joined for c in rule.get("contains", [])):
        continue
    for path, text in rule.get("write", {{}}).items():
        with open(path, "w") as f:
            f.write(text)
    if rule.get("run_elevated_netsh"):
        # Like Start-Process -Verb RunAs: run the netsh lines of the inner encoded script.
        inner = re.search(r"'-EncodedCommand','([A-Za-z0-9+/=]+)'", script)
        inner_text = base64.b64decode(inner.group(1)).decode("utf-16-le")
        with open(os.path.join(fake_dir, "elevated_scripts.txt"), "a") as f:
            f.write(inner_text + "\n---\n")
        env = dict(os.environ, FAKE_ELEVATED="1")
        for line in inner_text.splitlines():
            if line.startswith("& netsh.exe "):
                rc = subprocess.call([os.path.join(os.path.dirname(sys.argv[0]), "netsh.exe")]
                                     + line[len("& netsh.exe "):].split(), env=env,
                                     stdout=subprocess.DEVNULL)
                if rc:
                    sys.exit(rc)
    sys.stdout.write(rule.get("stdout", ""))
    sys.stderr.write(rule.get("stderr", ""))
    sys.exit(rule.get("rc", 0))
sys.stderr.write("fake %s: no rule for %r\n" % (name, args))
sys.exit(127)
'''

NETSH_FAKE = r'''#!{python} -S
import json, os, sys
fake_dir = os.environ["FAKE_DIR"]
args = sys.argv[1:]
with open(os.path.join(fake_dir, "calls.jsonl"), "a") as log:
    log.write(json.dumps({{"cmd": "netsh.exe", "argv": args, "script": ""}}) + "\n")
state_path = os.path.join(fake_dir, "netsh_state.json")
with open(state_path) as f:
    state = json.load(f)
kv = {{a.split("=", 1)[0].lower(): a.split("=", 1)[1] for a in args if "=" in a}}
words = [a.lower() for a in args if "=" not in a]
out = sys.stdout.buffer

def say(text, rc=0):
    if state.get("lang") == "ja":
        out.write(text.encode("cp932", "replace"))
    else:
        out.write(text.encode())
    sys.exit(rc)

def save():
    with open(state_path, "w") as f:
        json.dump(state, f)

def need_elevation():
    if not state.get("elevated") and os.environ.get("FAKE_ELEVATED") != "1":
        if state.get("lang") == "ja":
            say("\r\n要求された操作には管理者特権が必要です (管理者として実行)。\r\n\r\n", 1)
        say("The requested operation requires elevation (Run as administrator).\r\n\r\n", 1)

NO_MATCH = "\r\nNo rules match the specified criteria.\r\n\r\n"
if state.get("lang") == "ja":
    NO_MATCH = "\r\n指定された基準と一致する規則がありません。\r\n\r\n"

if words[:4] == ["interface", "portproxy", "show", "v4tov4"]:
    if not state["portproxy"]:
        say("\r\n")
    text = ("\r\nListen on ipv4:             Connect to ipv4:\r\n\r\n"
            "Address         Port        Address         Port\r\n"
            "--------------- ----------  --------------- ----------\r\n")
    for la, lp, ca, cp in state["portproxy"]:
        text += "%-15s %-11s %-15s %s\r\n" % (la, lp, ca, cp)
    say(text + "\r\n")
if words[:4] == ["interface", "portproxy", "add", "v4tov4"]:
    need_elevation()
    key = (kv.get("listenaddress", "*"), kv["listenport"])
    state["portproxy"] = [e for e in state["portproxy"] if (e[0], e[1]) != key]
    state["portproxy"].append([key[0], key[1], kv["connectaddress"], kv.get("connectport", key[1])])
    save()
    say("\r\n")
if words[:4] == ["interface", "portproxy", "delete", "v4tov4"]:
    need_elevation()
    key = [kv.get("listenaddress", "*"), kv["listenport"]]
    left = [e for e in state["portproxy"] if e[:2] != key]
    if len(left) == len(state["portproxy"]):
        say("The system cannot find the file specified.\r\n\r\n", 1)
    state["portproxy"] = left
    save()
    say("\r\n")
if words[:4] == ["advfirewall", "firewall", "show", "rule"]:
    found = [r for r in state["rules"] if r["name"] == kv["name"]]
    if not found:
        say(NO_MATCH, 1)
    text = ""
    for r in found:
        text += ("\r\nRule Name:                            %s\r\n" % r["name"]
                 + "-" * 70 + "\r\nEnabled:                              Yes\r\n"
                 "Direction:                            In\r\n"
                 "RemoteIP:                             LocalSubnet\r\n"
                 "Protocol:                             TCP\r\n"
                 "LocalPort:                            %s\r\n" % r.get("localport", "")
                 + "Action:                               Allow\r\n")
    say(text + "Ok.\r\n\r\n")
if words[:4] == ["advfirewall", "firewall", "add", "rule"]:
    need_elevation()
    state["rules"].append(kv)  # like Windows: a second add makes a duplicate rule
    save()
    say("Ok.\r\n\r\n")
if words[:4] == ["advfirewall", "firewall", "delete", "rule"]:
    need_elevation()
    left = [r for r in state["rules"] if r["name"] != kv["name"]]
    n = len(state["rules"]) - len(left)
    if not n:
        say(NO_MATCH, 1)
    state["rules"] = left
    save()
    say("\r\nDeleted %d rule(s).\r\nOk.\r\n\r\n" % n)
say("The following command was not found: %s.\r\n" % " ".join(args), 1)
'''


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def findings(self) -> list[tuple[str, str, str]]:
        """doctor's text lines as (status, check, rest)."""
        found = []
        for line in self.out.splitlines():
            m = re.match(r"^(OK|WARN|FAIL|SKIP)\s+(\S+)\s+(.*)$", line)
            if m:
                found.append(m.groups())
        return found

    def finding(self, check: str, contains: str = "") -> tuple[str, str, str]:
        """The one finding of this check (whose text contains `contains`)."""
        hits = [f for f in self.findings if f[1] == check and contains in f[2]]
        assert len(hits) == 1, f"expected one {check!r} finding with {contains!r}, got {hits}\n{self.out}"
        return hits[0]

    def statuses(self, check: str) -> list[str]:
        return [f[0] for f in self.findings if f[1] == check]


class FakeHost:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.tools = tmp / "tools"
        self.fake_dir = tmp / "fake"
        self.proc = tmp / "proc"
        self.root = tmp / "root"
        for d in (self.bin, self.tools, self.fake_dir, self.proc, self.root):
            d.mkdir()
        for tool in REAL_TOOLS:
            path = shutil.which(tool)
            if path:
                (self.tools / tool).symlink_to(path)
        (self.fake_dir / "calls.jsonl").write_text("")
        self.env: dict[str, str] = {}

    # --- fakes -------------------------------------------------------------------------------
    def fake(self, name: str, rules: list[dict]) -> None:
        """Install fake command `name` answering by `rules` (first match wins)."""
        (self.fake_dir / f"{name}.json").write_text(json.dumps(rules))
        exe = self.bin / name
        exe.write_text(GENERIC_FAKE.format(python=sys.executable))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

    def remove_fake(self, name: str) -> None:
        (self.bin / name).unlink(missing_ok=True)

    def netsh(self, portproxy=(), rules=(), elevated=True, lang="en") -> None:
        """Install the stateful netsh.exe with this starting state."""
        self.set_netsh_state(portproxy=portproxy, rules=rules, elevated=elevated, lang=lang)
        exe = self.bin / "netsh.exe"
        exe.write_text(NETSH_FAKE.format(python=sys.executable))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

    def set_netsh_state(self, portproxy=(), rules=(), elevated=True, lang="en") -> None:
        state = {"portproxy": [list(e) for e in portproxy], "rules": list(rules),
                 "elevated": elevated, "lang": lang}
        (self.fake_dir / "netsh_state.json").write_text(json.dumps(state))

    def netsh_state(self) -> dict:
        return json.loads((self.fake_dir / "netsh_state.json").read_text())

    def calls(self, name: str | None = None) -> list[list[str]]:
        rows = [json.loads(line) for line in (self.fake_dir / "calls.jsonl").read_text().splitlines()]
        return [r["argv"] for r in rows if name is None or r["cmd"] == name]

    def scripts(self, name: str) -> list[str]:
        """Decoded -EncodedCommand scripts passed to `name`."""
        rows = [json.loads(line) for line in (self.fake_dir / "calls.jsonl").read_text().splitlines()]
        return [r["script"] for r in rows if r["cmd"] == name]

    def clear_calls(self) -> None:
        (self.fake_dir / "calls.jsonl").write_text("")

    # --- /proc ---------------------------------------------------------------------------------
    def write_proc(self, version: str, mem_kb: int = 65_000_000, swap_kb: int = 16_777_216,
                   ptrace: str | None = "0", init: str = "systemd",
                   capeff: str = "000001ffffffffff") -> None:
        (self.proc / "version").write_text(version + "\n")
        (self.proc / "meminfo").write_text(
            f"MemTotal:       {mem_kb} kB\nMemFree:        {mem_kb // 2} kB\n"
            f"SwapTotal:      {swap_kb} kB\nSwapFree:       {swap_kb} kB\n")
        yama = self.proc / "sys" / "kernel" / "yama"
        yama.mkdir(parents=True, exist_ok=True)
        if ptrace is None:
            (yama / "ptrace_scope").unlink(missing_ok=True)
        else:
            (yama / "ptrace_scope").write_text(ptrace + "\n")
        (self.proc / "1").mkdir(exist_ok=True)
        (self.proc / "1" / "comm").write_text(init + "\n")
        (self.proc / "self").mkdir(exist_ok=True)
        (self.proc / "self" / "status").write_text(
            f"Name:\tbash\nCapInh:\t0000000000000000\nCapPrm:\t{capeff}\nCapEff:\t{capeff}\n")

    @property
    def ptrace_file(self) -> Path:
        return self.proc / "sys" / "kernel" / "yama" / "ptrace_scope"

    # --- running -----------------------------------------------------------------------------
    def run(self, script: str, *args: str, env: dict | None = None, input: str | None = None,
            timeout: float = 30) -> Result:
        full_env = {
            "PATH": f"{self.bin}:{self.tools}",
            "HOME": str(self.tmp),
            "LANG": "C.UTF-8",
            "FAKE_DIR": str(self.fake_dir),
        }
        full_env.update(self.env)
        full_env.update(env or {})
        proc = subprocess.run(
            [str(WSL_DIR / script), *args], env=full_env, input=input if input is not None else "",
            capture_output=True, text=True, errors="replace", timeout=timeout)
        # The scripts must never die on a bash error (set -u, a failing pipeline).
        assert "unbound variable" not in proc.stderr, proc.stderr
        assert "syntax error" not in proc.stderr, proc.stderr
        return Result(proc.returncode, proc.stdout, proc.stderr)
