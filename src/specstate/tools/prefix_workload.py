"""The prefix-cache workload: the requests both sides of ``specstate bench prefix`` replay.

This module imports only the standard library, so the peer harness
(``benchmarks/peers/sglang_radix_bench.py``, in SGLang's own virtual environment) loads it by
file path and replays exactly the requests `specstate.tools.bench_prefix` replays.

Conversations on ``GROUPS`` shared system prompts of ``SYSTEM_LEN`` random tokens: a new
conversation is a system prompt and a user message of ``USER_LEN`` tokens; the next turn of a
conversation that just finished is its prompt, its ``OUTPUT_LEN`` output tokens and a follow-up
of ``FOLLOW_LEN`` (a conversation longer than ``MAX_LEN`` starts over). Every draw comes from
one ``random.Random(seed)``.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["config", "make_workload"]

GROUPS = 8  # shared system prompts
SYSTEM_LEN = 1024  # tokens of each system prompt
USER_LEN = 128  # tokens of a new user message
FOLLOW_LEN = 32  # tokens of a follow-up message (the next turn of a conversation)
OUTPUT_LEN = 128  # tokens a request outputs
MAX_LEN = 2048  # a conversation longer than this starts over
VOCAB = 32000
NEXT_TURN = 0.5  # share of arrivals that continue a finished conversation


def make_workload(*, concurrency: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """The requests, in arrival order, and how many finish and arrive each round.

    ``concurrency`` requests are live at once. Each round the ``churn`` oldest finish and as
    many arrive: half the time the next turn of a conversation that just finished (its
    prompt, its output, a follow-up), else a new conversation on one of ``GROUPS`` system
    prompts. Every request is ``(prompt, output)``, token lists; the first ``concurrency``
    are live before round 0. ``budget_tokens`` is the cache size the replay evicts down to.
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(SYSTEM_LEN)] for _ in range(GROUPS)]

    def fresh() -> list[int]:
        user = [rng.randrange(VOCAB) for _ in range(USER_LEN)]
        return systems[rng.randrange(GROUPS)] + user

    def output() -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(OUTPUT_LEN)]

    churn = max(1, concurrency // 32)
    requests: list[tuple[list[int], list[int]]] = []
    for _ in range(concurrency):
        requests.append((fresh(), output()))
    live = list(range(concurrency))
    for _ in range(rounds):
        done, live = live[:churn], live[churn:]
        for i in done:
            prompt, out = requests[i]
            if rng.random() < NEXT_TURN and len(prompt) + OUTPUT_LEN + FOLLOW_LEN < MAX_LEN:
                follow = [rng.randrange(VOCAB) for _ in range(FOLLOW_LEN)]
                new = prompt + out + follow
            else:
                new = fresh()
            requests.append((new, output()))
            live.append(len(requests) - 1)
    budget = concurrency * 256 + GROUPS * SYSTEM_LEN  # the tree evicts in the steady state
    return {"requests": requests, "churn": churn, "budget_tokens": budget}


def config(rounds: int, warmup: int, seed: int) -> dict[str, int | float]:
    """The workload's parameters, echoed in both sides' reports."""
    return {
        "rounds": rounds,
        "warmup": warmup,
        "seed": seed,
        "groups": GROUPS,
        "system_len": SYSTEM_LEN,
        "user_len": USER_LEN,
        "follow_len": FOLLOW_LEN,
        "output_len": OUTPUT_LEN,
        "max_len": MAX_LEN,
        "next_turn": NEXT_TURN,
    }
