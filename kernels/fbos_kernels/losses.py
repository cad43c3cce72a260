"""Per-token policy losses, KL estimators and entropy (ALGORITHMS.md sections 2, 3, 7, 8).

Every loss returns an *unreduced* ``[B, T]`` array; aggregate it with
:func:`fbos_kernels.aggregate`. Advantages may be per-sample ``[B]`` (broadcast
to every token, ALGORITHMS.md section 1) or per-token ``[B, T]``.

Conventions:

* **log-ratio clamp**: every importance ratio is ``exp(clip(logp_a - logp_b,
  -20, 20))`` (verl). Outside the clamp the ratio, and hence its gradient, is
  constant: such tokens contribute no gradient through the ratio.
* **clipped flag**: ``True`` where a clip branch is active, i.e. where the
  ratio gets no gradient because of PPO clipping or the dual clip.
* **mask before arithmetic**: every token loss takes an optional keyword
  ``mask`` (``[B, T]``, the shape of ``logp`` exactly). Where it is given, the
  masked positions of *every* input (``logp``, old/prox/behaviour/reference
  log-probs, advantages) are replaced by 0 with ``where`` before any
  arithmetic, and the loss there is exactly 0 (``clipped`` False). NaN/inf at
  masked positions then touch neither the loss nor its gradient; without the
  mask, ``0 * NaN`` in the backward pass would poison every parameter even
  though :func:`fbos_kernels.aggregate` keeps the value clean.
* **exact shapes**: companions of ``logp`` (old/prox/behaviour/reference
  log-probs, ``mask``) must have its shape exactly; ``adv`` must be
  ``logp.shape[:-1]`` or ``logp.shape``; ``is_offpolicy`` must be
  ``logp.shape[:-1]`` (per row) or ``logp.shape`` (per token, for rows that
  pack several sequences). Anything else (e.g. a broadcastable ``[B, 1]``) raises
  ``ValueError`` naming both shapes.
* **parameters**: concrete Python numbers are range-checked (``ValueError``
  naming the parameter and the accepted range): ``0 <= eps_low < 1``,
  ``eps_high >= 0``, ``dual_clip`` None/0 (off) or ``> 1``, ``lam > 0``,
  ``behav_weight_cap`` None (off) or ``>= 1``; names (``denominator``, KL
  ``kind``) must be known. Traced values pass through unchecked.
* Computations are in >= float32 regardless of the input dtype (integer inputs
  included).

Registry (:data:`POLICY_LOSSES`, :func:`get_policy_loss`): every entry has one
call contract, so an update step can look a term's loss up by name::

    loss, clipped = get_policy_loss(name)(
        logp, old_logp=None, adv=None, is_offpolicy=None, *,
        prox_logp=None, mask=None, **hparams)

* ``logp`` ``[B, T]``: current-policy token log-probs (differentiated).
* ``old_logp`` ``[B, T]``: the sampling (behaviour) policy's log-probs, data.
* ``adv`` ``[B]`` or ``[B, T]``: advantages, data.
* ``is_offpolicy`` ``[B]`` or ``[B, T]``: per-sample (or per-token) flag (None =
  every row on-policy).
* ``prox_logp`` ``[B, T]``: AReaL proximal policy ("decoupled" only).
* ``mask`` ``[B, T]``: the loss mask (mask before arithmetic, see above).
* ``hparams``: any of ``eps_low=0.2, eps_high=0.28, dual_clip=None, lam=0.1,
  denominator="one", behav_weight_cap=5.0`` (every entry accepts, and
  validates, the whole set and uses the ones its objective has; an unknown
  name raises ``TypeError``).
* Returns ``(loss [B, T], clipped [B, T] bool)``, unreduced.

Entries (objective; required inputs):

* ``policy_gradient`` (alias ``mixed``): PPO clip on on-policy rows, ``-A f(u)``
  on off-policy rows (:func:`policy_loss`); needs old_logp, adv.
* ``decoupled``: AReaL decoupled PPO on on-policy rows (``old_logp`` is the
  behaviour policy), ``-A f(u)`` on off-policy rows; needs old_logp, adv,
  prox_logp.
* ``ppo_clip``: PPO clip on every row (:func:`ppo_clip_loss`); needs old_logp,
  adv; refuses is_offpolicy.
* ``offpolicy``: ``-A f(u)`` on every row (:func:`offpolicy_loss`, ``old_logp``
  = behaviour, needed for ``denominator="behaviour"``); needs adv; refuses
  is_offpolicy.
* ``mle``: ``-logp`` (:func:`mle_loss`; FCP, SFT); ignores old_logp, adv and
  is_offpolicy.

A required input that is None raises ``ValueError``; ``prox_logp`` given to an
entry other than ``decoupled`` raises ``ValueError`` (it would be dropped
silently otherwise).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp

from ._util import as_bool_mask, as_float, check_choice, check_range, check_shape, is_concrete_number

__all__ = [
    "LOG_RATIO_CLAMP",
    "ppo_clip_loss",
    "offpolicy_loss",
    "reshaped_ratio",
    "policy_loss",
    "decoupled_ppo_loss",
    "mle_loss",
    "kl_penalty",
    "entropy_from_logits",
    "POLICY_LOSSES",
    "ADVANTAGE_LOSSES",
    "KL_ESTIMATORS",
    "RATIO_DENOMINATORS",
    "get_policy_loss",
]

LOG_RATIO_CLAMP = 20.0
# f(u)'s ratio denominators (offpolicy_loss's ``denominator``)
RATIO_DENOMINATORS = ("one", "behaviour")
# kl_penalty's estimators; each also answers to an alias (k1 = kl, k2 = mse, k3 = low_var_kl)
KL_ESTIMATORS = ("k1", "k2", "k3")
_KL_KINDS = KL_ESTIMATORS + ("kl", "mse", "low_var_kl")


# --------------------------------------------------------------------------
# input preparation: shapes, dtypes, mask before arithmetic
# --------------------------------------------------------------------------


def _companion(name, x, logp):
  """A ``[B, T]`` input that must have the shape of ``logp`` exactly, as >= float32."""
  x = jnp.asarray(x)
  check_shape("logp", logp.shape, name, x.shape)
  return as_float(x)


def _full_adv(adv, logp):
  """``adv [B]`` or ``[B, T]`` -> ``[B, T]`` (>= float32); other shapes raise."""
  adv = jnp.asarray(adv)
  check_shape("logp", logp.shape, "adv", adv.shape, allowed=[logp.shape[:-1], logp.shape])
  adv = as_float(adv)
  if adv.ndim == logp.ndim - 1:
    adv = jnp.broadcast_to(adv[..., None], logp.shape)
  return adv


def _token_mask(mask, logp):
  """Bool ``[B, T]`` mask (the shape of ``logp`` exactly), or None."""
  if mask is None:
    return None
  m = jnp.asarray(mask)
  check_shape("logp", logp.shape, "mask", m.shape)
  return as_bool_mask(m)


def _offpolicy_flag(is_offpolicy, shape):
  """``is_offpolicy`` ``[B]`` (one flag per row) or ``[B, T]`` (per token: rows that
  pack several sequences) -> a bool array that broadcasts to ``shape`` = ``[B, T]``;
  other shapes raise."""
  flag = jnp.asarray(is_offpolicy)
  check_shape("logp", shape, "is_offpolicy", flag.shape, allowed=[tuple(shape[:-1]), tuple(shape)])
  flag = as_bool_mask(flag)
  return flag if flag.shape == tuple(shape) else flag[..., None]


def _safe(m, x):
  """Mask before arithmetic: masked positions of ``x`` -> 0 (a finite value; no gradient flows there)."""
  return x if m is None else jnp.where(m, x, jnp.zeros((), x.dtype))


def _zero_masked(m, loss, clipped=None):
  """Loss exactly 0 and ``clipped`` False at masked positions."""
  if m is not None:
    loss = jnp.where(m, loss, jnp.zeros((), loss.dtype))
    if clipped is not None:
      clipped = clipped & m
  return loss if clipped is None else (loss, clipped)


def _dual_clip_on(dual_clip) -> bool:
  """None and a concrete 0 mean off (a traced 0 is handled inside :func:`_clip_objective`)."""
  return dual_clip is not None and not (is_concrete_number(dual_clip) and dual_clip == 0)


def _check_clip(eps_low, eps_high, dual_clip):
  check_range("eps_low", eps_low, ge=0, lt=1)
  check_range("eps_high", eps_high, ge=0)
  if _dual_clip_on(dual_clip):
    check_range("dual_clip", dual_clip, gt=1, extra="or None/0 for off")


def _check_cap(behav_weight_cap):
  if behav_weight_cap is not None:
    check_range("behav_weight_cap", behav_weight_cap, ge=1, extra="or None for off")


def _clamped_ratio(logp, logp_ref):
  return jnp.exp(jnp.clip(logp - logp_ref, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clip_objective(ratio, adv, eps_low, eps_high, dual_clip):
  """max(-A r, -A clip(r)) [+ dual clip]; returns (loss, clipped)."""
  l1 = -adv * ratio
  l2 = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(l1, l2)
  clipped = l2 > l1
  if _dual_clip_on(dual_clip):
    c = jnp.asarray(dual_clip, loss.dtype)
    l3 = -adv * c
    dual = (adv < 0) & (l3 < loss) & (c != 0)  # a traced c == 0 also means off
    loss = jnp.where(dual, l3, loss)
    clipped = clipped | dual
  return loss, clipped


# --------------------------------------------------------------------------
# token losses
# --------------------------------------------------------------------------


def ppo_clip_loss(logp, old_logp, adv, *, eps_low: float = 0.2, eps_high: float = 0.28,
                  dual_clip: Optional[float] = None, mask=None):
  """PPO clipped surrogate with asymmetric eps (clip-higher) and optional dual clip.

  ``rho = exp(clip(logp - old_logp, -20, 20))``,
  ``l = max(-A rho, -A clip(rho, 1-eps_low, 1+eps_high))``; with ``dual_clip=c``
  (c > 1, typically 3) and only where ``A < 0``: ``l = min(l, -A c)``.

  Args:
    logp: ``[B, T]`` current-policy token log-probs (differentiated).
    old_logp: ``[B, T]`` sampling-policy log-probs (treated as data).
    adv: ``[B]`` or ``[B, T]`` advantages.
    eps_low, eps_high: clip range ``[1-eps_low, 1+eps_high]``;
      ``0 <= eps_low < 1``, ``eps_high >= 0``.
    dual_clip: None or 0 (off), or c > 1.
    mask: optional ``[B, T]`` loss mask: masked positions of every input are
      set to 0 before any arithmetic (loss 0, clipped False, no gradient).

  Returns:
    ``(loss [B, T] float32, clipped [B, T] bool)``.
  """
  _check_clip(eps_low, eps_high, dual_clip)
  logp = as_float(logp)
  old = _companion("old_logp", old_logp, logp)
  a = _full_adv(adv, logp)
  m = _token_mask(mask, logp)
  logp, old, a = _safe(m, logp), _safe(m, old), _safe(m, a)
  ratio = _clamped_ratio(logp, jax.lax.stop_gradient(old))
  return _zero_masked(m, *_clip_objective(ratio, a, eps_low, eps_high, dual_clip))


def reshaped_ratio(log_u, lam: float = 0.1):
  """``f(u) = u / (u + lam)`` evaluated stably from ``log u`` (= sigmoid(log u - log lam)).

  ``d f / d log u = lam u / (u + lam)^2 = f (1 - f)``. Computed in >= float32
  (integer ``log_u`` is converted, never ``lam`` truncated); ``lam > 0``.
  """
  check_range("lam", lam, gt=0)
  log_u = as_float(log_u)
  return jax.nn.sigmoid(log_u - jnp.log(jnp.asarray(lam, log_u.dtype)))


def offpolicy_loss(logp, adv, *, lam: float = 0.1, behaviour_logp=None, denominator: str = "one", mask=None):
  """Off-policy (LUFFY/GOLF) token loss ``-A f(u)``, ``f(u) = u/(u+lam)``, no clipping.

  Args:
    logp: ``[B, T]`` current-policy log-probs (differentiated).
    adv: ``[B]`` or ``[B, T]``.
    lam: lambda (default 0.1), > 0.
    behaviour_logp: ``[B, T]`` log-probs of the behaviour policy; required
      for ``denominator='behaviour'``.
    denominator: ``'one'``: ``u = pi_theta`` (GOLF/LUFFY code, default);
      ``'behaviour'``: ``u = exp(clip(logp - behaviour_logp, -20, 20))``.
    mask: optional ``[B, T]`` loss mask (mask before arithmetic, loss 0 there).

  Returns:
    ``loss [B, T]`` float32. Gradient: ``-A lam u/(u+lam)^2 * grad log pi``.
  """
  check_range("lam", lam, gt=0)
  check_choice("denominator", denominator, RATIO_DENOMINATORS)
  logp = as_float(logp)
  a = _full_adv(adv, logp)
  m = _token_mask(mask, logp)
  beh = None if behaviour_logp is None else _companion("behaviour_logp", behaviour_logp, logp)
  logp, a = _safe(m, logp), _safe(m, a)
  if denominator == "one":
    log_u = logp
  else:
    if beh is None:
      raise ValueError("denominator='behaviour' needs behaviour_logp")
    log_u = jnp.clip(logp - jax.lax.stop_gradient(_safe(m, beh)), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  return _zero_masked(m, -a * reshaped_ratio(log_u, lam))


def policy_loss(logp, old_logp, adv, is_offpolicy=None, *, eps_low: float = 0.2, eps_high: float = 0.28,
                dual_clip: Optional[float] = None, lam: float = 0.1, denominator: str = "one", mask=None):
  """On- and off-policy samples in one call, selected per sample.

  Rows with ``is_offpolicy[b]`` use :func:`offpolicy_loss` (``old_logp`` is
  the behaviour log-prob, used only when ``denominator='behaviour'``); the
  others use :func:`ppo_clip_loss`.

  Args:
    logp, old_logp: ``[B, T]``.
    adv: ``[B]`` or ``[B, T]``.
    is_offpolicy: ``[B]`` bool/float flag (``logp.shape[:-1]`` exactly), or
      ``[B, T]`` per token (rows packing several sequences); None = every row
      on-policy.
    eps_low, eps_high, dual_clip: as :func:`ppo_clip_loss`.
    lam, denominator: as :func:`offpolicy_loss`.
    mask: optional ``[B, T]`` loss mask (mask before arithmetic, loss 0 there).

  Returns:
    ``(loss [B, T], clipped [B, T] bool)``; ``clipped`` is False on off-policy rows.
  """
  check_range("lam", lam, gt=0)
  check_choice("denominator", denominator, RATIO_DENOMINATORS)
  on_loss, on_clipped = ppo_clip_loss(logp, old_logp, adv, eps_low=eps_low, eps_high=eps_high,
                                      dual_clip=dual_clip, mask=mask)
  if is_offpolicy is None:
    return on_loss, on_clipped
  flag = _offpolicy_flag(is_offpolicy, on_loss.shape)
  off = offpolicy_loss(logp, adv, lam=lam, behaviour_logp=old_logp, denominator=denominator, mask=mask)
  return jnp.where(flag, off, on_loss), on_clipped & ~flag


def decoupled_ppo_loss(logp, prox_logp, behav_logp, adv, *, eps_low: float = 0.2,
                       eps_high: float = 0.28, behav_weight_cap: Optional[float] = 5.0,
                       dual_clip: Optional[float] = None, mask=None):
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
    eps_low, eps_high, dual_clip: as :func:`ppo_clip_loss`.
    behav_weight_cap: None (off) or a cap >= 1 (a cap below 1 would mask
      every token of a fresh rollout, where ``w = 1``).
    mask: optional ``[B, T]`` loss mask (mask before arithmetic, loss 0 there).

  Returns:
    ``(loss [B, T], clipped [B, T] bool)``.
  """
  _check_clip(eps_low, eps_high, dual_clip)
  _check_cap(behav_weight_cap)
  logp = as_float(logp)
  prox = _companion("prox_logp", prox_logp, logp)
  behav = _companion("behav_logp", behav_logp, logp)
  a = _full_adv(adv, logp)
  m = _token_mask(mask, logp)
  logp, prox, behav, a = _safe(m, logp), _safe(m, prox), _safe(m, behav), _safe(m, a)
  prox = jax.lax.stop_gradient(prox)
  behav = jax.lax.stop_gradient(behav)
  u = _clamped_ratio(logp, prox)
  loss, clipped = _clip_objective(u, a, eps_low, eps_high, dual_clip)
  w = _clamped_ratio(prox, behav)
  if behav_weight_cap is not None:
    w = jnp.where(w > behav_weight_cap, 0.0, w)
  return _zero_masked(m, w * loss, clipped)


