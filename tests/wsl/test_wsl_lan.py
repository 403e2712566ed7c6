"""wsl/lan against a stateful fake netsh.exe: the exact Windows command lines, and idempotence."""

from __future__ import annotations

import base64
import re

from wslfakes import FakeHost

WSL_VERSION = "Linux version 6.6.87.2-microsoft-standard-WSL2 (root@439a258ad544) #1 SMP"
IP_NOW = "172.24.190.12"
IP_OLD = "172.31.5.77"

SHOW_PP = ["interface", "portproxy", "show", "v4tov4"]
SHOW_RULE = ["advfirewall", "firewall", "show", "rule", "name=bonsai-proxy-8080"]
ADD_PP = ["interface", "portproxy", "add", "v4tov4", "listenport=8080", "listenaddress=0.0.0.0",
          "connectport=8080", f"connectaddress={IP_NOW}"]
ADD_RULE = ["advfirewall", "firewall", "add", "rule", "name=bonsai-proxy-8080", "dir=in", "action=allow",
            "protocol=TCP", "localport=8080", "remoteip=localsubnet"]
DEL_PP = ["interface", "portproxy", "delete", "v4tov4", "listenport=8080", "listenaddress=0.0.0.0"]
DEL_RULE = ["advfirewall", "firewall", "delete", "rule", "name=bonsai-proxy-8080"]
OUR_RULE = {"name": "bonsai-proxy-8080", "dir": "in", "action": "allow", "protocol": "TCP",
            "localport": "8080", "remoteip": "localsubnet"}


def ip_output(addr: str) -> str:
    return (f"4: eth0    inet {addr}/20 brd 172.24.191.255 scope global eth0\\       "
            "valid_lft forever preferred_lft forever\n")


def make_wsl(host: FakeHost, *, ip=IP_NOW, portproxy=(), rules=(), elevated=True, lang="en",
             mode="nat") -> FakeHost:
    host.write_proc(WSL_VERSION)
    host.netsh(portproxy=portproxy, rules=rules, elevated=elevated, lang=lang)
    set_ip(host, ip)
    host.fake("wslinfo", [{"args": ["--networking-mode"], "stdout": mode + "\n"}])
    host.env.update({"LAN_PROC": str(host.proc), "LAN_NETSH": "netsh.exe", "WSL_DISTRO_NAME": "Ubuntu"})
    return host


def set_ip(host: FakeHost, addr: str) -> None:
    host.fake("ip", [{"args": ["-4", "-o", "addr", "show", "dev", "eth0"], "stdout": ip_output(addr)}])


def changing(calls):
    return [c for c in calls if c[2] in ("add", "delete")]


def test_add_runs_the_exact_commands(host):
    make_wsl(host)
    r = host.run("lan")
    assert r.rc == 0, r.out + r.err
    assert host.calls("netsh.exe") == [
        SHOW_PP, SHOW_RULE,                    # look first
        ADD_PP, ADD_RULE,                      # change
        SHOW_PP, SHOW_RULE,                    # read back
    ]
    state = host.netsh_state()
    assert state["portproxy"] == [["0.0.0.0", "8080", IP_NOW, "8080"]]
    assert state["rules"] == [OUR_RULE]
    assert "--print-task" in r.out


def test_rerun_is_idempotent_no_duplicate_rule(host):
    make_wsl(host)
    assert host.run("lan").rc == 0
    host.clear_calls()
    r = host.run("lan")
    assert r.rc == 0
    assert changing(host.calls("netsh.exe")) == []
    assert "already in place" in r.out and "already exists" in r.out and "nothing to do" in r.out
    assert len(host.netsh_state()["rules"]) == 1


def test_changed_wsl_address_replaces_the_stale_mapping(host):
    make_wsl(host, ip=IP_OLD)
    assert host.run("lan").rc == 0
    set_ip(host, IP_NOW)                       # WSL restarted: new address
    host.clear_calls()
    r = host.run("lan")
    assert r.rc == 0, r.out + r.err
    assert changing(host.calls("netsh.exe")) == [DEL_PP, ADD_PP]   # no second firewall rule
    assert "stale" in r.out and IP_OLD in r.out
    state = host.netsh_state()
    assert state["portproxy"] == [["0.0.0.0", "8080", IP_NOW, "8080"]]
    assert len(state["rules"]) == 1


