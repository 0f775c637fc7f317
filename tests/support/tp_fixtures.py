"""Test-only fixtures (a pytest plugin, `tests/conftest.py`): one spawn of two healthy gloo
ranks, shared by the tensor-parallel tests that keep the group healthy.

Starting a rank costs seconds on a small machine, so the sharded-model forwards, the lossless
matrix and the faults the group survives (divergence, a fault on every rank) run in one spawn
(`tp_programs.healthy_programs`); the tests that break the group spawn their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hf_oracle import make_checkpoint
from margin_screen import screen
from spec_checkpoints import SpecCheckpoints, family_options
from tp_matrix import NEW_TOKENS, matrix_scenarios
from tp_programs import LIMITS_VOCAB, healthy_programs

from specstate.distributed import spawn_ranks


@pytest.fixture(scope="session")
def tp_paths(partial_ckpt: SpecCheckpoints) -> dict[str, str]:
    """The partly agreeing checkpoints (target, draft, eagle; the target with MTP layers, an
    EAGLE-3 head), as paths the ranks load."""
    paths = {k: str(getattr(partial_ckpt, k)) for k in ("target", "draft", "eagle")}
    paths["mtp_target"] = str(family_options(partial_ckpt.target, "mtp")["target"])
    paths["eagle3"] = str(family_options(partial_ckpt.target, "eagle3")["eagle3"])
    return paths


@pytest.fixture(scope="session")
def tp_screened(partial_ckpt: SpecCheckpoints) -> dict[tuple[int, ...], list[int]]:
    """Greedy prompts whose top-2 margin exceeds 1e-3 at every step, with HF's tokens."""
    return screen(
        partial_ckpt.hf,
        (2, 7, 15, 4, 11, 3, 9, 5, 13, 6),
        vocab_size=LIMITS_VOCAB,
        max_new_tokens=NEW_TOKENS,
        keep=4,
    )


@pytest.fixture(scope="session")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer tiny checkpoint for the sharded-model forwards."""
    root = tmp_path_factory.mktemp("tp_model")
    make_checkpoint(root, layers=2)
    return root


@pytest.fixture(scope="session")
def tp_healthy(
    tp_model: Path, tp_paths: dict[str, str], tp_screened: dict[tuple[int, ...], list[int]]
) -> list[dict[str, Any]]:
    """Both ranks' results: ``sharded`` forwards, the lossless ``matrix``, the ``faults``."""
    outcomes = spawn_ranks(
        healthy_programs,
        (str(tp_model), tp_paths, matrix_scenarios(tp_screened)),
        world_size=2,
        timeout_s=400,
    )
    for outcome in outcomes:
        assert outcome.ok, outcome.traceback or outcome.error
    return [o.result for o in outcomes]