def mle_loss(logp, *, mask=None):
  """Negative log-likelihood per token, ``l_t = -logp_t`` (FCP, SFT; ALGORITHMS.md section 7).

  Args:
    logp: ``[B, T]`` token log-probs (differentiated).
    mask: optional ``[B, T]`` loss mask (mask before arithmetic, loss 0 there).

  Returns:
    ``loss [B, T]`` float32.
  """
  logp = as_float(logp)
  m = _token_mask(mask, logp)
  return _zero_masked(m, -_safe(m, logp))


def kl_penalty(logp, ref_logp, kind: str = "k3", *, mask=None):
  """Per-token KL estimators to a frozen reference, ``d = logp - ref_logp``.

  * ``k1`` (alias ``kl``): ``d``
  * ``k2`` (alias ``mse``): ``0.5 d^2``
  * ``k3`` (alias ``low_var_kl``): ``x = clip(-d, -20, 20)``,
    ``clip(exp(x) - x - 1, -10, 10)`` (verl's clamps).

  ``ref_logp`` must have the shape of ``logp`` exactly; ``mask`` (optional,
  same shape) sets masked inputs to 0 before any arithmetic (KL 0 there).

  Returns ``[B, T]`` float32.
  """
  if kind not in _KL_KINDS:
    raise ValueError(f"unknown KL estimator kind {kind!r}; valid: k1, k2, k3 (aliases kl, mse, low_var_kl)")
  logp = as_float(logp)
  ref = _companion("ref_logp", ref_logp, logp)
  m = _token_mask(mask, logp)
  logp, ref = _safe(m, logp), jax.lax.stop_gradient(_safe(m, ref))
  d = logp - ref
  if kind in ("k1", "kl"):
    out = d
  elif kind in ("k2", "mse"):
    out = 0.5 * d * d
  else:
    x = jnp.clip(-d, -20.0, 20.0)
    out = jnp.clip(jnp.exp(x) - x - 1.0, -10.0, 10.0)
  return _zero_masked(m, out)


