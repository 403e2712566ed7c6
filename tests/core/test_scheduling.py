"""The scheduling policy (scheduling): who is preempted, and the prefill budget."""

from __future__ import annotations

from bonsai_vllm.scheduling import Job, PolicyConfig, choose_victims, prefill_budget


def jobs(*specs):
    return [Job(f"r{i}", prio, arrival, blocks) for i, (prio, arrival, blocks) in enumerate(specs)]


def test_worst_priority_then_latest_arrival_goes_first():
    running = jobs((10, 1.0, 4), (10, 2.0, 4), (5, 0.5, 4))
    victims = choose_victims(Job("chat", 0, 9.0, 1), running, free_slots=0, free_blocks=100)
    assert [v.id for v in victims] == ["r1"]  # priority 10, arrived last


def test_only_as_many_as_needed_for_blocks():
    running = jobs((10, 1.0, 3), (10, 2.0, 3), (10, 3.0, 3))
    victims = choose_victims(Job("chat", 0, 9.0, 5), running, free_slots=1, free_blocks=0)
    assert [v.id for v in victims] == ["r2", "r1"]  # 6 blocks cover the need of 5; r0 keeps running


def test_no_preemption_when_a_slot_and_blocks_are_free():
    assert choose_victims(Job("chat", 0, 9.0, 2), jobs((10, 1.0, 3)), free_slots=1, free_blocks=10) == []


def test_equal_priority_never_preempts():
    assert choose_victims(Job("agent", 10, 9.0, 1), jobs((10, 1.0, 3), (10, 2.0, 3)), 0, 100) == []


def test_better_arrival_alone_does_not_preempt():
    # Same priority, earlier arrival: FCFS order among equals is not a reason to preempt.
    assert choose_victims(Job("early", 10, 0.1, 1), jobs((10, 1.0, 3)), 0, 100) == []


def test_no_pointless_preemption():
    # Even preempting every eligible job would not free enough blocks: preempt nobody.
    running = jobs((10, 1.0, 1), (0, 2.0, 50))
    assert choose_victims(Job("chat", 5, 9.0, 20), running, free_slots=1, free_blocks=0) == []


def test_prefill_budget_while_decoding_and_idle():
    cfg = PolicyConfig()
    busy = prefill_budget(cfg, decode_tokens=3, max_tokens=2048)
    assert (busy.total_tokens, busy.per_request) == (3 + 256, 256)
    idle = prefill_budget(cfg, decode_tokens=0, max_tokens=2048)
    assert (idle.total_tokens, idle.per_request) == (2048, 512)


def test_config_from_env():
    cfg = PolicyConfig.from_env({"BONSAI_PRIORITY_PREEMPT": "0", "BONSAI_PREFILL_BUDGET_DECODING": "128"})
    assert not cfg.preempt and cfg.decode_prefill_budget == 128 and cfg.idle_prefill_chunk == 512
