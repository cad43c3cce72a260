"""Per-token policy losses, KL estimators and entropy (ALGORITHMS.md sections 2, 3, 8).

Every loss returns an *unreduced* ``[B, T]`` array; mask and aggregate it with
:func:`fbos_kernels.aggregate`. Advantages may be per-sample ``[B]`` (broadcast
to every token, ALGORITHMS.md section 1) or per-token ``[B, T]``.

Conventions:

* **log-ratio clamp**: every importance ratio is ``exp(clip(logp_a - logp_b,
  -20, 20))`` (verl). Outside the clamp the ratio, and hence its gradient, is
  constant: such tokens contribute no gradient through the ratio.
* **clipped flag**: ``True`` where a clip branch is active, i.e. where the
  ratio gets no gradient because of PPO clipping or the dual clip.
* Computations are in >= float32 regardless of the input dtype.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp

from ._util import as_bool_mask, float_dtype

__all__ = [
    "LOG_RATIO_CLAMP",
    "ppo_clip_loss",
    "offpolicy_loss",
    "reshaped_ratio",
    "policy_loss",
    "decoupled_ppo_loss",
    "kl_penalty",
    "entropy_from_logits",
    "POLICY_LOSSES",
    "get_policy_loss",
]

LOG_RATIO_CLAMP = 20.0


def _f32(x):
    x = jnp.asarray(x)
    return x.astype(float_dtype(x))


def _bcast_adv(adv, like):
    adv = _f32(adv)
    if adv.ndim == like.ndim - 1:
        adv = adv[..., None]
    return adv


def _clamped_ratio(logp, logp_ref):
    return jnp.exp(jnp.clip(logp - logp_ref, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clip_objective(ratio, adv, eps_low, eps_high, dual_clip):
    """max(-A r, -A clip(r)) [+ dual clip]; returns (loss, clipped)."""
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(l1, l2)
    clipped = l2 > l1
    if dual_clip is not None:
        l3 = -adv * dual_clip
        dual = (adv < 0) & (l3 < loss)
        loss = jnp.where(dual, l3, loss)
        clipped = clipped | dual
    return loss, clipped


def ppo_clip_loss(logp, old_logp, adv, *, eps_low: float = 0.2, eps_high: float = 0.28,
                  dual_clip: Optional[float] = None):
    """PPO clipped surrogate with asymmetric eps (clip-higher) and optional dual clip.

    ``rho = exp(clip(logp - old_logp, -20, 20))``,
    ``l = max(-A rho, -A clip(rho, 1-eps_low, 1+eps_high))``; with ``dual_clip=c``
    (c > 1, typically 3) and only where ``A < 0``: ``l = min(l, -A c)``.

    Args:
      logp: ``[B, T]`` current-policy token log-probs (differentiated).
      old_logp: ``[B, T]`` sampling-policy log-probs (treated as data).
      adv: ``[B]`` or ``[B, T]`` advantages.
      eps_low, eps_high: clip range ``[1-eps_low, 1+eps_high]``.
      dual_clip: None (off) or c.

    Returns:
      ``(loss [B, T] float32, clipped [B, T] bool)``.
    """
    logp = _f32(logp)
    ratio = _clamped_ratio(logp, jax.lax.stop_gradient(_f32(old_logp)))
    return _clip_objective(ratio, _bcast_adv(adv, logp), eps_low, eps_high, dual_clip)


def reshaped_ratio(log_u, lam: float = 0.1):
    """``f(u) = u / (u + lam)`` evaluated stably from ``log u`` (= sigmoid(log u - log lam)).

    ``d f / d log u = lam u / (u + lam)^2 = f (1 - f)``.
    """
    return jax.nn.sigmoid(log_u - jnp.log(jnp.asarray(lam, log_u.dtype)))


def offpolicy_loss(logp, adv, *, lam: float = 0.1, behaviour_logp=None, denominator: str = "one"):
    """Off-policy (LUFFY/GOLF) token loss ``-A f(u)``, ``f(u) = u/(u+lam)``, no clipping.

    Args:
      logp: ``[B, T]`` current-policy log-probs (differentiated).
      adv: ``[B]`` or ``[B, T]``.
      lam: lambda (default 0.1).
      behaviour_logp: ``[B, T]`` log-probs of the behaviour policy; required
        for ``denominator='behaviour'``.
      denominator: ``'one'``: ``u = pi_theta`` (GOLF/LUFFY code, default);
        ``'behaviour'``: ``u = exp(clip(logp - behaviour_logp, -20, 20))``.

    Returns:
      ``loss [B, T]`` float32. Gradient: ``-A lam u/(u+lam)^2 * grad log pi``.
    """
    logp = _f32(logp)
    if denominator == "one":
        log_u = logp
    elif denominator == "behaviour":
        if behaviour_logp is None:
            raise ValueError("denominator='behaviour' needs behaviour_logp")
        log_u = jnp.clip(logp - jax.lax.stop_gradient(_f32(behaviour_logp)),
                         -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    else:
        raise ValueError(f"denominator must be 'one' or 'behaviour', got {denominator!r}")
    return -_bcast_adv(adv, logp) * reshaped_ratio(log_u, lam)


def policy_loss(logp, old_logp, adv, is_offpolicy, *, eps_low: float = 0.2, eps_high: float = 0.28,
                dual_clip: Optional[float] = None, lam: float = 0.1, denominator: str = "one"):
    """On- and off-policy samples in one call, selected per sample.

    Rows with ``is_offpolicy[b]`` use :func:`offpolicy_loss` (``old_logp`` is
    the behaviour log-prob, used only when ``denominator='behaviour'``); the
    others use :func:`ppo_clip_loss`.

    Args:
      logp, old_logp: ``[B, T]``.
      adv: ``[B]`` or ``[B, T]``.
      is_offpolicy: ``[B]`` bool/float flag.

    Returns:
      ``(loss [B, T], clipped [B, T] bool)``; ``clipped`` is False on off-policy rows.
    """
    on_loss, on_clipped = ppo_clip_loss(logp, old_logp, adv, eps_low=eps_low, eps_high=eps_high,
                                        dual_clip=dual_clip)
    off = offpolicy_loss(logp, adv, lam=lam, behaviour_logp=old_logp, denominator=denominator)
    flag = as_bool_mask(is_offpolicy)
    flag = flag.reshape(flag.shape + (1,) * (on_loss.ndim - flag.ndim))
    return jnp.where(flag, off, on_loss), on_clipped & ~flag


def decoupled_ppo_loss(logp, prox_logp, behav_logp, adv, *, eps_low: float = 0.2,
                       eps_high: float = 0.28, behav_weight_cap: Optional[float] = 5.0,
                       dual_clip: Optional[float] = None):
    """AReaL decoupled PPO objective for stale rollouts (ALGORITHMS.md section 8).

    ``u = exp(clip(logp - prox_logp, -20, 20))``,
    ``w = exp(clip(prox_logp - behav_logp, -20, 20))`` (no gradient),
    ``w := 0 where w > behav_weight_cap`` (masked, *not* clipped; cap None = off),
    ``l = w * max(-A u, -A clip(u, 1-eps_low, 1+eps_high))``.

    Args:
      logp: ``[B, T]`` current policy (differentiated).
      prox_logp: ``[B, T]`` proximal policy, recomputed at the start of the step.
      behav_logp: ``[B, T]`` behaviour policy that generated the rollout.
      adv: ``[B]`` or ``[B, T]``.

    Returns:
      ``(loss [B, T], clipped [B, T] bool)``.
    """
    logp = _f32(logp)
    prox = jax.lax.stop_gradient(_f32(prox_logp))
    behav = jax.lax.stop_gradient(_f32(behav_logp))
    u = _clamped_ratio(logp, prox)
    loss, clipped = _clip_objective(u, _bcast_adv(adv, logp), eps_low, eps_high, dual_clip)
    w = _clamped_ratio(prox, behav)
    if behav_weight_cap is not None:
        w = jnp.where(w > behav_weight_cap, 0.0, w)
    return w * loss, clipped


def kl_penalty(logp, ref_logp, kind: str = "k3"):
    """Per-token KL estimators to a frozen reference, ``d = logp - ref_logp``.

    * ``k1`` (alias ``kl``): ``d``
    * ``k2`` (alias ``mse``): ``0.5 d^2``
    * ``k3`` (alias ``low_var_kl``): ``x = clip(-d, -20, 20)``,
      ``clip(exp(x) - x - 1, -10, 10)`` (verl's clamps).

    Returns ``[B, T]`` float32.
    """
    logp = _f32(logp)
    ref = jax.lax.stop_gradient(_f32(ref_logp))
    d = logp - ref
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        x = jnp.clip(-d, -20.0, 20.0)
        return jnp.clip(jnp.exp(x) - x - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: k1, k2, k3 (aliases kl, mse, low_var_kl)")


def entropy_from_logits(logits):
    """Entropy ``logsumexp(z) - sum softmax(z) z`` over the last axis, in float32.

    ``-inf`` logits (masked vocabulary entries) are handled (they contribute 0).

    Args:
      logits: ``[..., V]``.

    Returns:
      ``[...]`` float32.
    """
    z = _f32(logits)
    lse = jax.nn.logsumexp(z, axis=-1)
    p = jax.nn.softmax(z, axis=-1)
    z_safe = jnp.where(jnp.isfinite(z), z, 0.0)
    return lse - jnp.sum(p * z_safe, axis=-1)


POLICY_LOSSES: Dict[str, Callable] = {
    "ppo_clip": ppo_clip_loss,
    "offpolicy": offpolicy_loss,
    "mixed": policy_loss,
    "decoupled": decoupled_ppo_loss,
}


def get_policy_loss(name: str) -> Callable:
    """Look up a policy loss by name; raises ``ValueError`` listing valid names."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {sorted(POLICY_LOSSES)}") from None
