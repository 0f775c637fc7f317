"""Frozen values and append-only outputs: assignments and list mutation must fail mypy."""

from specstate import KvLedgerSnapshot, Req, SamplingParams


def tamper(snap: KvLedgerSnapshot, req: Req, params: SamplingParams) -> None:
    snap.kv_committed_len = 3  # E: misc
    params.max_new_tokens = 7  # E: misc
    req.output_ids.append(4)  # E: attr-defined
    req.request_id = "other"  # E: misc
    req.status = req.status  # E: misc
