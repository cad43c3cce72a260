"""The one jitted update step: EPA + ECC (and every relative) in one function.

``update_step(state, epa, ecc, weights, ref_params) -> (state, metrics)``

* ``epa``: the :class:`PolicyBatch` on the original prompts q (round-1 rollouts
  with PPO clip, plus feedback-guided rollouts flagged ``is_offpolicy`` with the
  reshaped ratio f(u)=u/(u+λ)). GRPO/GFPO/Dr.GRPO use only this batch.
* ``ecc``: the :class:`PolicyBatch` on the feedback-augmented prompts (FAPs),
  on-policy PPO clip: it teaches the policy to use feedback.
* ``weights``: ``[w_epa, w_ecc]`` as a traced array, so
  ``objective_schedule='alternate'`` switches terms without recompiling.

Each term keeps its own token denominator, so ``L = w_epa·L_EPA + w_ecc·L_ECC``
means what it says. Denominators depend only on the masks, so they are computed
once over the whole batch and every micro-batch contributes ``sum / denom``:
gradient accumulation is exact (tunix-style (sum, denom) carrying).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

import fbos_kernels as K
from fbos_jax.model import qwen
from fbos_jax.rl.batch import PolicyBatch


class TrainState(NamedTuple):
  """Everything that changes during training (all pytrees; checkpointed as one)."""
  step: jax.Array  # [] int32: optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # PRNG key data [2] uint32 (raw, so orbax can save it)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The static knobs of the loss (hashable: part of the compiled program)."""
  objective: str = "policy_gradient"  # policy_gradient | mle (SFT, FCP)
  loss_agg: str = "token-mean"
  norm_len: int = 0  # for seq-mean-token-sum-norm; 0 = response bucket length
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float = 0.0
  offpolicy_lambda: float = 0.1
  offpolicy_ratio_denominator: str = "one"
  decoupled: bool = False
  behav_weight_cap: float = 5.0
  kl_beta: float = 0.0
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  temperature: float = 1.0
  micro_batches: int = 1
  time_chunk: int = 256
  vocab_chunk: int = 8192

  @classmethod
  def from_config(cls, config) -> "LossConfig":
    rl = config.rl
    return cls(
        objective="mle" if rl.objective == "fcp" else "policy_gradient",
        loss_agg=rl.loss_agg, eps_low=rl.eps_low, eps_high=rl.eps_high,
        dual_clip=float(rl.dual_clip), offpolicy_lambda=rl.offpolicy_lambda,
        offpolicy_ratio_denominator=rl.offpolicy_ratio_denominator,
        decoupled=bool(rl.decoupled), behav_weight_cap=rl.behav_weight_cap,
        kl_beta=rl.kl_beta, kl_kind=rl.kl_kind, entropy_coef=rl.entropy_coef,
        temperature=float(config.sampling.temperature) or 1.0,
        micro_batches=rl.micro_batches)


def sequence_logprobs(params, cfg: qwen.ModelConfig, batch: PolicyBatch, *,
                      temperature: float = 1.0, time_chunk: int = 256,
                      vocab_chunk: int = 8192, compute_entropy: bool = True):
  """Teacher-forced log-probs of the response tokens.

  Returns (logp [N, R], entropy [N, R]) of the temperature-scaled policy,
  computed from hidden states without materialising [N, R, V] logits.
  """
  hidden, _ = qwen.forward(params, batch.tokens, batch.attn_mask, cfg)
  p, r = batch.prompt_len, batch.response_len
  h = hidden[:, p - 1:p - 1 + r]
  targets = batch.tokens[:, p:p + r]
  return K.token_logprobs_and_entropy(
      h, qwen.unembed_matrix(params, cfg).astype(cfg.dtype), targets,
      temperature=temperature, time_chunk=min(time_chunk, r), vocab_chunk=vocab_chunk,
      compute_entropy=compute_entropy)


def _denoms(batch: PolicyBatch, lc: LossConfig):
  """Parameter-independent denominators of the whole batch (exact accumulation)."""
  mask = batch.loss_mask
  ones = jnp.ones_like(mask)
  _, d = K.aggregate(ones, mask, lc.loss_agg, norm_len=lc.norm_len or mask.shape[1])
  _, d_tok = K.aggregate(ones, mask, "token-mean")
  return d, d_tok


