"""Relay layer: the FutureMap, forward isolation and streams."""