def test_other_listen_address_is_left_alone(host):
    make_wsl(host, portproxy=[("192.168.1.20", "8080", "10.0.0.9", "8080")], rules=[OUR_RULE])
    r = host.run("lan")
    assert r.rc == 0
    assert changing(host.calls("netsh.exe")) == [ADD_PP]
    assert "leaving it alone" in r.err


def test_remove_deletes_mapping_and_rule(host):
    make_wsl(host)
    host.run("lan")
    host.clear_calls()
    r = host.run("lan", "--remove")
    assert r.rc == 0, r.out + r.err
    assert changing(host.calls("netsh.exe")) == [DEL_PP, DEL_RULE]
    assert host.netsh_state()["portproxy"] == [] and host.netsh_state()["rules"] == []
    host.clear_calls()
    r = host.run("lan", "--remove")           # again: nothing left
    assert r.rc == 0 and "nothing to do" in r.out
    assert changing(host.calls("netsh.exe")) == []


def test_dry_run_prints_exact_commands_and_changes_nothing(host):
    make_wsl(host, portproxy=[("0.0.0.0", "8080", IP_OLD, "8080")])
    r = host.run("lan", "--dry-run")
    assert r.rc == 0, r.err
    assert host.calls("netsh.exe") == [SHOW_PP, SHOW_RULE]        # read-only queries only
    printed = [line for line in r.out.splitlines() if line.startswith("netsh.exe ")]
    assert printed == ["netsh.exe " + " ".join(DEL_PP), "netsh.exe " + " ".join(ADD_PP),
                       "netsh.exe " + " ".join(ADD_RULE)]
    assert host.netsh_state()["portproxy"] == [["0.0.0.0", "8080", IP_OLD, "8080"]]
    assert host.netsh_state()["rules"] == []


def test_dry_run_remove(host):
    make_wsl(host, portproxy=[("0.0.0.0", "8080", IP_NOW, "8080")], rules=[OUR_RULE])
    r = host.run("lan", "--remove", "--dry-run")
    assert r.rc == 0
    assert changing(host.calls("netsh.exe")) == []
    assert "netsh.exe " + " ".join(DEL_RULE) in r.out.splitlines()


def test_port_from_env_and_from_flag(host):
    make_wsl(host)
    r = host.run("lan", env={"PROXY_PORT": "9000"})
    assert r.rc == 0
    assert ["interface", "portproxy", "add", "v4tov4", "listenport=9000", "listenaddress=0.0.0.0",
            "connectport=9000", f"connectaddress={IP_NOW}"] in host.calls("netsh.exe")
    r = host.run("lan", "--port", "8443", env={"PROXY_PORT": "9000"})
    assert r.rc == 0
    assert ["advfirewall", "firewall", "add", "rule", "name=bonsai-proxy-8443", "dir=in", "action=allow",
            "protocol=TCP", "localport=8443", "remoteip=localsubnet"] in host.calls("netsh.exe")


def test_bad_port_is_refused(host):
    make_wsl(host)
    r = host.run("lan", "--port", "70000")
    assert r.rc == 1 and "bad port" in r.err
    assert host.calls("netsh.exe") == []


def test_not_elevated_explains_how_to_elevate(host):
    make_wsl(host, elevated=False)
    r = host.run("lan")
    assert r.rc == 1
    assert "requires elevation" in r.err and "administrator" in r.err
    assert "Start-Process" in r.err and "-Verb RunAs" in r.err and "--elevate" in r.err
    assert changing(host.calls("netsh.exe")) == [ADD_PP]     # stopped at the first refusal
    assert host.netsh_state()["portproxy"] == []


def test_not_elevated_on_japanese_windows_still_explained(host):
    # netsh answers in the console code page (CP932 here): the message is not readable UTF-8
    make_wsl(host, elevated=False, lang="ja")
    host.fake("chcp.com", [{"stdout": "Active code page: 932\r\n"}])
    r = host.run("lan")
    assert r.rc == 1
    assert "管理者特権が必要です" in r.err           # decoded from CP932, not mojibake
    assert "needs administrator rights" in r.err
    assert "--elevate" in r.err and "-Verb RunAs" in r.err


