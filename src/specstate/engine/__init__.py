"""Engine layer: the worker contract, the owners of one round, its capabilities, the round itself.

* ``worker``, ``config``, ``planning``, ``draft_policy``, ``trace``, ``hooks`` (the capability
  seam), ``invariants``: what the owners and capabilities share;
* ``schedule/`` (intake, admission, the persistent decode rows), ``launch/`` (the forward
  stream's in-flight owner, the result copy and check), ``settle/`` (the result processor, the
  output table, the lifecycle: the one place a request ends);
* ``capabilities/``: grammar, rank agreement, the draft policy guard, stream delivery, tracing;
* ``rounds`` (the step, top-down), ``compose`` (the composition root), ``engine`` (`Engine`, the
  public API), ``stream``, ``metrics``.
"""
