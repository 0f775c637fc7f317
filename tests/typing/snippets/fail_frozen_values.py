"""Frozen values and append-only outputs: assignments and list mutation must fail mypy."""

from specstate import Req, SamplingParams
from specstate.internals import KvLedgerSnapshot


def tamper(snap: KvLedgerSnapshot, req: Req, params: SamplingParams) -> None:
    snap.kv_committed_len = 3  # E: misc
    params.max_new_tokens = 7  # E: misc
    req.output_ids.append(4)  # E: attr-defined
    req.request_id = "other"  # E: misc
    req.status = req.status  # E: misc