def _term_sums(params, cfg, batch: PolicyBatch, lc: LossConfig, ref_params, prox_logp):
  """Loss sums of one (micro-)batch: dict of scalars (to be divided by denoms)."""
  mask = batch.loss_mask
  logp, ent = sequence_logprobs(params, cfg, batch, temperature=lc.temperature,
                                time_chunk=lc.time_chunk, vocab_chunk=lc.vocab_chunk)
  adv = batch.advantages
  norm_len = lc.norm_len or mask.shape[1]
  if lc.objective == "mle":
    loss_t = -logp
    clipped = jnp.zeros_like(mask, bool)
  elif lc.decoupled:
    on_loss, clipped = K.decoupled_ppo_loss(
        logp, prox_logp, batch.old_logp, adv, eps_low=lc.eps_low, eps_high=lc.eps_high,
        behav_weight_cap=lc.behav_weight_cap)
    off_loss = K.offpolicy_loss(logp, adv, lam=lc.offpolicy_lambda,
                                behaviour_logp=batch.old_logp,
                                denominator=lc.offpolicy_ratio_denominator)
    loss_t = jnp.where(batch.is_offpolicy[:, None], off_loss, on_loss)
    clipped = clipped & ~batch.is_offpolicy[:, None]
  else:
    loss_t, clipped = K.policy_loss(
        logp, batch.old_logp, adv, batch.is_offpolicy, eps_low=lc.eps_low,
        eps_high=lc.eps_high, dual_clip=lc.dual_clip or None, lam=lc.offpolicy_lambda,
        denominator=lc.offpolicy_ratio_denominator)
  s_loss, _ = K.aggregate(loss_t, mask, lc.loss_agg, norm_len=norm_len)
  s_ent, _ = K.aggregate(ent, mask, "token-mean")
  s_clip, _ = K.aggregate(clipped.astype(jnp.float32), mask, "token-mean")
  s_kl = jnp.zeros(())
  if ref_params is not None and lc.kl_beta > 0:
    ref_logp, _ = sequence_logprobs(ref_params, cfg, batch, temperature=lc.temperature,
                                    compute_entropy=False)
    kl = K.kl_penalty(logp, jax.lax.stop_gradient(ref_logp), kind=lc.kl_kind)
    s_kl, _ = K.aggregate(kl, mask, "token-mean")
  return dict(loss=s_loss, entropy=s_ent, clipfrac=s_clip, kl=s_kl)


def combined_loss(params, cfg, epa: PolicyBatch, ecc: PolicyBatch, weights, lc: LossConfig,
                  denoms, ref_params=None, prox=(None, None)):
  """L = Σ_term w·(pg + β·KL − c_H·H) for one micro-batch, each term normalised by
  its whole-batch denominator. Returns (loss, per-term metric sums)."""
  total = jnp.zeros(())
  metrics = {}
  for name, batch, w, (d, d_tok), prox_logp in (
      ("epa", epa, weights[0], denoms[0], prox[0]),
      ("ecc", ecc, weights[1], denoms[1], prox[1])):
    s = _term_sums(params, cfg, batch, lc, ref_params, prox_logp)
    pg = K.safe_divide(s["loss"], d)
    ent = K.safe_divide(s["entropy"], d_tok)
    kl = K.safe_divide(s["kl"], d_tok)
    total = total + w * (pg + lc.kl_beta * kl - lc.entropy_coef * ent)
    metrics[f"{name}_loss"] = pg
    metrics[f"{name}_entropy"] = ent
    metrics[f"{name}_kl"] = kl
    metrics[f"{name}_clipfrac"] = K.safe_divide(s["clipfrac"], d_tok)
  return total, metrics


def _micro(tree, m: int, i):
  return jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:])[i], tree)