def entropy_from_logits(logits):
  """Entropy ``logsumexp(z) - sum softmax(z) z`` over the last axis, in >= float32.

  Computed relative to the row max, ``z' = z - max z`` (the entropy is
  shift-invariant): ``H = logsumexp(z') - sum softmax(z') z'``. Without the
  shift both terms are ~``max z`` and their difference loses the digits
  (float32 error 1.4e-3 at logits ~1e4, 4.5e-3 at ~3e4, before the fix). ``-inf`` logits (masked
  vocabulary entries) are handled (they contribute 0).

  Args:
    logits: ``[..., V]``.

  Returns:
    ``[...]`` float32 (float64 for float64 logits).
  """
  z = as_float(logits)
  zmax = jnp.max(z, axis=-1, keepdims=True)
  zmax = jax.lax.stop_gradient(jnp.where(jnp.isfinite(zmax), zmax, 0.0))
  zc = z - zmax
  lse = jax.nn.logsumexp(zc, axis=-1)
  p = jax.nn.softmax(zc, axis=-1)
  zc_safe = jnp.where(jnp.isfinite(zc), zc, 0.0)
  return lse - jnp.sum(p * zc_safe, axis=-1)


# --------------------------------------------------------------------------
# registry (one call contract; see the module docstring)
# --------------------------------------------------------------------------

