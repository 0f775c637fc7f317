"""Chain verification: which drafted tokens the target accepts, and the run a round emits.

The verify forward scores the chain ``[x0, d1, ..., dK]`` at positions ``S .. S+K``; row ``j`` of
its logits is the target's distribution of the token at ``S + j + 1``. Greedy verification
(lossless: the emitted tokens are exactly the target's own greedy tokens)::

    y_j = argmax logits[j]                       j = 0 .. K
    m   = largest m with d_i == y_(i-1) for all i <= m
    run = y_0 .. y_m      accept_len a = m + 1   (1 <= a <= D = K + 1)
    bonus = y_m           the root of the next round, at position S + a

Sampled verification (Leviathan et al. / Chen et al. speculative sampling) of a chain drafted
from ``q_i`` (the drafter's filtered distribution at step ``i``; one-hot for a deterministic
drafter), against ``p_j`` (the target's filtered distribution of row ``j``)::

    accept d_i with probability min(1, p_(i-1)(d_i) / q_i(d_i))      i = 1 .. K, in order
    m     = number of drafts accepted before the first rejection
    y_m   ~ normalize(max(0, p_m - q_(m+1)))    after a rejection (m < K)
    y_m   ~ p_K                                 when all K were accepted (the bonus)
    run   = d_1 .. d_m, y_m   accept_len a = m + 1   bonus = y_m

Invariant: greedy, the run is a prefix of the target's greedy continuation; sampled, each
emitted token is distributed exactly as the target's filtered distribution given the tokens
before it. Either way the tokens are correct whatever the drafter proposed; only the
acceptance length depends on draft quality.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from specstate.core.errors import InvalidConfig
from specstate.reference.workers.sampler import TokenChoice, TokenSampler

__all__ = [
    "ChainVerdict",
    "DraftChain",
    "truncate_to_budgets",
    "verify_chain_targets",
    "verify_greedy_chain",
    "verify_sampled_chain",
]


@attrs.frozen(kw_only=True)
class DraftChain:
    """What a drafter proposed for one round.

    Attributes:
        tokens: ``[B, K]`` int64 drafts ``d1..dK``.
        probs: ``[B, K, V]`` the filtered distribution each draft was drawn from; None when
            the batch is all greedy or the drafter is deterministic (then ``q`` is one-hot).
        confidences: ``[B, K]`` float, the drafter's predicted probability that each draft is
            accepted given the ones before it were (a confidence head; reported as the
            result's ``draft_confidences``), or None.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None

    @classmethod
    def from_steps(cls, steps: list[TokenChoice]) -> DraftChain:
        """The chain of ``K >= 1`` one-token draft steps, in order."""
        tokens = torch.stack([step.tokens for step in steps], dim=1)
        step_probs = [step.probs for step in steps]
        known = [p for p in step_probs if p is not None]
        if len(known) != len(step_probs):
            return cls(tokens=tokens)
        return cls(tokens=tokens, probs=torch.stack(known, dim=1))


@attrs.frozen(kw_only=True)
class ChainVerdict:
    """The outcome of verifying one chain per row.

    Attributes:
        run_tokens: ``[B, D]`` int64; row ``b``'s emitted run is ``run_tokens[b, :accept_lens[b]]``
            (entries past the run are never emitted: the target's greedy tokens after a
            rejection, or 0 for a sampled row).
        accept_lens: ``[B]`` int64, bonus included, in ``[1, D]``.
        bonus_tokens: ``[B]`` int64, the last token of each run.
    """

    run_tokens: torch.Tensor
    accept_lens: torch.Tensor
    bonus_tokens: torch.Tensor

    @property
    def last_accepted(self) -> torch.Tensor:
        """``[B]`` index ``m = accept_len - 1`` of the last accepted chain position."""
        return self.accept_lens - 1


def _check_chain(drafts: torch.Tensor, scores: torch.Tensor, name: str) -> None:
    num_rows, num_steps = drafts.shape
    if scores.ndim != 3 or tuple(scores.shape[:2]) != (num_rows, num_steps + 1):
        raise InvalidConfig(
            f"verify {name} {tuple(scores.shape)} do not fit {num_rows} chains of"
            f" {num_steps} drafts"
        )


def verify_greedy_chain(
    drafts: torch.Tensor, logits: torch.Tensor, speculative: torch.Tensor | None = None
) -> ChainVerdict:
    """Greedy verification of ``drafts`` ``[B, K]`` against verify ``logits`` ``[B, K+1, V]``.

    ``speculative`` (``[B]`` bool, None: all): a False row accepts no draft (run = ``y_0``).

    Raises:
        InvalidConfig: the shapes disagree.
    """
    _check_chain(drafts, logits, "logits")
    return verify_chain_targets(drafts, logits.argmax(-1), speculative)


def verify_chain_targets(
    drafts: torch.Tensor,
    targets: torch.Tensor,
    speculative: torch.Tensor | None = None,
    budgets: torch.Tensor | None = None,
) -> ChainVerdict:
    """Verification against the target's own token ``targets[:, j]`` at every chain position.

    The target's token at a position is fixed before the drafts are compared (the argmax, or a
    seeded row's draw ``F_p^-1(u)``, which depends only on the seed, the position and ``p``):
    drafts are accepted while they equal it, and the run is ``targets[:, :a]``. A row with
    ``speculative`` False accepts exactly one token; a row with a verify budget ``b``
    (``budgets``) compares only its first ``b`` drafts, so its run is at most ``b + 1``.
    """
    num_steps = drafts.shape[1]
    matched = (drafts == targets[:, :num_steps]).long()
    if speculative is not None:
        matched = matched * speculative.to(matched.device)[:, None].long()
    if budgets is not None:
        steps = torch.arange(num_steps, device=matched.device)
        matched = matched * (steps[None, :] < budgets.to(matched.device)[:, None]).long()
    accept_lens = matched.cumprod(1).sum(1) + 1  # the first mismatch ends the run
    bonus = targets.gather(1, (accept_lens - 1)[:, None]).squeeze(1)
    return ChainVerdict(run_tokens=targets, accept_lens=accept_lens, bonus_tokens=bonus)


def truncate_to_budgets(
    verdict: ChainVerdict,
    target_probs: torch.Tensor,
    budgets: torch.Tensor,
    sampler: TokenSampler,
) -> ChainVerdict:
    """A speculatively sampled verdict cut to each row's verify budget ``b``.

    A row whose first ``b`` drafts were all accepted (its run reached position ``b``) would, in
    a chain of ``b`` drafts, take its token at ``b`` from ``p_b`` itself (the bonus), not from
    the residual of the draft beyond its budget: that token is drawn afresh here, and the run
    ends there. A row rejected earlier is unchanged. With ``b = 0`` this is the plain draw from
    ``p_0`` of a row that does not speculate. No host read.
    """
    num_rows = budgets.shape[0]
    device = target_probs.device
    b = budgets.to(device).long()
    over = verdict.accept_lens.to(device) > b  # drafts 0 .. b-1 accepted
    fresh = sampler.sample(target_probs[torch.arange(num_rows, device=device), b])
    positions = torch.arange(verdict.run_tokens.shape[1], device=device)[None, :]
    at_budget = over[:, None] & (positions == b[:, None])
    return ChainVerdict(
        run_tokens=torch.where(at_budget, fresh[:, None], verdict.run_tokens),
        accept_lens=torch.where(over, b + 1, verdict.accept_lens),
        bonus_tokens=torch.where(over, fresh, verdict.bonus_tokens),
    )


def _replacement_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, num_accepted: torch.Tensor
) -> torch.Tensor:
    """``[B, V]`` normalize(max(0, p_m - q_(m+1))) per row; ``p_K`` itself when all accepted."""
    num_rows, _, vocab = target_probs.shape
    rows = torch.arange(num_rows, device=target_probs.device)
    no_draft = draft_probs.new_zeros(num_rows, 1, vocab)  # past d_K the residual is p_K itself
    p_last = target_probs[rows, num_accepted]
    residual = (p_last - torch.cat([draft_probs, no_draft], 1)[rows, num_accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # NOTE: an all-zero residual means p == q at m, where a rejection has probability 0; only
    # rounding gets here, and p itself is then the right distribution.
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_last)


def verify_sampled_chain(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    sampler: TokenSampler,
) -> ChainVerdict:
    """Speculative sampling of every row (see the module docstring).

    Args:
        drafts: ``[B, K]`` drafted tokens.
        draft_probs: ``[B, K, V]`` the distribution each draft was drawn from; None for a
            deterministic drafter (``q_i`` = one-hot of ``d_i``).
        target_probs: ``[B, K+1, V]`` the target's filtered distributions of the chain.
        sampler: draws ``B * K`` uniforms, then one token per row.

    Raises:
        InvalidConfig: the shapes disagree.
    """
    _check_chain(drafts, target_probs, "probabilities")
    num_rows, num_steps = drafts.shape
    vocab = target_probs.shape[2]
    if draft_probs is None:
        draft_probs = F.one_hot(drafts, vocab).to(target_probs.dtype)
    if tuple(draft_probs.shape) != (num_rows, num_steps, vocab):
        raise InvalidConfig(
            f"draft probabilities {tuple(draft_probs.shape)} must be [{num_rows}, {num_steps}, "
            f"{vocab}]"
        )
    index = drafts[:, :, None]
    p_draft = target_probs[:, :num_steps].gather(2, index).squeeze(2)
    q_draft = draft_probs.gather(2, index).squeeze(2)
    uniforms = sampler.uniform((num_rows, num_steps), target_probs.device)
    # u < p/q without a division: q(d) > 0 for a drawn d, and p(d) == 0 always rejects.
    accepted = (uniforms * q_draft < p_draft).long()
    num_accepted = accepted.cumprod(1).sum(1)  # m: the first rejection ends the run
    bonus = sampler.sample(_replacement_probs(target_probs, draft_probs, num_accepted))
    steps = torch.arange(num_steps + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_zeros(num_rows, 1)], 1)
    run = torch.where(steps < num_accepted[:, None], padded, 0)
    run = run.scatter(1, num_accepted[:, None], bonus[:, None])
    return ChainVerdict(run_tokens=run, accept_lens=num_accepted + 1, bonus_tokens=bonus)
