"""Shared fixtures: every test runs with the run-time ownership check on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from block_checkpoints import BlockCheckpoints, make_block_checkpoints
from dspark_checkpoints import make_dspark_assistant
from memory_harness import Memory, build_memory
from spec_checkpoints import SpecCheckpoints, make_partial_drafters, make_spec_checkpoints

from specstate.internals import OwnershipChecker

pytest_plugins = ["tp_fixtures"]  # the tensor-parallel tests' shared spawn (tests/support)


@pytest.fixture
def checker() -> OwnershipChecker:
    """A fresh ownership checker in checking mode."""
    return OwnershipChecker(enabled=True)


@pytest.fixture
def memory() -> Memory:
    """A memory layer with page size 1, 64 pages, 8 request slots, a chain window (L 4, R 8)."""
    return build_memory()


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models on 2 shared cores: one intra-op thread is faster and does not spin-wait.

    Per test, so a test that sets the threads (``--threads``) cannot slow the ones after it.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def partial_ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """The default tiny target with drafters that agree with it partly, built once.

    Shared by many modules: tests read it and never change its weights.
    """
    root = tmp_path_factory.mktemp("partial_ckpt")
    return make_partial_drafters(make_spec_checkpoints(root), root)


@pytest.fixture(scope="session")
def block_ckpt(tmp_path_factory: pytest.TempPathFactory) -> BlockCheckpoints:
    """The block drafters' target with its distilled DFlash assistant and UNO adapter, built
    once (a few seconds). Shared by many modules: tests read it and never change it."""
    return make_block_checkpoints(tmp_path_factory.mktemp("block_ckpt"))


@pytest.fixture(scope="session")
def dspark_assistant(
    block_ckpt: BlockCheckpoints, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A DSpark assistant on `block_ckpt`'s DFlash assistant, its heads fitted to the target
    (`dspark_checkpoints`), built once. Tests read it and never change it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return make_dspark_assistant(block_ckpt, tmp_path_factory.mktemp("dspark") / "assistant")
    finally:
        torch.set_num_threads(threads)
