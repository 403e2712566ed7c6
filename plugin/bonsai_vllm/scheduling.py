"""Scheduling policy for a shared GPU, free of vLLM: who gets preempted, and how much prefill a step takes.

vLLM 0.32 never preempts a running request for a waiting one of better priority: a chat user waited
30–58 s behind 16 agent streams in report 002 §3 (docs/field-reports.md), and 0.2–0.3 s once the waiting
request could preempt the lowest-priority running one. Report 000 §4 capped the prefill mixed into each
step so that a long document being read does not drop everyone else's generation to 4 tok/s. The adapter
(`bonsai_vllm.adapters.scheduler`) applies these decisions to vLLM's scheduler state.

Priorities follow vLLM: a lower number runs first; ties go to the earlier arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from bonsai_vllm import settings


@dataclass(frozen=True)
class Job:
    """What the policy needs to know about one request."""

    id: str
    priority: int
    arrival: float
    blocks: int = 0  # KV blocks it holds (running) or needs (waiting)

    @property
    def rank(self) -> tuple[int, float]:
        return (self.priority, self.arrival)  # larger = less important


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs, from the environment of the engine process (see `from_env`)."""

    preempt: bool = True  # BONSAI_PRIORITY_PREEMPT
    decode_prefill_budget: int = 256  # BONSAI_PREFILL_BUDGET_DECODING: prefill tokens per step, all requests
    idle_prefill_chunk: int = 512  # BONSAI_PREFILL_CHUNK_IDLE: per request per step when nobody decodes
    cooldown_steps: int = 16  # BONSAI_PREEMPT_COOLDOWN: steps a preempted request cannot trigger preemption

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "PolicyConfig":
        """From `env` if given, else the process environment (read once; bonsai_vllm.settings)."""
        return cls(
            preempt=settings.get("BONSAI_PRIORITY_PREEMPT", env),
            decode_prefill_budget=settings.get("BONSAI_PREFILL_BUDGET_DECODING", env),
            idle_prefill_chunk=settings.get("BONSAI_PREFILL_CHUNK_IDLE", env),
            cooldown_steps=settings.get("BONSAI_PREEMPT_COOLDOWN", env),
        )


def choose_victims(candidate: Job, running: list[Job], free_slots: int, free_blocks: int) -> list[Job]:
    """The running jobs to preempt so that `candidate` can be admitted now, or [] if it cannot or need not.

    Only jobs strictly less important than the candidate are eligible, worst (priority, arrival) first,
    and only as many as needed: one slot if none is free, plus enough blocks for the candidate's need.
    Equal priorities never preempt each other, which is also what keeps a preempted job (now waiting with
    its old priority) from immediately preempting its way back in.
    """
    need_slot = free_slots <= 0
    need_blocks = max(0, candidate.blocks - free_blocks)
    if not need_slot and not need_blocks:
        return []
    eligible = sorted((j for j in running if j.priority > candidate.priority), key=lambda j: j.rank, reverse=True)
    victims: list[Job] = []
    freed = 0
    for job in eligible:
        if (not need_slot or victims) and freed >= need_blocks:
            break
        victims.append(job)
        freed += job.blocks
    if freed < need_blocks or (need_slot and not victims):
        return []  # preempting everyone eligible would still not admit it: preempt no one
    return victims


@dataclass(frozen=True)
class PrefillBudget:
    total_tokens: int  # token budget of the step (decode tokens + prefill allowance)
    per_request: int  # chunk limit for one request's prefill in the step


def prefill_budget(cfg: PolicyConfig, decode_tokens: int, max_tokens: int) -> PrefillBudget:
    """While anyone decodes: decode tokens + at most `decode_prefill_budget` prefill tokens in total.
    When nobody decodes: the engine's full budget, with chunks of `idle_prefill_chunk` per request."""
    if decode_tokens > 0:
        return PrefillBudget(total_tokens=min(max_tokens, decode_tokens + cfg.decode_prefill_budget),
                             per_request=cfg.decode_prefill_budget)
    return PrefillBudget(total_tokens=max_tokens, per_request=cfg.idle_prefill_chunk)
