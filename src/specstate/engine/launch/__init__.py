"""Launching: the forward stream's one in-flight owner, the result copy and the result check."""
