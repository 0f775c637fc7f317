"""Capabilities: owners that meet the round through its hook points (`specstate.engine.hooks`)."""
