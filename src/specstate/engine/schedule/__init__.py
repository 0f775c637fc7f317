"""Scheduling: intake checks, admission, chunked prefill, the persistent decode rows, retraction."""
