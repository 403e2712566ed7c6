"""bonsai_vllm.settings: every BONSAI_* switch declared once, parsed by one rule, and the lists that come from it
(docs/settings.md, `bonsai-serve --help`) kept equal to it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bonsai_vllm import settings
from bonsai_vllm.settings import ELSEWHERE, SETTINGS, Setting

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "plugin" / "bonsai_vllm"
NAME = re.compile(r"\bBONSAI_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
# BONSAI_* words that are no environment variable.
NOT_VARIABLES = {"BONSAI_K3V2": "the K3V2 attention backend's registered name (adapters/plugin.py)"}


@pytest.fixture
def fresh(monkeypatch):
    """An empty cache before and after, and no BONSAI_* switch inherited from the shell running the tests."""
    for s in SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
    settings.clear_cache()
    yield monkeypatch
    settings.clear_cache()


# ---- the one rule


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " on "])
def test_bool_true_words(raw):
    assert Setting("BONSAI_X", "bool", False, "", "").parse(raw) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "no", "OFF", "0 "])
def test_bool_false_words(raw):
    assert Setting("BONSAI_X", "bool", True, "", "").parse(raw) is False


@pytest.mark.parametrize("raw", [None, "", "   "])
@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default_for_every_type(raw, default):
    assert Setting("BONSAI_X", "bool", default, "", "").parse(raw) is default
    assert Setting("BONSAI_X", "int", 7, "", "").parse(raw) == 7
    assert Setting("BONSAI_X", "float", 0.5, "", "").parse(raw) == 0.5
    assert Setting("BONSAI_X", "str", "abc", "", "").parse(raw) == "abc"
    assert Setting("BONSAI_X", "path", None, "", "").parse(raw) is None
    assert Setting("BONSAI_X", "choice", "a", "", "", choices=("a", "b")).parse(raw) == "a"


def test_each_type_parses_its_values(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    assert Setting("BONSAI_X", "int", 0, "", "", minimum=0).parse(" 42 ") == 42
    assert Setting("BONSAI_X", "float", 0.0, "", "").parse("0.25") == 0.25
    assert Setting("BONSAI_X", "str", "", "", "").parse("some text") == "some text"
    assert Setting("BONSAI_X", "path", None, "", "").parse("~/trace.jsonl") == Path("/home/someone/trace.jsonl")
    assert Setting("BONSAI_X", "choice", "a", "", "", choices=("a", "b")).parse("b") == "b"


@pytest.mark.parametrize("setting, raw, accepted", [
    (Setting("BONSAI_X", "bool", True, "", ""), "maybe", "1/true/yes/on or 0/false/no/off"),
    (Setting("BONSAI_X", "int", 1, "", ""), "lots", "a whole number"),
    (Setting("BONSAI_X", "int", 1, "", "", minimum=0), "-3", "a whole number of at least 0"),
    (Setting("BONSAI_X", "int", 1, "", ""), "1.5", "a whole number"),
    (Setting("BONSAI_X", "float", 1.0, "", ""), "fast", "a number"),
    (Setting("BONSAI_X", "choice", "a", "", "", choices=("a", "b")), "A", "one of a, b"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(setting, raw, accepted):
    with pytest.raises(ValueError) as e:
        setting.parse(raw)
    assert f"BONSAI_X={raw!r}" in str(e.value) and accepted in str(e.value)
    assert "empty or unset: the default" in str(e.value)


def test_a_record_must_be_consistent():
    with pytest.raises(ValueError, match="unknown type"):
        Setting("BONSAI_X", "number", 1, "", "")
    with pytest.raises(ValueError, match="choices"):
        Setting("BONSAI_X", "choice", "a", "", "")
    with pytest.raises(ValueError, match="choices"):
        Setting("BONSAI_X", "str", "a", "", "", choices=("a",))


def test_every_declared_default_parses_back():
    for s in SETTINGS:
        assert s.name.startswith("BONSAI_") and s.help and s.reader, s.name
        assert s.parse(None) == s.default and s.parse("") == s.default
        if s.type == "choice":
            assert s.default in s.choices, s.name
    assert len({s.name for s in SETTINGS}) == len(SETTINGS)
    assert not {s.name for s in SETTINGS} & {e.name for e in ELSEWHERE}


# ---- get: once per process, or from an explicit mapping


def test_get_reads_the_environment_once(fresh):
    fresh.setenv("BONSAI_AR_INT8_MIN_TOKENS", "64")
    assert settings.get("BONSAI_AR_INT8_MIN_TOKENS") == 64
    fresh.setenv("BONSAI_AR_INT8_MIN_TOKENS", "32")
    assert settings.get("BONSAI_AR_INT8_MIN_TOKENS") == 64  # cached
    settings.clear_cache()
    assert settings.get("BONSAI_AR_INT8_MIN_TOKENS") == 32


def test_an_explicit_mapping_bypasses_the_cache(fresh):
    fresh.setenv("BONSAI_AR_INT8", "0")
    assert settings.get("BONSAI_AR_INT8", {"BONSAI_AR_INT8": "on"}) is True
    assert settings.get("BONSAI_AR_INT8", {}) is True  # the default, not the process environment
    assert settings.get("BONSAI_AR_INT8") is False
    assert settings.get("BONSAI_AR_INT8", {"BONSAI_AR_INT8": "yes"}) is True  # and does not fill or change it
    assert settings.get("BONSAI_AR_INT8") is False


def test_get_refuses_an_undeclared_name():
    with pytest.raises(KeyError, match="not a declared setting"):
        settings.get("BONSAI_NO_SUCH_THING", {})


def test_check_reports_bad_values_and_unknown_names():
    errors, warnings = settings.check({"BONSAI_AR_INT8": "maybe", "BONSAI_PREEMPT_COOLDOWN": "5",
                                       "BONSAI_AR_INT": "0", "BONSAI_MODEL_DIR": "/m", "PATH": "/bin"})
    assert len(errors) == 1 and "BONSAI_AR_INT8='maybe'" in errors[0]
    assert len(warnings) == 1 and "BONSAI_AR_INT " in warnings[0]  # the typo; the fetcher's name is known


# ---- the list is honest: every name the code mentions is declared


def _names_in(paths) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in paths:
        if path.is_file() and "__pycache__" not in path.parts:
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for name in NAME.findall(text):
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_bonsai_name_in_the_plugin_is_declared():
    # (settings.py itself left out: its ELSEWHERE names the variables read outside the plugin)
    found = _names_in(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "settings.py")
    assert "BONSAI_AR_INT8" in found and "BONSAI_SCHED_TRACE" in found  # the scan sees the readers
    missing = {n: sorted(p) for n, p in found.items() if n not in settings.BY_NAME and n not in NOT_VARIABLES}
    assert not missing, f"BONSAI_* names the plugin mentions but settings.SETTINGS does not declare: {missing}"
    unused = {s.name for s in SETTINGS} - set(found)
    assert not unused, f"declared but mentioned nowhere else in the plugin: {unused}"


def test_every_bonsai_name_elsewhere_is_listed():
    roots = ["model-fetch", "proxy", "wsl", "docs", "tools", "benchmarks", "monitoring"]
    files = [p for r in roots for p in (REPO / r).rglob("*")]
    files += [REPO / f for f in ("compose.yaml", ".env.example", "Dockerfile", "Makefile", "README.md")]
    known = set(settings.BY_NAME) | {e.name for e in ELSEWHERE} | set(NOT_VARIABLES)
    found = _names_in(files)
    assert {"BONSAI_MODEL_DIR", "BONSAI_IMAGE_TAG", "BONSAI_AR_INT8"} <= set(found)  # the scan reaches each kind
    missing = {n: sorted(p) for n, p in found.items() if n not in known}
    assert not missing, f"BONSAI_* names neither in settings.SETTINGS nor in settings.ELSEWHERE: {missing}"


def test_elsewhere_lists_exactly_bonsai_fetchs_variables():
    from bonsai_fetch.cli import ENV

    listed = {e.name for e in ELSEWHERE if e.reader == "bonsai-fetch"}
    assert listed == {v for v in ENV.values() if v.startswith("BONSAI_")}


def test_compose_passes_the_switches_the_records_say():
    env = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["vllm"]["environment"]
    passed = {}
    for name, value in env.items():
        if name.startswith("BONSAI_"):
            m = re.fullmatch(r"\$\{(\w+)(:?-)(.*)\}", str(value))
            assert m, (name, value)
            passed[name] = m.groups()
    assert set(passed) == {s.name for s in SETTINGS if s.compose}
    for name, (variable, _, default) in passed.items():
        s = settings.BY_NAME[name]
        assert s.compose == variable, name
        if s.type in ("bool", "int"):  # compose's fallback means what the plugin's default means
            assert s.parse(default) == s.default, name


# ---- defaults are what the readers used before


def test_int8_all_reduce_defaults_through_the_adapter(fresh):
    from bonsai_vllm.adapters import allreduce

    assert allreduce.enabled() is True and allreduce.min_tokens() == 128
    settings.clear_cache()
    fresh.setenv("BONSAI_AR_INT8", "0")
    fresh.setenv("BONSAI_AR_INT8_MIN_TOKENS", "1")
    assert allreduce.enabled() is False and allreduce.min_tokens() == 1
    settings.clear_cache()
    fresh.setenv("BONSAI_AR_INT8", "off")
    assert allreduce.enabled() is False


def test_scheduling_policy_defaults_through_from_env(fresh):
    from bonsai_vllm.scheduling import PolicyConfig

    assert PolicyConfig.from_env({}) == PolicyConfig() == PolicyConfig.from_env()
    assert PolicyConfig() == PolicyConfig(preempt=True, decode_prefill_budget=256, idle_prefill_chunk=512,
                                          cooldown_steps=16)
    cfg = PolicyConfig.from_env({"BONSAI_PRIORITY_PREEMPT": "off", "BONSAI_PREEMPT_COOLDOWN": "",
                                 "BONSAI_PREFILL_CHUNK_IDLE": "0"})
    assert not cfg.preempt and cfg.cooldown_steps == 16 and cfg.idle_prefill_chunk == 0
    with pytest.raises(ValueError, match="BONSAI_PREFILL_BUDGET_DECODING='many'"):
        PolicyConfig.from_env({"BONSAI_PREFILL_BUDGET_DECODING": "many"})


def test_other_defaults_match_their_readers():
    from bonsai_vllm.kv.calibration import DEFAULT_TOKENS

    assert settings.BY_NAME["BONSAI_KV_CAPTURE_TOKENS"].default == DEFAULT_TOKENS
    assert settings.BY_NAME["BONSAI_SSD_EMBED_HOT"].shown_default.startswith("32000")
    assert settings.get("BONSAI_SSD_EMBED_DIR", {"BONSAI_SSD_EMBED_DIR": " "}) is None  # off, as before
    assert settings.get("BONSAI_K3V2_PREFILL_KERNEL", {}) is True
    assert settings.get("BONSAI_SKIP_CHECK", {}) is False
    assert settings.get("BONSAI_SKIP_CHECK", {"BONSAI_SKIP_CHECK": "yes"}) is True


# ---- what is generated from the records


def test_docs_settings_md_is_current():
    doc = REPO / "docs" / "settings.md"
    assert doc.read_text() == settings.markdown(), \
        "docs/settings.md is stale: .venv/bin/python -m bonsai_vllm.settings --markdown > docs/settings.md"
    for s in SETTINGS:
        assert f"`{s.name}`" in doc.read_text()


def _run(*args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=env)


def test_the_module_prints_the_table_and_imports_nothing_heavy():
    r = _run("-m", "bonsai_vllm.settings", "--markdown")
    assert r.returncode == 0 and r.stdout == settings.markdown(), r.stderr
    r = _run("-c", "import sys, bonsai_vllm.settings; print(sorted({'torch', 'vllm', 'numpy'} & set(sys.modules)))")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_bonsai_serve_help_lists_every_setting():
    r = _run("-m", "bonsai_vllm.serve", "--help")
    assert r.returncode == 0, r.stderr
    from bonsai_vllm.serve import KNOBS

    for kn in KNOBS:
        assert kn.env in r.stdout
    for s in SETTINGS:
        line = next((x for x in r.stdout.splitlines() if x.strip().startswith(s.name + " ")), None)
        assert line is not None, f"{s.name} missing from bonsai-serve --help"
        assert f"default {s.default_text()}" in line


def test_bonsai_serve_refuses_a_bad_switch_before_anything(fresh, capsys):
    from bonsai_vllm import serve

    fresh.setenv("BONSAI_PRIORITY_PREEMPT", "sometimes")
    fresh.setenv("BONSAI_AR_INT", "0")
    assert serve.main(["--print"]) == 2
    err = capsys.readouterr().err
    assert "BONSAI_PRIORITY_PREEMPT='sometimes'" in err and "1/true/yes/on" in err
    assert "warning: BONSAI_AR_INT is set" in err
    fresh.setenv("BONSAI_PRIORITY_PREEMPT", "no")
    assert serve.main(["--print"]) == 0
