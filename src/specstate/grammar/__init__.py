"""Structured output: per-request grammar state under speculation and overlap.

A request that sets ``SamplingParams(grammar=...)`` may only emit what its grammar allows. The
package has one owner and three parts, bottom to top:

* `specstate.grammar.spec` — the values: `Grammar` (a JSON schema, a regular expression, an
  EBNF or Lark grammar) and `GrammarVocabulary` (the bytes each token id stands for). No grammar
  library is imported there, so `SamplingParams` can carry a grammar in the core install.
* `specstate.grammar.state` — one request's matcher (llguidance, the ``grammar`` extra) with its
  committed position (settled tokens, advanced by the host at settlement) and its position on
  the forward stream (advanced by drafts, rolled back on rejection).
* `specstate.grammar.rows` — `GrammarRows`, the forward-scoped view a worker gets as
  ``ForwardBatch.grammar``: packed int32 bitmasks per sampled or verified position, built from
  exactly the drafts the forward verifies.
* `specstate.engine.capabilities.grammar` — `GrammarTable`, the owner, a capability of the
  round (above the engine's core, so not in this package): it compiles at submit, hands each
  launched batch its view, commits settled tokens, fails rows at dead ends, checks its
  invariants and takes its snapshot.

Nothing here is imported by ``import specstate.grammar``: import the module you need.
"""
