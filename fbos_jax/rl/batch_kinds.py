"""The batch kinds of the objective: the one table of what the rollout can build.

A term of the objective (``rl.terms.<name>``, :class:`fbos_jax.rl.config.Term`)
trains on one batch the rollout builds. Every fact about a kind lives in its
row of :data:`KINDS`, and the rest of the package reads it from there: the
rollout (its builder), the shape model (rows per prompt, prompt buckets and what
its prompts hold; the compiled plan's shapes come from it), the objectives (the
round-1 batch of ``policy/entropy_onpolicy``), the config's validation (which
need round 2) and the FAP budget check (which prompt template a builder renders).

With P prompts per step, n round-1 rollouts per prompt, m round-2 rollouts per
prompt and a appended EPA rows per prompt::

    epa  P * (n + a) rows  on q: round-1 rows + selected round-2 rows re-scored
                           on q (off-policy, f(u))       sampling.prompt_buckets
    ecc  P * m rows        round-2 rows on their FAPs    sampling.fap_prompt_buckets
    fcp  P * n rows        round-1 rows on <EF>c</EF>q, c their own feedback (MLE)
                                                         sampling.fap_prompt_buckets

This module imports only :mod:`fbos_jax.templates` (a leaf), so every module can read it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from fbos_jax import templates


@dataclasses.dataclass(frozen=True)
class BatchKind:
  """One kind of batch the rollout builds.

  name: the batch's (and its term's) name, ``rl.terms.<name>``.
  builder: the function of ``fbos_jax/rl/rollout.py`` that builds its rows,
    ``(ctx, examples, r1, r2) -> (RowSet, metrics)`` (:meth:`build`).
  per_prompt: rows per prompt at most, a function of the
    :class:`fbos_jax.rl.config.RolloutSpec`.
  sampling: the :class:`fbos_jax.rl.config.SamplingParts` field whose prompt
    buckets its prompts are padded to (``round1`` | ``round2``).
  prompt_field: the config field of those prompt buckets (named in errors).
  context: what its prompts hold, for the shape model's prompt lengths: ``q``
    (the problem), ``fap`` (q, a failed attempt and its feedback) or
    ``feedback`` (q under a feedback, <EF>c</EF>q).
  needs_round2: it trains on round-2 rows only (refused without ``rl.round2``).
  uses_round2: round 2's rows feed it (``rl.round2`` needs a term of such a kind).
  template: the prompt template (``fbos_jax.templates``' kinds) its builder
    renders itself, whose budget ``fbos_jax/rl/fap_budget.py`` checks; None: its
    prompts are q or round 2's.
  round1_onpolicy: its on-policy rows are exactly the round-1 rollouts on q
    (``policy/entropy_onpolicy``, :mod:`fbos_jax.rl.objectives`).
  loss: its term's loss in ``configs/base.py`` (a name of
    ``fbos_kernels.POLICY_LOSSES``).
  """
  name: str
  builder: str
  per_prompt: Callable
  sampling: str
  prompt_field: str
  context: str
  needs_round2: bool = False
  uses_round2: bool = False
  template: Optional[str] = None
  round1_onpolicy: bool = False
  loss: str = "policy_gradient"

  def rows_per_prompt(self, spec) -> int:
    """The most rows per prompt under ``spec`` (a RolloutSpec)."""
    return int(self.per_prompt(spec))

  def prompt_buckets(self, sampling_parts) -> tuple:
    """Its prompt buckets in ``sampling_parts`` (a SamplingParts)."""
    return tuple(getattr(sampling_parts, self.sampling).prompt_buckets)

  def build(self, ctx, examples, r1, r2):
    """Its rows of one step: ``(RowSet, metrics)`` (``fbos_jax/rl/rollout.py``)."""
    from fbos_jax.rl import rollout
    return getattr(rollout, self.builder)(ctx, examples, r1, r2)


EPA = BatchKind(
    "epa", "epa_rows", lambda spec: spec.group_size + spec.epa_extra, "round1",
    "sampling.prompt_buckets", "q", uses_round2=True, round1_onpolicy=True)
ECC = BatchKind(
    "ecc", "ecc_rows", lambda spec: spec.round2_size, "round2",
    "sampling.fap_prompt_buckets", "fap", needs_round2=True, uses_round2=True)
FCP = BatchKind(
    "fcp", "fcp_rows", lambda spec: spec.group_size, "round2",
    "sampling.fap_prompt_buckets", "feedback", template=templates.FCP_KIND, loss="mle")

KINDS: dict = {k.name: k for k in (EPA, ECC, FCP)}
NAMES: tuple = tuple(KINDS)  # the order terms are built and logged in


def kind(name: str) -> BatchKind:
  """The kind named ``name``; a ValueError names the kinds the rollout builds."""
  try:
    return KINDS[name]
  except KeyError:
    raise ValueError(f"unknown batch {name!r}; the rollout builds "
                     f"{' | '.join(NAMES)}") from None


def round1_batch() -> Optional[str]:
  """The name of the batch whose on-policy rows are the round-1 rollouts on q."""
  return next((k.name for k in KINDS.values() if k.round1_onpolicy), None)
