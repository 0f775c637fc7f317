"""The host-cost workload: every draw both sides of ``specstate bench host`` replay.

This module imports only the standard library, so a peer's harness (another project's virtual
environment) loads it by file path and replays exactly the same requests, accept lengths and
finishes. `digest` fingerprints a run's draws (`cohort_digest` those of the requests running
from the first round); `specstate bench compare` shows whether two reports' digests agree.

**Churned** (the default): a steady batch of ``bs`` requests where requests finish and new
ones join every round. Request ``j`` draws, in this order, from one ``random.Random(2468)``
stream (requests drawn in index order, each one whole):

* ``prompt_len = randint(100, 2000)``;
* ``length = min(1024, 2 + int(expovariate(1 / 200)))`` output tokens (a long-tailed length,
  mean about 200); the first ``bs`` requests are already running when the run starts, so they
  keep only a uniform share: ``length = max(2, ceil(length * random()))``;
* ``by_eos = random() < 0.5``: the request ends on EOS, which is output ``length - 1`` (it
  lies inside an accepted run, and the run's tokens after it are dropped); otherwise it ends
  on its cap, ``max_new_tokens = length``;
* accept lengths ``randint(1, 4)``, one per verify, until they cover ``length`` outputs.

Output 0 is the prefill's token; verify ``k`` appends ``accepts[k]`` tokens. A request in the
batch of round ``r`` takes its next verify's draw; after round ``r`` settles, the requests it
finished leave, and as many new requests (the next indices) are prefilled (not timed) and
join round ``r + 1``, so every round runs ``bs`` requests.

**Steady**: no request finishes or joins: prompt lengths from ``random.Random(1234)``
(100..2000), accept lengths from ``random.Random(5678)`` (1..4, drawn round-major: draw
``r * bs + i`` is row ``i`` of round ``r``).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

__all__ = [
    "EOS",
    "FILLER",
    "Draws",
    "Request",
    "cohort_digest",
    "digest",
    "kv_tokens",
    "steady_accepts",
    "steady_prompts",
]

VOCAB = 32000
EOS = 31999
FILLER = 7
"""Every output token that is not EOS (token values do not change any bookkeeping)."""
MAX_ACCEPT = 4
MAX_LENGTH = 1024
MEAN_LENGTH = 200
PROMPT_RANGE = (100, 2000)


@dataclass
class Request:
    """One churned request's draws."""

    index: int
    prompt_len: int
    length: int
    by_eos: bool
    accepts: list[int]
    verifies: int = field(default=0)  # verifies taken so far (the replay's cursor)
    emitted: int = field(default=1)  # outputs so far (the prefill's token is output 0)

    @property
    def max_new_tokens(self) -> int:
        """The cap a request is submitted with (EOS requests never reach theirs)."""
        return MAX_LENGTH + 8 if self.by_eos else self.length

    def next_run(self) -> tuple[int, list[int]]:
        """The next verify's accept length and its 4 tokens (EOS where it falls); advances."""
        accept = self.accepts[self.verifies] if self.verifies < len(self.accepts) else 1
        self.verifies += 1
        tokens = [FILLER] * MAX_ACCEPT
        if self.by_eos and self.emitted <= self.length - 1 < self.emitted + accept:
            tokens[self.length - 1 - self.emitted] = EOS
        self.emitted += accept
        return accept, tokens


class Draws:
    """The churned requests of one run, drawn on demand in index order."""

    def __init__(self, bs: int, seed: int = 2468) -> None:
        self._rng = random.Random(seed)
        self._bs = bs
        self.requests: list[Request] = []

    def next(self) -> Request:
        """Draw the next request."""
        rng, j = self._rng, len(self.requests)
        prompt = rng.randint(*PROMPT_RANGE)
        length = min(MAX_LENGTH, 2 + int(rng.expovariate(1 / MEAN_LENGTH)))
        if j < self._bs:
            length = max(2, math.ceil(length * rng.random()))
        by_eos = rng.random() < 0.5
        accepts: list[int] = []
        covered = 1
        while covered < length:
            a = rng.randint(1, MAX_ACCEPT)
            accepts.append(a)
            covered += a
        req = Request(index=j, prompt_len=prompt, length=length, by_eos=by_eos, accepts=accepts)
        self.requests.append(req)
        return req


def steady_prompts(bs: int) -> list[int]:
    """The steady workload's prompt lengths."""
    rng = random.Random(1234)
    return [rng.randint(*PROMPT_RANGE) for _ in range(bs)]


def steady_accepts(bs: int, rounds: int) -> list[list[int]]:
    """The steady workload's accept lengths, ``[round][row]``."""
    rng = random.Random(5678)
    return [[rng.randint(1, MAX_ACCEPT) for _ in range(bs)] for _ in range(rounds)]


def kv_tokens(bs: int, page: int, rounds: int, *, churn: bool) -> int:
    """KV pool size: nothing is ever short of memory (no retraction in either workload)."""
    growth = MAX_LENGTH + 8 if churn else MAX_ACCEPT * rounds
    need = bs * (PROMPT_RANGE[1] + 64 + growth + 2 * page + 16)
    return -(-need // page) * page


def digest(finished: list[tuple[int, int, int]]) -> str:
    """A fingerprint of a run: ``(round, request index, emitted tokens)`` of every finish."""
    text = ";".join(f"{r}:{i}:{n}" for r, i, n in sorted(finished))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cohort_digest(finished: list[tuple[int, int, int]], bs: int) -> str:
    """`digest` of the finishes of the first cohort only: the ``bs`` requests running from the
    first round (indices below ``bs``).

    Every side starts them together, so their finishes (the round of the forward that finished
    each, its index, its tokens) agree even between loops whose joiners start at different
    rounds: a loop that joins a request one round later (SGLang's overlap loop settles a result
    after the next launch; vLLM prefills a joiner inside its next ``schedule()``) shifts every
    later generation, so `digest` differs there while `cohort_digest` still agrees.
    """
    return digest([f for f in finished if f[1] < bs])
