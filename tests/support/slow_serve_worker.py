"""Test-only: a ``specstate serve --worker`` factory whose forward takes 20 ms.

Two tokens a round at 20 ms a forward: a request for thousands of tokens keeps the server busy
for tens of seconds, long enough to interrupt it mid-stream.
"""

from __future__ import annotations

import argparse

from specstate.core.params import RequestLimits
from specstate.engine.worker import WorkerProtocol
from specstate.tools.timed_worker import TimedWaitWorker


def make(args: argparse.Namespace) -> tuple[WorkerProtocol, RequestLimits]:
    """The slow stand-in worker and its limits (32 ids, an 8192-token context, no EOS)."""
    return TimedWaitWorker(device_seconds=0.02), RequestLimits(vocab_size=32, max_context_len=8192)
