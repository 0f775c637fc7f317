"""A settlement's ``live`` mask: every row of a round nobody left, sized to the batch as it
shrinks, and read only (a steady round reuses one mask instead of allocating it)."""

from __future__ import annotations

from engine_driver import checked_config, run_checked

from specstate import Engine, RequestLimits, SamplingParams
from specstate.engine.launch.outcome import Collected
from specstate.engine.settle.results import Settlement
from specstate.tools.timed_worker import TimedWaitWorker


def test_every_row_of_a_round_nobody_left_is_live_and_the_mask_is_read_only() -> None:
    config = checked_config(overlap=False, page_size=4)
    worker = TimedWaitWorker(device_seconds=0.0, accept=2)
    engine = Engine(worker, limits=RequestLimits(vocab_size=32, max_context_len=128), config=config)
    seen: list[tuple[int, list[bool], bool]] = []

    def record(collected: Collected, settlement: Settlement | None) -> None:
        if settlement is not None and collected.plan.is_decode:
            live = settlement.live
            seen.append((collected.plan.batch.batch_size, live.tolist(), live.flags.writeable))

    hooks = engine.rounds.hooks
    hooks.on_settled = (*hooks.on_settled, record)
    caps = (6, 11, 17)
    for i, cap in enumerate(caps):
        engine.submit(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=cap, ignore_eos=True))
    run_checked(engine)
    engine.close()
    assert {size for size, _, _ in seen} == {1, 2, 3}  # the batch shrank as requests ended
    for size, live, writeable in seen:
        assert live == [True] * size
        assert not writeable
