"""Tree drafting pieces on hand-built inputs: shape, selection, mask, verification, compaction.

Each piece of `specstate.reference.workers.tree` is checked against a value worked out by hand
(selection order, parents, depths, the accepted path through a non-first branch, the moved KV),
and the model's tree attention against separate chain forwards of every root-to-node path.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from specstate.batch.sampling import SamplingInfo, seeded_uniforms
from specstate.core.errors import InvalidConfig
from specstate.reference.model import (
    AttentionBatch,
    KvCache,
    ModelConfig,
    ModelOutput,
    PagedLlama,
    TreeAttentionBatch,
    TreeMask,
)
from specstate.reference.workers.sampler import TokenCounts, TokenSampler, sample_with_uniforms
from specstate.reference.workers.tree import compact_kv
from specstate.reference.workers.tree_draft import (
    DraftTree,
    TreeShape,
    grow_tree,
    select_tree,
    tree_attention,
    tree_capabilities,
)
from specstate.reference.workers.tree_verify import (
    TreeVerdict,
    tree_counts,
    verify_greedy_tree,
    verify_tree,
    verify_tree_targets,
)

VOCAB = 61


def tiny_model(seed: int, *, slots: int = 128, layers: int = 2) -> PagedLlama:
    """A seeded random two-layer Llama (GQA, 4 heads over 2 KV heads)."""
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = PagedLlama(config, num_token_slots=slots)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def extend(
    model: PagedLlama,
    table: torch.Tensor,
    row: int,
    tokens: list[int],
    prefix: int,
    tree: TreeMask | None = None,
    positions: list[int] | None = None,
) -> torch.Tensor:
    """Extend ``tokens`` at row positions ``prefix ..``; returns the logits ``[n, V]``."""
    n = len(tokens)
    pos = torch.arange(prefix, prefix + n) if positions is None else torch.tensor(positions)
    batch = AttentionBatch(
        input_ids=torch.tensor(tokens),
        positions=pos,
        out_cache_loc=table[row, prefix : prefix + n],
        req_pool_indices=torch.tensor([row]),
        req_to_token=table,
        prefix_lens=torch.tensor([prefix]),
        extend_lens=torch.tensor([n]),
    )
    if tree is not None:
        batch = TreeAttentionBatch(**attrs.asdict(batch, recurse=False), tree=tree)
    logits: torch.Tensor = model(batch).logits
    return logits


def shuffled_table(rows: int, width: int, slots: int, seed: int) -> torch.Tensor:
    """``[rows, width]`` slot table; row 0 is padding, the others use distinct shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.zeros(rows, width, dtype=torch.int64)
    perm = torch.randperm(slots - 1, generator=gen) + 1
    table[1:] = perm[: (rows - 1) * width].view(rows - 1, width)
    return table


# ------------------------------------------------------------------------ shape and capabilities


def test_tree_shape_counts_and_refusals() -> None:
    """Candidates k + (K-1)k², scratch 1 + (K-1)k; too many nodes or a 1-node tree are refused."""
    shape = TreeShape(num_steps=3, topk=2, num_draft_tokens=6)
    assert (shape.num_candidates, shape.scratch_width, shape.path_width) == (10, 5, 4)
    assert TreeShape(num_steps=3, topk=4, num_draft_tokens=37).num_candidates == 36
    with pytest.raises(InvalidConfig, match="exceeds the 10 candidates"):
        TreeShape(num_steps=3, topk=2, num_draft_tokens=12)
    with pytest.raises(InvalidConfig, match="num_draft_tokens >= 2"):
        TreeShape(num_steps=3, topk=2, num_draft_tokens=1)


