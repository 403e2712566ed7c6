"""Priority preemption and a prefill budget on top of vLLM 0.32's scheduler.

Load with `--scheduling-policy priority --scheduler-cls bonsai_vllm.adapters.scheduler.PreemptScheduler`
(or `AsyncPreemptScheduler` where vLLM runs async scheduling, as it does on GPU: a plain `Scheduler`
subclass turns async scheduling off). Before each step:

1. Preemption: when the best waiting request has strictly better priority than some running one and no
   slot (or not enough KV blocks) is free, the worst running requests by (priority, arrival) are
   preempted — only as many as needed — and the waiting one is admitted in the same step. Preempted
   requests go back to the waiting queue and resume later by recompute (prefix caching makes it cheap).
   A request preempted less than `cooldown` steps ago never triggers a preemption itself.
2. Prefill budget: while any request decodes, at most 256 prefill tokens per step in total; when nobody
   decodes, chunks of up to 512 tokens per request.

The decisions are `bonsai_vllm.scheduling`; this file applies them to vLLM's state. Knobs:
`BONSAI_PRIORITY_PREEMPT=0` (stock behaviour), `BONSAI_PREFILL_BUDGET_DECODING`,
`BONSAI_PREFILL_CHUNK_IDLE` (0 disables the budget), `BONSAI_PREEMPT_COOLDOWN`, and
`BONSAI_SCHED_TRACE=/path` — one JSON line per step (its wall-clock time, tokens scheduled, prefill tokens,
preemptions).
"""

from __future__ import annotations

import json
import logging
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from bonsai_vllm import settings
from bonsai_vllm.scheduling import Job, PolicyConfig, choose_victims, prefill_budget

logger = logging.getLogger("vllm.bonsai")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PreemptMixin:
    """Mixed into vLLM's Scheduler / AsyncScheduler; see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bonsai = PolicyConfig.from_env()
        self.bonsai_preempted_at: dict[str, int] = {}
        self.bonsai_preemptions = 0
        trace = settings.get("BONSAI_SCHED_TRACE")
        self.bonsai_trace = open(trace, "a", buffering=1) if trace is not None else None
        if self.policy != SchedulingPolicy.PRIORITY and self.bonsai.preempt:
            logger.warning("bonsai scheduler: preemption needs --scheduling-policy priority; it is off")
        logger.info("bonsai scheduler: %s", self.bonsai)

    # -- 1. preemption -------------------------------------------------------------------------------

    def _job(self, request: Request, blocks: int) -> Job:
        return Job(request.request_id, request.priority, request.arrival_time, blocks)

    def _preempt_for_waiting(self, step: int) -> list[str]:
        if not self.waiting or not self.running:
            return []
        candidate = self.waiting.peek_request()
        if candidate.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return []  # waiting for something else (remote KV, grammar): a slot would not help it yet
        since = self.bonsai_preempted_at.get(candidate.request_id)
        if since is not None and step - since < self.bonsai.cooldown_steps:
            return []
        block_size = self.cache_config.block_size
        free_slots = self.max_num_active_reqs - len(self.running) - self.num_waiting_for_streaming_input
        free_blocks = self.kv_cache_manager.block_pool.get_num_free_blocks()
        running = [self._job(r, _cdiv(r.num_computed_tokens, block_size)) for r in self.running]
        victims = choose_victims(self._job(candidate, _cdiv(candidate.num_tokens, block_size)),
                                 running, free_slots, free_blocks)
        if not victims:
            return []
        now = time.monotonic()
        by_id = {r.request_id: r for r in self.running}
        for victim in victims:
            request = by_id[victim.id]
            self.running.remove(request)
            self._preempt_request(request, now, drop_stale_output=self.requires_kv_delivery)
            self.bonsai_preempted_at[victim.id] = step
            self.bonsai_preemptions += 1
            logger.info("bonsai scheduler: preempted %s (priority %d) for %s (priority %d)",
                        victim.id, victim.priority, candidate.request_id, candidate.priority)
        return [v.id for v in victims]

    # -- 2. prefill budget ---------------------------------------------------------------------------

    def _decoding(self) -> dict[str, int]:
        """Running requests past their prompt, with the tokens a decode step gives each (1 + drafts)."""
        return {r.request_id: 1 + len(r.spec_token_ids) for r in self.running
                if not r.is_prefill_chunk and r.num_computed_tokens > 0}

    def schedule(self, *args, **kwargs):
        step = self.current_step + 1  # super().schedule() increments it first thing
        preempted = []
        if self.bonsai.preempt and self.policy == SchedulingPolicy.PRIORITY:
            preempted = self._preempt_for_waiting(step)

        saved = (self.max_num_scheduled_tokens, self.scheduler_config.long_prefill_token_threshold,
                 self.adaptive_long_prefill_threshold)
        decoding = self._decoding()
        decode_tokens = sum(decoding.values())
        if self.bonsai.decode_prefill_budget > 0 and self.bonsai.idle_prefill_chunk > 0:
            budget = prefill_budget(self.bonsai, decode_tokens, saved[0])
            self.max_num_scheduled_tokens = budget.total_tokens
            self.scheduler_config.long_prefill_token_threshold = budget.per_request
            self.adaptive_long_prefill_threshold = False
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            (self.max_num_scheduled_tokens, self.scheduler_config.long_prefill_token_threshold,
             self.adaptive_long_prefill_threshold) = saved
        if self.bonsai_trace is not None:
            self._trace(step, output, decoding, preempted)
        return output

    def _trace(self, step: int, output, decoding: dict[str, int], preempted: list[str]) -> None:
        counts = output.num_scheduled_tokens  # {request id: tokens this step}
        # A decoding request's tokens beyond its decode share would be prefill; everyone else's are.
        prefill = sum(max(0, n - decoding.get(rid, 0)) for rid, n in counts.items())
        self.bonsai_trace.write(json.dumps({
            "step": step, "time": time.time(), "total": output.total_num_scheduled_tokens, "prefill": prefill,
            "decoding": len(decoding), "requests": counts, "preempted": preempted,
            "running": len(self.running), "waiting": len(self.waiting)}) + "\n")


class PreemptScheduler(PreemptMixin, Scheduler):
    """vLLM's synchronous Scheduler with priority preemption and the prefill budget."""


class AsyncPreemptScheduler(PreemptMixin, AsyncScheduler):
    """vLLM's AsyncScheduler (the GPU default) with priority preemption and the prefill budget."""
