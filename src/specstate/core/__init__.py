"""Core layer: errors, ownership roles, requests and the slot-indexed KV ledger."""