def make_update_step(model_cfg: qwen.ModelConfig, optimizer: optax.GradientTransformation,
                     lc: LossConfig, *, skip_nonfinite: bool = True):
  """Build the pure update function (jit it with shardings in the trainer).

  update_step(state, epa, ecc, weights [2], ref_params, prox_epa, prox_ecc)
    -> (new_state, metrics)

  prox_* are π_prox log-probs [N, R] for the decoupled objective (else None).
  Gradients are accumulated over ``lc.micro_batches`` with lax.scan; the loss of
  the full batch equals the sum over micro-batches exactly.
  """
  m = lc.micro_batches

  def update_step(state: TrainState, epa: PolicyBatch, ecc: PolicyBatch, weights,
                  ref_params=None, prox_epa=None, prox_ecc=None):
    denoms = (_denoms(epa, lc), _denoms(ecc, lc))
    grad_fn = jax.value_and_grad(combined_loss, has_aux=True)

    def micro_step(carry, i):
      g_acc, l_acc, m_acc = carry
      mb_epa, mb_ecc = _micro(epa, m, i), _micro(ecc, m, i)
      prox = (None if prox_epa is None else _micro(prox_epa, m, i),
              None if prox_ecc is None else _micro(prox_ecc, m, i))
      (loss, met), g = grad_fn(state.params, model_cfg, mb_epa, mb_ecc, weights, lc, denoms,
                               ref_params, prox)
      g_acc = jax.tree.map(jnp.add, g_acc, g)
      m_acc = jax.tree.map(jnp.add, m_acc, met)
      return (g_acc, l_acc + loss, m_acc), None

    zeros_g = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    zero_m = {f"{t}_{k}": jnp.zeros(()) for t in ("epa", "ecc")
              for k in ("loss", "entropy", "kl", "clipfrac")}
    (grads, loss, met), _ = jax.lax.scan(micro_step, (zeros_g, jnp.zeros(()), zero_m),
                                         jnp.arange(m))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    if skip_nonfinite:
      keep_old = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
      new_params = keep_old(new_params, state.params)
      new_opt = keep_old(new_opt, state.opt_state)
    new_state = TrainState(step=state.step + jnp.where(finite, 1, 0).astype(state.step.dtype),
                           params=new_params, opt_state=new_opt, rng=state.rng)
    metrics = dict(met, loss=loss, grad_norm=grad_norm, finite=finite.astype(jnp.float32),
                   epa_tokens=denoms[0][1], ecc_tokens=denoms[1][1])
    return new_state, metrics

  return update_step


def make_logprob_fn(model_cfg: qwen.ModelConfig, lc: LossConfig):
  """(params, batch) -> logp [N, R]: π_prox for the decoupled objective, or π_ref."""

  def fn(params, batch: PolicyBatch):
    logp, _ = sequence_logprobs(params, model_cfg, batch, temperature=lc.temperature,
                                time_chunk=lc.time_chunk, vocab_chunk=lc.vocab_chunk,
                                compute_entropy=False)
    return logp

  return fn


def init_opt_state(optimizer, params, optim_cfg):
  """Optimizer state in ``optim.opt_state_dtype`` (float32 by default) even when
  the params are bf16: both Adam moments are kept in that dtype."""
  dt = jnp.dtype(optim_cfg.get("opt_state_dtype", "float32"))
  return optimizer.init(jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating)
                                     else p, params))


def make_optimizer(optim_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW with warmup + constant/cosine schedule and global-norm clipping."""
  warm = max(int(optim_cfg.warmup_steps), 0)
  lr = float(optim_cfg.learning_rate)
  if optim_cfg.schedule == "cosine":
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warm, 1), max(total_steps, warm + 1),
                                               end_value=lr * 0.1)
  elif optim_cfg.schedule == "constant":
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, max(warm, 1)), optax.constant_schedule(lr)], [warm]
    ) if warm else optax.constant_schedule(lr)
  else:
    raise ValueError(f"optim.schedule={optim_cfg.schedule!r}; expected 'constant' or 'cosine'.")
  mu_dtype = jnp.dtype(optim_cfg.get("opt_state_dtype", "float32"))
  chain = []
  if optim_cfg.grad_clip and optim_cfg.grad_clip > 0:
    chain.append(optax.clip_by_global_norm(float(optim_cfg.grad_clip)))
  chain.append(optax.adamw(sched, b1=optim_cfg.b1, b2=optim_cfg.b2,
                           weight_decay=optim_cfg.weight_decay, mu_dtype=mu_dtype))
  return optax.chain(*chain)
