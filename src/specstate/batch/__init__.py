"""Batch layer: forward modes, schedule / forward batches and results."""