def test_undecodable_windows_output_is_cleaned(host):
    make_wsl(host, elevated=False, lang="ja")      # no chcp.com: code page unknown
    r = host.run("lan")
    assert r.rc == 1
    assert "\ufffd" not in r.err                    # no raw bytes reach the terminal
    assert "--elevate" in r.err


def test_elevate_runs_netsh_in_an_elevated_powershell(host):
    make_wsl(host, elevated=False)
    host.fake("powershell.exe", [{"contains": ["-EncodedCommand", "-Verb RunAs"], "run_elevated_netsh": True}])
    r = host.run("lan", "--elevate")
    assert r.rc == 0, r.out + r.err
    (outer,) = host.scripts("powershell.exe")
    assert "Start-Process -FilePath powershell.exe -Verb RunAs -Wait -PassThru" in outer
    inner_b64 = re.search(r"'-EncodedCommand','([A-Za-z0-9+/=]+)'", outer).group(1)
    inner = base64.b64decode(inner_b64).decode("utf-16-le")
    assert "& netsh.exe " + " ".join(ADD_PP) in inner.splitlines()
    assert "& netsh.exe " + " ".join(ADD_RULE) in inner.splitlines()
    state = host.netsh_state()
    assert state["portproxy"] == [["0.0.0.0", "8080", IP_NOW, "8080"]] and len(state["rules"]) == 1


def test_elevate_declined_fails(host):
    make_wsl(host, elevated=False)
    host.fake("powershell.exe", [{"contains": ["-EncodedCommand"], "rc": 1,
                                  "stderr": "Start-Process : This command cannot be run due to the error: "
                                            "The operation was canceled by the user.\n"}])
    r = host.run("lan", "--elevate")
    assert r.rc == 1 and "UAC declined" in r.err
    assert host.netsh_state()["portproxy"] == []


def test_not_wsl_refuses(host):
    make_wsl(host)
    host.write_proc("Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP")
    r = host.run("lan")
    assert r.rc == 1 and "not WSL" in r.err
    assert host.calls("netsh.exe") == []


def test_mirrored_networking_needs_no_portproxy(host):
    make_wsl(host, mode="mirrored")
    r = host.run("lan")
    assert r.rc == 0
    assert host.calls("netsh.exe") == []
    assert "New-NetFirewallHyperVRule" in r.out and "-LocalPorts 8080" in r.out


def test_print_task_for_boot(host):
    make_wsl(host)
    r = host.run("lan", "--print-task", "--port", "8080")
    assert r.rc == 0
    line = next(x for x in r.out.splitlines() if x.startswith("schtasks.exe /Create"))
    assert "/SC ONLOGON" in line and "/RL HIGHEST" in line
    assert re.search(r'/TR "wsl\.exe -d Ubuntu -- /\S+/wsl/lan --port 8080"', line), line
    assert host.calls() == []


# ---- --server: a PC that runs the model server alone (make server, make lan-server; docs/scale-out.md)

def server_commands(port: str = "8000") -> dict[str, list[str]]:
    rule = f"name=bonsai-server-{port}"
    return {
        "show_rule": ["advfirewall", "firewall", "show", "rule", rule],
        "add_pp": ["interface", "portproxy", "add", "v4tov4", f"listenport={port}", "listenaddress=0.0.0.0",
                   f"connectport={port}", f"connectaddress={IP_NOW}"],
        "add_rule": ["advfirewall", "firewall", "add", "rule", rule, "dir=in", "action=allow", "protocol=TCP",
                     f"localport={port}", "remoteip=localsubnet"],
        "del_pp": ["interface", "portproxy", "delete", "v4tov4", f"listenport={port}", "listenaddress=0.0.0.0"],
        "del_rule": ["advfirewall", "firewall", "delete", "rule", rule],
    }