_REGISTRY_HPARAMS = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": None, "lam": 0.1, "denominator": "one",
                     "behav_weight_cap": 5.0}


def _hparams(name, given):
  """Fill the registry defaults and validate the whole set (used or not by ``name``)."""
  unknown = sorted(set(given) - set(_REGISTRY_HPARAMS))
  if unknown:
    raise TypeError(f"policy loss {name!r} got unknown hyperparameter(s) {unknown}; "
                    f"accepted: {sorted(_REGISTRY_HPARAMS)}")
  h = {**_REGISTRY_HPARAMS, **given}
  _check_clip(h["eps_low"], h["eps_high"], h["dual_clip"])
  check_range("lam", h["lam"], gt=0)
  check_choice("denominator", h["denominator"], RATIO_DENOMINATORS)
  _check_cap(h["behav_weight_cap"])
  return h


def _require(name, **inputs):
  for key, value in inputs.items():
    if value is None:
      raise ValueError(f"policy loss {name!r} needs {key}")


def _refuse(name, hint, **inputs):
  for key, value in inputs.items():
    if value is not None:
      raise ValueError(f"policy loss {name!r} does not use {key} (it would be ignored); {hint}")


def _ppo_kw(h):
  return dict(eps_low=h["eps_low"], eps_high=h["eps_high"], dual_clip=h["dual_clip"])


