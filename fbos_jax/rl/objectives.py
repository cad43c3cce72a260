"""The loss as a tuple of named terms: L = sum_i w_i * (L_i + kl_beta * KL_i - c_H * H_i).

A term (:class:`fbos_jax.rl.config.Term`) names a batch the rollout built
(a kind of :mod:`fbos_jax.rl.batch_kinds`; SFT: ``demos``, ``corrections``), a token loss of
the kernels' registry (``fbos_kernels.get_policy_loss``: ``policy_gradient``,
``decoupled``, ``mle``, ...) and a weight. Each term keeps its own
(sum, denominator) pair: denominators depend only on the masks, so they are
computed once per (mini-)batch and every micro-batch adds ``sum / denominator``;
gradient accumulation is then exact (tunix-style), and the weights mean what
they say whatever the terms' token counts.

Terms train on different batches, so :func:`term_objective` differentiates one
term at a time at no extra cost: the update accumulates each term's gradient
on its own and sums them for the optimizer step (``grad_norm_<term>`` next to
``grad_norm``). Besides each term's entropy over all its rows, the metrics hold
``<term>_entropy_onpolicy`` over its on-policy rows only: for ``epa`` the
round-1 rollouts without the feedback-guided rows EPA appends
(:data:`ROUND1_BATCH`; logged as ``policy/entropy_onpolicy``).

A term's result is a small typed pytree (:class:`TermStats`); the update adds
its gradient norm and token count (:class:`TermMetrics`), and one rule,
:func:`log_metrics`, names them for the logs (``loss/<term>``,
``grad_norm/<term>``, ``policy/<term>_entropy``, ...).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

import fbos_kernels as K
from fbos_jax.model import qwen
from fbos_jax.rl import batch_kinds
from fbos_jax.rl.batch import PolicyBatch
from fbos_jax.rl.config import LossConfig, UpdateConfig

# the batch whose on-policy rows are the round-1 rollouts on q (EPA's)
ROUND1_BATCH = batch_kinds.round1_batch()


@flax.struct.dataclass
class TermStats:
  """One term's scalars on one micro-batch, each already divided by its
  whole-(mini-)batch denominator (so they add up over micro-batches): the
  policy loss (unweighted), entropy (all rows and on-policy rows), KL to the
  reference, and the clipped-token fraction."""
  loss: jax.Array
  entropy: jax.Array
  entropy_onpolicy: jax.Array
  kl: jax.Array
  clipfrac: jax.Array

  @classmethod
  def zeros(cls) -> "TermStats":
    return cls(*(jnp.zeros(()) for _ in range(5)))


@flax.struct.dataclass
class TermMetrics:
  """A term's metrics over an update: its :class:`TermStats`, the norm of its
  weighted gradient, and the tokens its loss was over."""
  stats: TermStats
  grad_norm: jax.Array
  tokens: jax.Array


@flax.struct.dataclass
class UpdateMetrics:
  """What the update returns besides the state: per-term metrics, the total
  loss and gradient norm, whether every optimizer step was finite (1/0), and
  the fraction of trained elements whose stored value an optimizer step changed
  (mean over the step's optimizer steps; near 0 when the params' dtype rounds the
  steps away)."""
  terms: dict  # {term.batch: TermMetrics}
  loss: jax.Array
  grad_norm: jax.Array
  finite: jax.Array
  param_change_frac: jax.Array


def log_metrics(m: UpdateMetrics, term_order: tuple) -> dict:
  """The one naming rule of the update's metrics in the logs: ``loss/<term>``,
  ``grad_norm/<term>``, ``policy/<term>_{entropy,entropy_onpolicy,kl,clipfrac,
  tokens}``, the totals ``policy/{loss,grad_norm,finite}`` and the first term's
  ``policy/{entropy,kl,clipfrac}`` (``policy/entropy_onpolicy``: EPA's round-1
  rows, :data:`ROUND1_BATCH`), and ``update/param_change_frac``."""
  m = jax.device_get(m)
  out = {"policy/loss": float(m.loss), "policy/grad_norm": float(m.grad_norm),
         "policy/finite": float(m.finite),
         "update/param_change_frac": float(m.param_change_frac)}
  for name, t in m.terms.items():
    out[f"loss/{name}"] = float(t.stats.loss)
    out[f"grad_norm/{name}"] = float(t.grad_norm)
    out[f"policy/{name}_tokens"] = float(t.tokens)
    for field in ("entropy", "entropy_onpolicy", "kl", "clipfrac"):
      out[f"policy/{name}_{field}"] = float(getattr(t.stats, field))
  if term_order:
    first = m.terms[term_order[0]].stats
    out.update({"policy/entropy": float(first.entropy), "policy/kl": float(first.kl),
                "policy/clipfrac": float(first.clipfrac)})
  if ROUND1_BATCH in m.terms:
    out["policy/entropy_onpolicy"] = float(m.terms[ROUND1_BATCH].stats.entropy_onpolicy)
  return out


def sequence_logprobs(params, cfg: qwen.ModelConfig, batch, *,
                      temperature: float = 1.0, time_chunk: int = 256,
                      vocab_chunk: int = 8192, compute_entropy: bool = True,
                      vocab_limit: int = 0):
  """Teacher-forced log-probs of the response tokens of a :class:`PolicyBatch`
  (or of every position of a :class:`~fbos_jax.rl.batch.PackedBatch`).

  Returns (logp [N, R], entropy [N, R]) ([N, L] packed) of the temperature-scaled
  policy over the ids below ``vocab_limit`` (0: all; the sampler's
  ``vocab_limit``, so the log-probs are of the distribution it drew from),
  computed from hidden states without materialising [N, R, V] logits.
  """
  hidden, _ = qwen.forward(params, cfg=cfg, **batch.forward_args())
  h, targets = batch.scored(hidden)
  return K.token_logprobs_and_entropy(
      h, qwen.unembed_matrix(params, cfg).astype(cfg.dtype), targets,
      temperature=temperature, time_chunk=min(time_chunk, h.shape[1]), vocab_chunk=vocab_chunk,
      compute_entropy=compute_entropy, vocab_limit=vocab_limit)


def _onpolicy_mask(batch):
  """The loss mask of the tokens that are not off-policy (flags per row [N] or
  per token [N, L], a packed batch's)."""
  off = batch.is_offpolicy
  off = off if off.ndim == batch.loss_mask.ndim else off[:, None]
  return batch.loss_mask * (~off).astype(batch.loss_mask.dtype)


def _aggregate(x, mask, batch, lc: LossConfig, mode: str):
  """``fbos_kernels.aggregate`` of one of ``batch``'s masks: the seq-* modes per
  sequence (a packed batch's ``seq_weight``), seq-mean-token-sum-norm's constant
  ``rl``'s norm_len or the response length."""
  return K.aggregate(x, mask, mode, norm_len=lc.norm_len or batch.response_len,
                     seq_weight=batch.seq_weight)


def denominators(batch, lc: LossConfig):
  """(loss denominator, token count, on-policy token count) of a whole
  (mini-)batch: parameter-free."""
  mask = batch.loss_mask
  ones = jnp.ones_like(mask)
  _, d = _aggregate(ones, mask, batch, lc, lc.loss_agg)
  _, d_tok = K.aggregate(ones, mask, "token-mean")
  _, d_on = K.aggregate(ones, _onpolicy_mask(batch), "token-mean")
  return d, d_tok, d_on


def _hparams(lc: LossConfig) -> dict:
  return dict(eps_low=lc.eps_low, eps_high=lc.eps_high, dual_clip=lc.dual_clip or None,
              lam=lc.offpolicy_lambda, denominator=lc.offpolicy_ratio_denominator,
              behav_weight_cap=lc.behav_weight_cap)


def term_sums(params, cfg: qwen.ModelConfig, batch, loss: str, lc: LossConfig,
              ref_params=None, prox_logp=None) -> dict:
  """Sums (to be divided by the denominators) of one term on one micro-batch
  (a :class:`PolicyBatch` or a packed one): loss, entropy (all rows, and
  on-policy rows only), KL to the reference, clipped-token fraction. Scalars."""
  mask = batch.loss_mask
  logp, ent = sequence_logprobs(params, cfg, batch, temperature=lc.temperature,
                                time_chunk=lc.time_chunk, vocab_chunk=lc.vocab_chunk,
                                vocab_limit=lc.vocab_limit)
  loss_t, clipped = K.get_policy_loss(loss)(
      logp, old_logp=batch.old_logp, adv=batch.advantages, is_offpolicy=batch.is_offpolicy,
      prox_logp=prox_logp, mask=mask, **_hparams(lc))
  s_loss, _ = _aggregate(loss_t, mask, batch, lc, lc.loss_agg)
  s_ent, _ = K.aggregate(ent, mask, "token-mean")
  s_ent_on, _ = K.aggregate(ent, _onpolicy_mask(batch), "token-mean")
  s_clip, _ = K.aggregate(clipped.astype(jnp.float32), mask, "token-mean")
  s_kl = jnp.zeros(())
  if ref_params is not None and lc.kl_beta > 0:
    ref_logp, _ = sequence_logprobs(ref_params, cfg, batch, temperature=lc.temperature,
                                    compute_entropy=False, vocab_limit=lc.vocab_limit)
    kl = K.kl_penalty(logp, jax.lax.stop_gradient(ref_logp), kind=lc.kl_kind, mask=mask)
    s_kl, _ = K.aggregate(kl, mask, "token-mean")
  return dict(loss=s_loss, entropy=s_ent, entropy_onpolicy=s_ent_on, kl=s_kl, clipfrac=s_clip)


def term_weights(ucfg: UpdateConfig, step) -> jax.Array:
  """[num_terms] weights at loop step ``step`` (traced): the configured weights
  (``joint``), or only term ``step % num_terms`` on (``alternate``, the terms
  take turns: EPA on even steps, ECC on odd)."""
  w = jnp.asarray([t.weight for t in ucfg.terms], jnp.float32)
  if ucfg.schedule == "alternate" and len(ucfg.terms) > 1:
    on = jnp.arange(len(ucfg.terms)) == (step % len(ucfg.terms))
    w = jnp.where(on, w, 0.0)
  return w


def term_objective(params, cfg: qwen.ModelConfig, batch, term, lc: LossConfig,
                   weight, denom: tuple, ref_params=None, prox_logp=None):
  """One term's weighted loss on one micro-batch, its sums over the whole-(mini-)batch
  denominators ``denom`` (:func:`denominators`):
  ``weight * (L / D + kl_beta * KL - c_H * H)``. Returns (loss, :class:`TermStats`)."""
  s = term_sums(params, cfg, batch, term.loss, lc, ref_params, prox_logp)
  d, d_tok, d_on = denom
  stats = TermStats(loss=K.safe_divide(s["loss"], d), entropy=K.safe_divide(s["entropy"], d_tok),
                    entropy_onpolicy=K.safe_divide(s["entropy_onpolicy"], d_on),
                    kl=K.safe_divide(s["kl"], d_tok),
                    clipfrac=K.safe_divide(s["clipfrac"], d_tok))
  loss = weight * (stats.loss + lc.kl_beta * stats.kl - lc.entropy_coef * stats.entropy)
  return loss, stats