def test_capabilities_chain_unchanged_tree_serves_the_controls() -> None:
    """topk 1 is the chain's capabilities; a tree declares topk, D, sampling and every
    per-request control but adaptive steps."""
    chain = tree_capabilities("eagle", num_steps=3, topk=1, num_draft_tokens=None)
    assert chain == tree_capabilities("eagle", num_steps=3, topk=1, num_draft_tokens=4)
    assert (chain.topk, chain.num_draft_tokens, chain.supports_sampling) == (1, 4, True)
    tree = tree_capabilities("eagle", num_steps=3, topk=2, num_draft_tokens=None)
    assert (tree.topk, tree.num_draft_tokens, tree.max_accept) == (2, 7, 4)
    assert tree.supports_sampling and tree.keeps_draft_kv
    assert (
        tree.supports_seeds
        and tree.supports_penalties
        and tree.supports_min_new_tokens
        and tree.supports_logprobs
        and tree.supports_per_request_speculation
    )
    assert not tree.supports_adaptive_steps
    with pytest.raises(InvalidConfig, match="verifies num_draft_tokens = 4, got 6"):
        tree_capabilities("eagle", num_steps=3, topk=1, num_draft_tokens=6)
    with pytest.raises(InvalidConfig, match="topk >= 1"):
        tree_capabilities("eagle", num_steps=3, topk=0, num_draft_tokens=None)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("steps", "topk", "nodes"), [(3, 2, 3), (3, 2, 6), (3, 4, 8), (4, 2, 12)])
