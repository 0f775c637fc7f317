"""Serving: the asyncio front door of an engine, and an OpenAI-compatible HTTP server.

* `specstate.serving.async_engine.AsyncEngine` (exported as ``specstate.AsyncEngine``): one
  `Engine` on a driver thread of its own, served to asyncio code (`RequestStream` per request).
* ``specstate.serving.openai_server``: ``specstate serve``, the ``/v1/completions`` server
  (the ``serve`` extra: Starlette and uvicorn). Only that module and the modules it imports
  need the extra; ``import specstate`` and the front door never do.

This package imports nothing itself: each module is imported when used.
"""
