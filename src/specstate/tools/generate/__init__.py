"""``specstate generate``: run a JSONL of requests through the engine on an HF Llama checkpoint.

Input, one JSON object per line:

    {"id": str, "input_ids": [int, ...] | "text": str, "max_new_tokens"?: int,
     "stop_token_ids"?: [int, ...], "temperature"?: number, "top_p"?: number,
     "top_k"?: int | null, "seed"?: int | null, "speculative"?: bool,
     "repetition_penalty"?: number, "frequency_penalty"?: number,
     "presence_penalty"?: number, "min_new_tokens"?: int,
     "stop_sequences"?: [[int, ...], ...], "logprobs"?: bool, "top_logprobs"?: int,
     "grammar"?: {"json_schema": {...}} | {"regex": str} | {"ebnf": str} | {"lark": str}}

``--input -`` reads the lines from standard input; ``--output`` defaults to ``-``, standard
output, where only the result rows go (the progress bar and the summary are on stderr).

Output, one per request in input order: ``{"id", "output_ids", "finish_reason",
"accept_lengths", "cached_tokens"}`` (``cached_tokens``: prompt tokens the prefix cache
supplied; ``--no-prefix-cache`` turns the cache off), plus ``"text"`` (the output decoded)
when the request gave ``"text"``, ``"logprobs"`` (one float per output token) when it asked
for them, ``"top_logprobs"`` (per output token, its ``top_logprobs`` most likely
``[token id, logprob]`` pairs, most likely first; ``null`` for an alternative the sampling
filters removed) when it asked for them (with ``logprobs``, at most 20), and ``"error"`` (the
reason) for a request that ended with an error; the exit code is then 1.
``--trace FILE`` records the run (spans, rounds, events: the JSONL of `specstate.engine.trace`,
read back by ``specstate trace FILE``) and ``--perfetto FILE`` writes its timeline as Chrome /
Perfetto trace events. On a terminal a progress bar runs on stderr; at the end a summary
(requests, tokens, tok/s, mean accept length, prefix-cache hit rate) goes to stderr, and with
``--summary-json FILE`` to a file as JSON.

Input is read strictly: a line with an unknown field or a wrong type or range (a string of
digits for ``input_ids``, a float, a bool, a null ``id``, a negative temperature) fails before
any request runs, naming the file, the line and the field; so does an output path that cannot be
written. Result rows are written in input order as soon as a request and every earlier one have
ended, so nothing computed is lost if the run stops.

``text`` needs a ``--model`` that can encode it: a byte-level checkpoint (`byte_codec`: its ids
0-255 are the UTF-8 bytes, as in the embedded model; the prompt is its BOS id, if the config
names one, then the text's bytes), or one with a tokenizer beside its weights
(`specstate.serving.text.load_codec`); otherwise a text line is refused, naming it.
``seed`` is the request's own seed (`SamplingParams.seed`): a seeded sampled request emits the
same tokens whatever else runs; ``--seed`` seeds the worker's generator, which the unseeded
sampled requests draw from. ``grammar`` constrains the output (`SamplingParams.grammar`): the
checkpoint's limits carry its vocabulary as bytes (`checkpoint_limits`: a byte-level
checkpoint's, or read from a byte-level BPE or SentencePiece-style ``tokenizer.json``); with a
checkpoint that has neither a grammar request is refused, naming its line.

``--worker MODULE:FACTORY`` drives a custom worker: ``FACTORY(args)`` receives the parsed
arguments (an `argparse.Namespace`; ``args.seed`` is ``--seed``, the worker's seed, or None)
and returns ``(worker, limits)``, a `WorkerProtocol` and the `RequestLimits` of its model;
`build_worker` is the default factory and `checkpoint_limits` reads the limits of a checkpoint.

The command is split by owner:

* `specstate.tools.generate.options` — the flags, one function per group; the worker and engine
  flags and the `EngineConfig` they make (`engine_config`) are shared with ``specstate serve``
  in `specstate.tools.engine_options`: a new engine flag is one ``add_argument`` and one
  keyword there;
* `specstate.tools.generate.request_lines` — reading and validating the JSONL requests;
* `specstate.serving.byte_codec` — text prompts on a byte-level checkpoint (a tokenizer's
  codec is `specstate.serving.text.load_codec`);
* `specstate.tools.generate.workers` — the worker and the engine (`build_worker`,
  ``--worker`` factories, `checkpoint_limits`);
* `specstate.tools.generate.report` — result rows, the progress bar and the summary;
* `specstate.tools.generate.command` — the run itself, top-down.

None of them imports torch or the engine at import time, so ``--help`` is instant.
"""

from __future__ import annotations

from specstate.serving.byte_codec import ByteCodec, byte_codec
from specstate.tools.generate.command import run
from specstate.tools.generate.options import add_arguments
from specstate.tools.generate.report import RunSummary
from specstate.tools.generate.workers import (
    WorkerFactory,
    build_worker,
    checkpoint_limits,
    load_factory,
)

__all__ = [
    "ByteCodec",
    "RunSummary",
    "WorkerFactory",
    "add_arguments",
    "build_worker",
    "byte_codec",
    "checkpoint_limits",
    "load_factory",
    "run",
]
