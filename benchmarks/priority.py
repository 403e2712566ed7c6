"""`make bench-priority`: the scheduler's effect on CPU with the tiny model, on versus off, side by side.

1. Time to first token of a priority-0 request while `--max-num-seqs` priority-10 requests stream long
   outputs (preemption on vs `BONSAI_PRIORITY_PREEMPT=0`).
2. Inter-token gaps of a decoding request while a ~1500-token prompt is prefilled (prefill budget on vs
   `BONSAI_PREFILL_BUDGET_DECODING=0`, vLLM's own budget).

Uses the tests' stream helpers (tests/test_scheduler_served.py). Prints a table for docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the contention scenario is the test's

from bonsai_vllm.testing.tiny import write_tiny  # noqa: E402
from bonsai_vllm.testing.devserver import VllmServer  # noqa: E402
from test_scheduler_served import (SOLO_TOKENS, Stream, agent_length, run_contention, server_args,  # noqa: E402
                                   traces_env)

LONG_PROMPT = " ".join(["The green fox sleeps under the white tree."] * 150)


def itl_during_prefill(url: str) -> tuple[float, float]:
    """(median, max) gap in seconds between a decoding stream's tokens while a long prompt is prefilled."""
    decoding = Stream(url, 10, 80)
    decoding.start()
    decoding.wait_tokens(5)
    t0 = time.monotonic()
    doc = Stream(url, 5, 2, prompt=LONG_PROMPT)
    doc.start()
    doc.join(600)
    t1 = doc.first_token or time.monotonic()
    decoding.join(600)
    times = [t for t in decoding.token_times if t0 <= t <= t1]
    gaps = [b - a for a, b in zip(times, times[1:])] or [t1 - t0]
    return statistics.median(gaps), max(gaps)


def measure(model: Path, env: dict[str, str], trace: Path) -> dict[str, float]:
    with VllmServer(model, server_args(), env={**traces_env(trace), **env}) as srv:
        solo = Stream(srv.url, 10, SOLO_TOKENS)  # warm-up, and the decode rate that sizes the agents
        solo.run()
        agents, chat, _, agent_tokens = run_contention(srv.url, trace, chat_priority=0,
                                                       agent_tokens=agent_length(solo))
        med, worst = itl_during_prefill(srv.url)
        return {"ttft": chat.ttft, "agents_done": min(a.end for a in agents) - chat.start_time,
                "agent_tokens": sum(a.tokens for a in agents), "asked": 2 * agent_tokens,
                "itl_median": med, "itl_max": worst}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny(Path(tmp) / "tiny", seed=0)
        on = measure(model, {}, Path(tmp) / "on.jsonl")
        off = measure(model, {"BONSAI_PRIORITY_PREEMPT": "0", "BONSAI_PREFILL_BUDGET_DECODING": "0"},
                      Path(tmp) / "off.jsonl")
    print("\n| measure | scheduler on | off (stock) | ratio |\n| --- | --- | --- | --- |")
    print(f"| chat TTFT behind 2 agent streams (s) | {on['ttft']:.3f} | {off['ttft']:.3f} | "
          f"{off['ttft'] / on['ttft']:.1f}× |")
    print(f"| agent tokens delivered (of {on['asked']} / {off['asked']} asked) | {on['agent_tokens']} | "
          f"{off['agent_tokens']} | |")
    print(f"| decode gap during a 1500-token prefill, median (s) | {on['itl_median']:.3f} | "
          f"{off['itl_median']:.3f} | |")
    print(f"| decode gap during a 1500-token prefill, max (s) | {on['itl_max']:.3f} | {off['itl_max']:.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