def test_server_forwards_the_model_servers_port_under_its_own_rule(host):
    make_wsl(host)
    cmd = server_commands()
    r = host.run("lan", "--server", env={"PROXY_PORT": "9000"})   # the gateway's port is not this one's
    assert r.rc == 0, r.out + r.err
    assert host.calls("netsh.exe") == [
        SHOW_PP, cmd["show_rule"],
        cmd["add_pp"], cmd["add_rule"],
        SHOW_PP, cmd["show_rule"],
    ]
    state = host.netsh_state()
    assert state["portproxy"] == [["0.0.0.0", "8000", IP_NOW, "8000"]]
    assert [rule["name"] for rule in state["rules"]] == ["bonsai-server-8000"]
    assert "to the model server" in r.out and "UPSTREAMS" in r.out     # what to do with it on the main PC
    host.clear_calls()
    r = host.run("lan", "--server")                                   # again: nothing to change
    assert r.rc == 0 and "nothing to do" in r.out
    assert changing(host.calls("netsh.exe")) == []


def test_server_port_from_server_port_env_and_from_flag(host):
    make_wsl(host)
    r = host.run("lan", "--server", env={"SERVER_PORT": "8001", "PROXY_PORT": "9000"})
    assert r.rc == 0, r.out + r.err
    assert changing(host.calls("netsh.exe")) == [server_commands("8001")["add_pp"],
                                                 server_commands("8001")["add_rule"]]
    host.clear_calls()
    r = host.run("lan", "--port", "8002", "--server", env={"SERVER_PORT": "8001"})   # the flag wins, either order
    assert r.rc == 0, r.out + r.err
    assert changing(host.calls("netsh.exe")) == [server_commands("8002")["add_pp"],
                                                 server_commands("8002")["add_rule"]]
    r = host.run("lan", "--server", "--port", "")
    assert r.rc == 1 and "bad port" in r.err                          # an empty --port is not the default


def test_server_and_gateway_rules_live_side_by_side_and_are_removed_apart(host):
    make_wsl(host)
    assert host.run("lan").rc == 0                                    # the gateway, 8080
    assert host.run("lan", "--server").rc == 0                        # and the model server, 8000
    state = host.netsh_state()
    assert sorted(state["portproxy"]) == [["0.0.0.0", "8000", IP_NOW, "8000"], ["0.0.0.0", "8080", IP_NOW, "8080"]]
    assert sorted(rule["name"] for rule in state["rules"]) == ["bonsai-proxy-8080", "bonsai-server-8000"]
    host.clear_calls()
    r = host.run("lan", "--server", "--remove")
    assert r.rc == 0, r.out + r.err
    cmd = server_commands()
    assert changing(host.calls("netsh.exe")) == [cmd["del_pp"], cmd["del_rule"]]
    state = host.netsh_state()
    assert state["portproxy"] == [["0.0.0.0", "8080", IP_NOW, "8080"]] and state["rules"] == [OUR_RULE]


def test_server_commands_printed_for_elevation_and_the_logon_task_keep_server(host):
    # Re-run elevated, or at logon, without --server the script would forward 8080 under bonsai-proxy-8080.
    make_wsl(host, elevated=False)
    r = host.run("lan", "--server")
    assert r.rc == 1
    printed = [line for line in r.err.splitlines() if "wsl/lan " in line and not line.startswith("wsl/lan:")]
    assert len(printed) == 3, r.err
    assert all("wsl/lan --server --port 8000" in line for line in printed), printed
    r = host.run("lan", "--server", "--print-task", env={"SERVER_PORT": "8001"})
    assert r.rc == 0
    line = next(x for x in r.out.splitlines() if x.startswith("schtasks.exe /Create"))
    assert re.search(r'/TR "wsl\.exe -d Ubuntu -- /\S+/wsl/lan --server --port 8001"', line), line


def test_server_dry_run_and_mirrored_mode_name_the_server_rule(host):
    make_wsl(host)
    r = host.run("lan", "--server", "--dry-run")
    assert r.rc == 0, r.err
    printed = [line for line in r.out.splitlines() if line.startswith("netsh.exe ")]
    cmd = server_commands()
    assert printed == ["netsh.exe " + " ".join(cmd["add_pp"]), "netsh.exe " + " ".join(cmd["add_rule"])]
    assert host.netsh_state()["portproxy"] == []
    make_wsl(host, mode="mirrored")
    r = host.run("lan", "--server")
    assert r.rc == 0
    assert "-Name bonsai-server-8000" in r.out and "-LocalPorts 8000" in r.out