def test_every_tree_write_fits_the_engine_window(
    page_size: int, steps: int, topk: int, nodes: int
) -> None:
    """Target [S, S+D), drafting [S, S+1+(K-1)k), draft-extend [S, S+K+1) all fit in L."""
    shape = TreeShape(num_steps=steps, topk=topk, num_draft_tokens=nodes)
    caps = tree_capabilities("eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    window = caps.spec_window(page_size)
    widest = max(nodes, shape.scratch_width, shape.path_width)
    assert widest <= window.alloc_len_per_decode
    # Under overlap S leads committed by one verify (<= max_accept), so S + L <= committed + R.
    assert caps.max_accept + widest <= window.reserve


# ------------------------------------------------------------------------------- tree structure


def test_from_parents_derives_depths_and_ancestors() -> None:
    """root ─ 1 ─ 3 ─ 4, root ─ 2: depths and the ancestor-or-self mask follow the parents."""
    tree = DraftTree.from_parents(torch.tensor([[9, 1, 2, 3, 4]]), torch.tensor([[0, 0, 0, 1, 3]]))
    assert tree.depths.tolist() == [[0, 1, 1, 2, 3]]
    assert tree.ancestors[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    with pytest.raises(InvalidConfig, match="parent must precede"):
        DraftTree.from_parents(torch.tensor([[9, 1, 2]]), torch.tensor([[0, 2, 0]]))


@pytest.mark.parametrize("width", [2, 5, 9, 33])
def test_ancestor_mask_of_random_trees_and_a_deep_chain(width: int) -> None:
    """The mask equals the ancestors found by walking up the parents, for any shape."""
    gen = torch.Generator().manual_seed(width)
    parents = torch.zeros(4, width, dtype=torch.int64)
    for node in range(1, width):
        parents[:3, node] = torch.randint(0, node, (3,), generator=gen)
        parents[3, node] = node - 1  # a chain: the deepest tree of this width
    tree = DraftTree.from_parents(torch.zeros_like(parents), parents)
    for b in range(4):
        for node in range(width):
            walk, up = {node}, node
            while up:
                up = int(parents[b, up])
                walk.add(up)
            assert set(torch.nonzero(tree.ancestors[b, node]).flatten().tolist()) == walk
            assert int(tree.depths[b, node]) == len(walk) - 1


def _select(
    tokens: list[int], scores: list[float], parents: list[int], ranks: list[int], nodes: int
) -> DraftTree:
    return select_tree(
        torch.tensor([7]),
        torch.tensor([tokens]),
        torch.tensor([scores]),
        torch.tensor([parents]),
        torch.tensor([ranks]),
        nodes,
    )


def test_select_keeps_the_best_by_cumulative_score_depth_major() -> None:
    """The D-1 best candidates, ordered by candidate index (depth-major), parents mapped."""
    #             level 1          level 2 (children of 0, then of 1)
    tokens = [10, 11, 20, 21, 22, 23]
    scores = [-0.1, -1.0, -0.3, -0.5, -1.2, -2.0]
    parents = [-1, -1, 0, 0, 1, 1]
    ranks = [0, 1, 0, 1, 0, 1]
    tree = _select(tokens, scores, parents, ranks, nodes=5)
    assert tree.tokens.tolist() == [[7, 10, 11, 20, 21]]
    assert tree.parents.tolist() == [[0, 0, 0, 1, 1]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2]]
    assert tree.ranks.tolist() == [[0, 0, 1, 0, 1]]
    torch.testing.assert_close(tree.scores, torch.tensor([[0.0, -0.1, -1.0, -0.3, -0.5]]))
    deep = _select(tokens, scores, parents, ranks, nodes=3)  # the two best: 10 and its child 20
    assert deep.tokens.tolist() == [[7, 10, 20]] and deep.depths.tolist() == [[0, 1, 2]]


def test_select_ties_keep_the_parent_and_a_lost_parent_falls_back_to_the_root() -> None:
    """A child as good as its parent comes after it; an orphan (non-finite scores) hangs at 0."""
    tie = _select([10, 11, 20], [-0.5, -0.9, -0.5], [-1, -1, 0], [0, 1, 0], nodes=3)
    assert tie.tokens.tolist() == [[7, 10, 20]] and tie.parents.tolist() == [[0, 0, 1]]
    orphan = _select([10, 11, 20], [-5.0, -0.1, -0.2], [-1, -1, 0], [0, 1, 0], nodes=3)
    assert orphan.tokens.tolist() == [[7, 11, 20]] and orphan.parents.tolist() == [[0, 0, 0]]


# ------------------------------------------------------------------------------ verification


def hand_tree() -> DraftTree:
    """root ─ A(10) ─ C(20);  root ─ B(11, rank 1) ─ E(30) ─ F(40)  (nodes 0..5)."""
    tokens = torch.tensor([[1, 10, 11, 20, 30, 40]]).repeat(5, 1)
    parents = torch.tensor([[0, 0, 0, 1, 2, 4]]).repeat(5, 1)
    ranks = torch.tensor([[0, 0, 1, 0, 0, 0]]).repeat(5, 1)
    return DraftTree.from_parents(tokens, parents, ranks=ranks)


def hand_logits(argmax_rows: list[list[int]]) -> torch.Tensor:
    """Logits ``[B, D, V]`` whose argmax at node n of row b is ``argmax_rows[b][n]``."""
    logits = torch.randn(
        len(argmax_rows), len(argmax_rows[0]), 128, generator=torch.Generator().manual_seed(0)
    )
    for b, row in enumerate(argmax_rows):
        for n, token in enumerate(row):
            logits[b, n, token] = 50.0
    return logits


def test_greedy_tree_verification_on_hand_built_logits() -> None:
    """The longest accepted root-to-leaf path wins; a match under a rejected parent does not."""
    verdict = verify_greedy_tree(
        hand_tree(),
        hand_logits(
            [
                # nodes: root   A   B   C   E   F
                [11, 20, 30, 5, 40, 50],  # B E F accepted (non-first branch); C under rejected A
                [10, 21, 30, 5, 40, 50],  # A accepted, C rejected
                [99, 20, 30, 5, 40, 50],  # nothing accepted
                [11, 20, 31, 5, 40, 50],  # B accepted, E rejected; C "matches" under rejected A
                [10, 20, 30, 6, 40, 50],  # A C accepted: the bonus is y at C
            ]
        ),
        path_width=4,
    )
    assert verdict.accept_lens.tolist() == [4, 2, 1, 2, 3]
    runs = [
        r[:a]
        for r, a in zip(verdict.run_tokens.tolist(), verdict.accept_lens.tolist(), strict=True)
    ]
    assert runs == [[11, 30, 40, 50], [10, 21], [99], [11, 31], [10, 20, 6]]
    assert verdict.bonus_tokens.tolist() == [50, 21, 99, 31, 6]
    paths = [
        p[:a] for p, a in zip(verdict.path.tolist(), verdict.accept_lens.tolist(), strict=True)
    ]
    assert paths == [[0, 2, 4, 5], [0, 1], [0], [0, 2], [0, 1, 3]]
    assert verdict.last_node.tolist() == [5, 1, 0, 2, 3]
    assert verdict.non_first_branch(hand_tree()).tolist() == [True, False, False, True, False]
    assert verdict.path_tokens(hand_tree())[0].tolist() == [1, 11, 30, 40]


def test_verification_refuses_misshapen_logits() -> None:
    """Logits that do not cover every node raise InvalidConfig."""
    with pytest.raises(InvalidConfig, match="do not fit 5 trees of 6"):
        verify_greedy_tree(hand_tree(), torch.zeros(5, 4, 128), path_width=4)


def first_rows(tree: DraftTree, rows: int) -> DraftTree:
    """The first ``rows`` rows of ``tree``."""
    return DraftTree.from_parents(tree.tokens[:rows], tree.parents[:rows])


def test_a_non_speculative_row_accepts_only_the_root_target() -> None:
    """``speculative`` False: no child is accepted, the run is the root's target alone."""
    targets = hand_logits([[11, 20, 30, 5, 40, 50]] * 2).argmax(-1)
    verdict = verify_tree_targets(
        first_rows(hand_tree(), 2), targets, 4, torch.tensor([True, False])
    )
    assert verdict.accept_lens.tolist() == [4, 1]
    assert verdict.run_tokens[1, 0].item() == 11 and verdict.path[1].tolist() == [0, 0, 0, 0]
    assert verdict.last_node.tolist() == [5, 0]


def test_seeded_rows_verify_against_the_draw_at_their_depth() -> None:
    """A seeded sampled row's target after node n is the inverse CDF at u(seed, S+depth+1)."""
    tree = hand_tree()
    logits = torch.randn(5, 6, VOCAB, generator=torch.Generator().manual_seed(3))
    sampling = SamplingInfo(
        temperatures=torch.full((5,), 0.8),
        top_ps=torch.ones(5),
        top_ks=torch.full((5,), VOCAB),
        seeds=torch.arange(5) + 7,
    )
    start = torch.tensor([3, 9, 4, 12, 0])
    verdict = verify_tree(tree, logits, 4, sampling, TokenSampler(0), start=start)
    positions = start[:, None] + 1 + tree.depths
    uniforms = seeded_uniforms(torch.arange(5) + 7, positions)
    draws = sample_with_uniforms(torch.softmax(logits / 0.8, -1), uniforms)
    want = verify_tree_targets(tree, draws, 4)
    assert torch.equal(verdict.run_tokens, want.run_tokens)
    assert torch.equal(verdict.accept_lens, want.accept_lens)
    with pytest.raises(InvalidConfig, match="needs the frontier"):
        verify_tree(tree, logits, 4, sampling, TokenSampler(0))


def test_node_counts_are_the_prefix_plus_the_nodes_path() -> None:
    """A chain-shaped tree gives `TokenCounts.chain`; a branchy one the counts of each path."""
    base = TokenCounts.from_history(
        torch.tensor([[2, 3, 3, 1, 0, 0]]), torch.tensor([3]), torch.tensor([2]), 12
    )
    chain = DraftTree.from_parents(torch.tensor([[1, 5, 6, 5]]), torch.tensor([[0, 0, 1, 2]]))
    got, want = tree_counts(base, chain), base.chain(torch.tensor([[5, 6, 5]]))
    for name in ("seen", "output", "num_outputs"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    tree = first_rows(hand_tree(), 1)  # root(1) ─ A(10) ─ C(20);  root ─ B(11) ─ E(30) ─ F(40)
    root_only = TokenCounts.from_history(tree.tokens[:, :1], torch.tensor([0]), None, 64)
    counts = tree_counts(root_only, tree)
    paths = {0: [1], 1: [1, 10], 2: [1, 11], 3: [1, 10, 20], 4: [1, 11, 30], 5: [1, 11, 30, 40]}
    for node, tokens in paths.items():
        assert counts.seen[0, node].nonzero().flatten().tolist() == tokens
        assert int(counts.num_outputs[0, node]) == len(tokens)


# --------------------------------------------------------------------------------- compaction


def test_compaction_moves_the_path_and_touches_nothing_else() -> None:
    """KV of node p_j moves from S + p_j to S + j for j < a; sources are read before writes."""
    config = ModelConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
    )
    cache = KvCache.allocate(config, num_token_slots=64)
    ids = torch.arange(64, dtype=torch.float32)[:, None, None].expand(64, 1, 2)
    for layer in range(2):
        cache.write(layer, torch.arange(64), ids + 100 * layer, -ids)
    table = shuffled_table(3, 16, 64, seed=1)
    start = torch.tensor([3, 5])
    verdict = TreeVerdict(
        run_tokens=torch.zeros(2, 4, dtype=torch.int64),
        accept_lens=torch.tensor([4, 1]),
        bonus_tokens=torch.zeros(2, dtype=torch.int64),
        path=torch.tensor([[0, 2, 4, 5], [0, 0, 0, 0]]),
        last_node=torch.tensor([5, 0]),
    )
    compact_kv(cache, torch.tensor([1, 2]), table, start, verdict)
    keys, values = cache.gather(1, table)
    expected = table.clone().float()  # slot ids of each position, after the move
    expected[1, 3:7] = table[1, torch.tensor([3, 5, 7, 8])].float()
    assert torch.equal(keys[..., 0, 0], expected + 100) and torch.equal(
        values[..., 0, 0], -expected
    )
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[table[1, 4:7]] = False
    assert torch.equal(cache.gather(0, torch.arange(64))[0][untouched, 0, 0], ids[untouched, 0, 0])


# ------------------------------------------------------------------------- tree attention


def test_a_chain_as_a_tree_mask_equals_the_causal_forward() -> None:
    """A lower-triangular tree mask from the prefix reproduces the causal logits."""
    model = tiny_model(0)
    table = shuffled_table(2, 24, 128, seed=2)
    extend(model, table, 1, [3, 4, 5, 6, 7], 0)
    causal = extend(model, table, 1, [8, 9, 10, 11], 5)
    tree = TreeMask(start=torch.tensor([5]), visible=torch.ones(4, 4, dtype=torch.bool).tril())
    torch.testing.assert_close(extend(model, table, 1, [8, 9, 10, 11], 5, tree), causal)


def test_tree_verify_equals_a_chain_forward_of_every_path() -> None:
    """Each node's logits and features equal a chain forward of its root-to-node path.

    Two rows with different prefixes and different trees in one batch: per-row masks, RoPE at
    S + depth, KV at S + node index.
    """
    model = tiny_model(1, slots=256)
    table = shuffled_table(5, 40, 256, seed=3)
    prompts = {1: [5, 6, 7, 8, 9, 10, 11], 2: [40, 41, 42]}
    for row, prompt in prompts.items():
        extend(model, table, row, prompt, 0)
    tree = DraftTree.from_parents(
        torch.tensor([[12, 3, 4, 5, 6, 7, 8], [43, 9, 8, 7, 6, 5, 4]]),
        torch.tensor([[0, 0, 0, 1, 1, 3, 2], [0, 0, 1, 2, 0, 3, 5]]),
    )
    start = torch.tensor([7, 3])
    out = model(tree_attention(torch.tensor([1, 2]), table, start, tree))
    logits, hidden = out.logits.view(2, 7, -1), out.hidden_states.view(2, 7, -1)
    for b, row in enumerate((1, 2)):
        for node in range(7):
            path = [int(m) for m in torch.nonzero(tree.ancestors[b, node]).flatten()]
            tokens = [int(tree.tokens[b, m]) for m in path]
            # a separate row with the same prompt runs the chain (rows 3 and 4)
            extend(model, table, row + 2, prompts[row], 0)
            chain = extend(model, table, row + 2, tokens, len(prompts[row]))
            torch.testing.assert_close(logits[b, node], chain[-1], atol=1e-5, rtol=1e-5)
            assert hidden[b, node].shape == (32,)


def test_a_tree_mask_past_the_rows_extent_is_refused() -> None:
    """Tree columns beyond prefix + extend, or a non-bool mask, raise InvalidConfig."""
    model = tiny_model(0)
    table = shuffled_table(2, 24, 128, seed=2)
    wide = TreeMask(start=torch.tensor([5]), visible=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(InvalidConfig, match="must lie inside"):
        extend(model, table, 1, [8, 9], 5, wide)
    with pytest.raises(InvalidConfig, match="must be \\[B\\] and bool"):
        extend(
            model, table, 1, [8, 9], 5, TreeMask(start=torch.tensor([5]), visible=torch.ones(2, 2))
        )


# ---------------------------------------------------------------------------------- drafting


@pytest.mark.parametrize(("steps", "topk", "nodes"), [(3, 2, 6), (3, 3, 9), (2, 4, 5)])
def test_grown_tree_nodes_are_the_drafters_top_k_of_their_paths(
    steps: int, topk: int, nodes: int
) -> None:
    """Every node is its parent path's rank-r token under the drafter, with the path's score.

    The drafter's per-level forwards use scratch KV positions and tree masks; this compares
    every node with a separate chain forward of its parent's path, and checks that drafting
    wrote KV only inside [S, S + 1 + (K-1)k).
    """
    shape = TreeShape(num_steps=steps, topk=topk, num_draft_tokens=nodes)
    model = tiny_model(2, slots=256, layers=1)
    table = shuffled_table(5, 40, 256, seed=4)
    prompts = {1: [5, 6, 7, 8, 9], 2: [30, 31, 32, 33, 34, 35, 36, 37]}
    for row, prompt in prompts.items():
        extend(model, table, row, prompt, 0)
    before = model.kv_cache.gather(0, torch.arange(256))[0].clone()
    start = torch.tensor([5, 8])

    def forward(attention: AttentionBatch, features: torch.Tensor | None) -> ModelOutput:
        out: ModelOutput = model(attention)
        return out

    tree = grow_tree(
        forward,
        torch.tensor([1, 2]),
        table,
        start,
        torch.tensor([17, 18]),
        None,
        shape,
    )
    changed = (model.kv_cache.gather(0, torch.arange(256))[0] != before).flatten(1).any(1)
    allowed = torch.zeros(256, dtype=torch.bool)
    for b, row in enumerate((1, 2)):
        allowed[table[row, int(start[b]) : int(start[b]) + shape.scratch_width]] = True
    assert not bool((changed & ~allowed).any())
    assert tree.tokens.shape == (2, nodes) and bool((tree.depths <= steps).all())
    for b, row in enumerate((1, 2)):
        for node in range(1, nodes):
            parent = int(tree.parents[b, node])
            path = [int(m) for m in torch.nonzero(tree.ancestors[b, parent]).flatten()]
            tokens = [int(tree.tokens[b, m]) for m in path]
            extend(model, table, row + 2, prompts[row], 0)
            logp = torch.log_softmax(extend(model, table, row + 2, tokens, int(start[b]))[-1], -1)
            rank = int(tree.ranks[b, node])
            assert int(logp.topk(topk).indices[rank]) == int(tree.tokens[b, node])
            expected = float(tree.scores[b, parent]) + float(logp[int(tree.tokens[b, node])])
            assert float(tree.scores[b, node]) == pytest.approx(expected, abs=1e-4)
