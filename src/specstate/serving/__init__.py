"""Serving: the asyncio front door of an engine, and an OpenAI-compatible HTTP server.

* `specstate.serving.async_engine.AsyncEngine` (exported as ``specstate.AsyncEngine``): one
  `Engine` on a driver thread of its own, served to asyncio code (`RequestStream` per request).
* `specstate.serving.request_metrics`: the front door's request latencies and token counts
  (`AsyncEngine.request_metrics`), exported to Prometheus by ``register_request_metrics``.
* `specstate.serving.text`: a checkpoint's text codec (``load_codec``) and ``TextStream``, text
  handed out piece by piece as tokens stream in.
* ``specstate.serving.openai_server``: ``specstate serve``, the ``/v1/completions`` server
  (the ``serve`` extra: Starlette and uvicorn), and ``specstate.serving.uvicorn_server``, the
  uvicorn server it runs in (an interrupt ends the live requests first). Only those modules
  and the modules they import need the extra; ``import specstate`` and the front door never do.

This package imports nothing itself: each module is imported when used.
"""