def _policy_gradient_entry(logp, old_logp=None, adv=None, is_offpolicy=None, *, prox_logp=None, mask=None,
                           **hparams):
  """Registry ``policy_gradient`` (alias ``mixed``): :func:`policy_loss`."""
  h = _hparams("policy_gradient", hparams)
  _require("policy_gradient", old_logp=old_logp, adv=adv)
  _refuse("policy_gradient", "use 'decoupled' for the AReaL objective", prox_logp=prox_logp)
  return policy_loss(logp, old_logp, adv, is_offpolicy, lam=h["lam"], denominator=h["denominator"],
                     mask=mask, **_ppo_kw(h))


def _decoupled_entry(logp, old_logp=None, adv=None, is_offpolicy=None, *, prox_logp=None, mask=None, **hparams):
  """Registry ``decoupled``: :func:`decoupled_ppo_loss` (behaviour = ``old_logp``) on on-policy rows,
  :func:`offpolicy_loss` on off-policy rows."""
  h = _hparams("decoupled", hparams)
  _require("decoupled", old_logp=old_logp, adv=adv, prox_logp=prox_logp)
  loss, clipped = decoupled_ppo_loss(logp, prox_logp, old_logp, adv, behav_weight_cap=h["behav_weight_cap"],
                                     mask=mask, **_ppo_kw(h))
  if is_offpolicy is None:
    return loss, clipped
  flag = _offpolicy_flag(is_offpolicy, loss.shape)
  off = offpolicy_loss(logp, adv, lam=h["lam"], behaviour_logp=old_logp, denominator=h["denominator"],
                       mask=mask)
  return jnp.where(flag, off, loss), clipped & ~flag


def _ppo_clip_entry(logp, old_logp=None, adv=None, is_offpolicy=None, *, prox_logp=None, mask=None, **hparams):
  """Registry ``ppo_clip``: :func:`ppo_clip_loss` on every row."""
  h = _hparams("ppo_clip", hparams)
  _require("ppo_clip", old_logp=old_logp, adv=adv)
  _refuse("ppo_clip", "use 'policy_gradient' for mixed on/off-policy rows, 'decoupled' for AReaL",
          is_offpolicy=is_offpolicy, prox_logp=prox_logp)
  return ppo_clip_loss(logp, old_logp, adv, mask=mask, **_ppo_kw(h))


def _offpolicy_entry(logp, old_logp=None, adv=None, is_offpolicy=None, *, prox_logp=None, mask=None, **hparams):
  """Registry ``offpolicy``: :func:`offpolicy_loss` on every row (``old_logp`` = behaviour)."""
  h = _hparams("offpolicy", hparams)
  _require("offpolicy", adv=adv)
  _refuse("offpolicy", "use 'policy_gradient' for mixed on/off-policy rows",
          is_offpolicy=is_offpolicy, prox_logp=prox_logp)
  loss = offpolicy_loss(logp, adv, lam=h["lam"], behaviour_logp=old_logp, denominator=h["denominator"],
                        mask=mask)
  return loss, jnp.zeros(loss.shape, bool)


def _mle_entry(logp, old_logp=None, adv=None, is_offpolicy=None, *, prox_logp=None, mask=None, **hparams):
  """Registry ``mle``: :func:`mle_loss`; ``old_logp``, ``adv`` and ``is_offpolicy`` are not used."""
  _hparams("mle", hparams)
  _refuse("mle", "MLE has no importance ratio", prox_logp=prox_logp)
  del old_logp, adv, is_offpolicy
  loss = mle_loss(logp, mask=mask)
  return loss, jnp.zeros(loss.shape, bool)


POLICY_LOSSES: Dict[str, Callable] = {
    "policy_gradient": _policy_gradient_entry,
    "mixed": _policy_gradient_entry,
    "decoupled": _decoupled_entry,
    "ppo_clip": _ppo_clip_entry,
    "offpolicy": _offpolicy_entry,
    "mle": _mle_entry,
}

# The entries that weight tokens by advantages (every one but mle): with one sample per
# group, group-normalised advantages are all 0 and such a loss trains nothing.
ADVANTAGE_LOSSES = tuple(name for name in POLICY_LOSSES if name != "mle")


def get_policy_loss(name: str) -> Callable:
  """Look up a policy loss by name; raises ``ValueError`` listing valid names.

  Every entry has the call contract of the module docstring::

      loss, clipped = get_policy_loss(name)(logp, old_logp=None, adv=None, is_offpolicy=None, *,
                                            prox_logp=None, mask=None, **hparams)

  with ``hparams`` among ``eps_low, eps_high, dual_clip, lam, denominator,
  behav_weight_cap``; ``loss`` and ``clipped`` are ``[B, T]`` (unreduced).
  Entries: ``policy_gradient`` (= ``mixed``), ``decoupled``, ``ppo_clip``,
  ``offpolicy``, ``mle``.
  """
  try:
    return POLICY_LOSSES[name]
  except KeyError:
    raise ValueError(f"unknown policy loss {name!r}; valid names: {sorted(POLICY_LOSSES)}") from None
