"""Host-side batch assembly between the sampling rounds (numpy; no jit).

Everything here is a pure function of arrays, so every FBOS-RL knob
(``fap_from``, ``epa_select``, ``epa_mode``, ``epa_trigger``, ``ecc_advantage``,
GFPO masks) is unit-testable on hand-built rewards.

Index conventions: round-1 rollouts are rows ``p * n + i`` (prompt-major);
round-2 rollouts are a flat list of rows with ``r2_prompt[j]`` (which prompt)
and ``r2_source[j]`` (which round-1 rollout's feedback built its FAP, or -1 for
GOLF's aggregated prompt).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

import fbos_kernels as K


_group_advantages = jax.jit(K.group_advantages, static_argnames=("estimator", "eps"))
_gfpo_advantages = jax.jit(K.gfpo_advantages, static_argnames=("estimator", "eps"))
_gfpo_scores = jax.jit(K.gfpo_scores, static_argnames=("metric",))
_gfpo_keep_mask = jax.jit(K.gfpo_keep_mask)


def advantages(rewards: np.ndarray, valid: np.ndarray, estimator: str, eps: float,
               keep: Optional[np.ndarray] = None) -> np.ndarray:
  """Group advantages [P, G] through the kernels, jitted (GFPO's over the kept
  subset when ``keep`` [P, G] is given); returned as numpy."""
  r = np.asarray(rewards, np.float32)
  v = np.asarray(valid, bool)
  if keep is not None:
    a = _gfpo_advantages(r, v, np.asarray(keep, bool), estimator=estimator, eps=eps)
  else:
    a = _group_advantages(r, v, estimator=estimator, eps=eps)
  return np.asarray(a, np.float32)


def select_fap_sources(r1: np.ndarray, fap_from: str, threshold: float) -> np.ndarray:
  """[P, n] bool: which round-1 rollouts get a feedback-augmented prompt."""
  if fap_from == "failed":
    return r1 < threshold
  if fap_from == "all":
    return np.ones_like(r1, bool)
  raise ValueError(f"rl.fap_from={fap_from!r}; expected 'failed' or 'all'.")


def round2_plan(selected: np.ndarray, m: int, fap_mode: str):
  """Which round-2 rollouts to draw.

  single: for each prompt with selected rollouts, m rollouts spread round-robin
  over its selected FAPs. aggregated (GOLF): m rollouts from one prompt per q.
  Returns (r2_prompt [M2], r2_source [M2]) int arrays; source -1 = aggregated.
  """
  prompts, sources = [], []
  for p in range(selected.shape[0]):
    sel = np.flatnonzero(selected[p])
    if sel.size == 0:
      continue
    for j in range(m):
      prompts.append(p)
      sources.append(int(sel[j % sel.size]) if fap_mode == "single" else -1)
  if fap_mode not in ("single", "aggregated"):
    raise ValueError(f"rl.fap_mode={fap_mode!r}; expected 'single' or 'aggregated'.")
  return np.asarray(prompts, np.int64), np.asarray(sources, np.int64)


@dataclasses.dataclass
class EpaGroups:
  """The merged groups on the original prompts.

  member:   [P, G] int   index of the rollout (round-1 row if not off-policy,
                         else round-2 row); -1 where invalid
  offpolicy:[P, G] bool  member comes from round 2 (takes the f(u) loss)
  valid:    [P, G] bool
  rewards:  [P, G] float
  injected: int          number of round-2 rollouts that entered a group
  """
  member: np.ndarray
  offpolicy: np.ndarray
  valid: np.ndarray
  rewards: np.ndarray
  injected: int


def epa_groups(r1: np.ndarray, r2: np.ndarray, r2_prompt: np.ndarray, r2_source: np.ndarray,
               *, select: str, mode: str, trigger: str, tau: float, max_per_prompt: int,
               threshold: float, enabled: bool, rng: np.random.Generator) -> EpaGroups:
  """Merge selected round-2 rollouts into the round-1 groups on q (section 6.3).

  r1: [P, n] round-1 rewards; r2: [M2] round-2 rewards.
  select: correct (r2 >= threshold) | improved (r2 > reward of its source) | all.
  mode: append (group grows by up to max_per_prompt) | replace (each selected
  rollout replaces a randomly chosen failed round-1 rollout: GOLF's injection).
  trigger: always | adaptive (only prompts whose round-1 mean reward < tau).
  """
  P, n = r1.shape
  extra = max_per_prompt if (enabled and mode == "append") else 0
  G = n + extra
  member = np.full((P, G), -1, np.int64)
  member[:, :n] = np.arange(P * n).reshape(P, n)
  off = np.zeros((P, G), bool)
  valid = np.zeros((P, G), bool)
  valid[:, :n] = True
  rew = np.zeros((P, G), np.float32)
  rew[:, :n] = r1
  injected = 0
  if not enabled or r2.size == 0:
    return EpaGroups(member, off, valid, rew, 0)
  if select not in ("correct", "improved", "all"):
    raise ValueError(f"rl.epa_select={select!r}; expected correct | improved | all.")
  if mode not in ("append", "replace"):
    raise ValueError(f"rl.epa_mode={mode!r}; expected append | replace.")
  if trigger not in ("always", "adaptive"):
    raise ValueError(f"rl.epa_trigger={trigger!r}; expected always | adaptive.")
  for p in range(P):
    if trigger == "adaptive" and not r1[p].mean() < tau:
      continue
    js = _selected_round2(p, r1, r2, r2_prompt, r2_source, select, threshold)
    if js.size == 0:
      continue
    if mode == "append":
      js = js[:max_per_prompt]
      slots = np.arange(n, n + js.size)
      valid[p, slots] = True
    else:
      failed = np.flatnonzero(r1[p] < threshold)
      k = min(max_per_prompt, failed.size, js.size)
      if k == 0:
        continue
      slots = rng.choice(failed, size=k, replace=False)
      js = rng.choice(js, size=k, replace=False)
    member[p, slots] = js
    off[p, slots] = True
    rew[p, slots] = r2[js]
    injected += js.size
  return EpaGroups(member, off, valid, rew, injected)


def _selected_round2(p, r1, r2, r2_prompt, r2_source, select: str, threshold: float):
  """Round-2 rows of prompt ``p`` that EPA may pull back (``rl.epa_select``)."""
  js = np.flatnonzero(r2_prompt == p)
  if select == "correct":
    js = js[r2[js] >= threshold]
  elif select == "improved":
    src_r = np.where(r2_source[js] >= 0, r1[p][np.maximum(r2_source[js], 0)], r1[p].mean())
    js = js[r2[js] > src_r]
  return js


def ecc_advantages(r1: np.ndarray, r2: np.ndarray, r2_prompt: np.ndarray,
                   r2_source: np.ndarray, *, mode: str, estimator: str,
                   eps: float, width: int = 0) -> np.ndarray:
  """[M2] advantages of round-2 rollouts on their FAPs (section 6.4).

  group: normalise r2 over q's round-2 rollouts; improvement: normalise
  r2 - r(source) (the source reward is q's round-1 mean for aggregated FAPs).
  The groups go to the jitted kernel as [P, width] (one row per prompt of
  ``r1``, ``width`` at least the largest group; 0 = that largest), so with a
  fixed ``width`` (the round-2 size) every step reuses one compiled program;
  the empty places are invalid and change nothing.
  """
  if r2.size == 0:
    return np.zeros((0,), np.float32)
  prompts = np.unique(r2_prompt)
  width = max([int(width)] + [int((r2_prompt == p).sum()) for p in prompts])
  R = np.zeros((r1.shape[0], width), np.float32)
  V = np.zeros((r1.shape[0], width), bool)
  pos = np.zeros(r2.size, np.int64)
  row = np.zeros(r2.size, np.int64)
  for p in prompts:
    js = np.flatnonzero(r2_prompt == p)
    vals = r2[js].astype(np.float32)
    if mode == "improvement":
      base = np.where(r2_source[js] >= 0, r1[p][np.maximum(r2_source[js], 0)], r1[p].mean())
      vals = vals - base
    elif mode != "group":
      raise ValueError(f"rl.ecc_advantage={mode!r}; expected group | improvement.")
    R[p, :js.size] = vals
    V[p, :js.size] = True
    row[js] = p
    pos[js] = np.arange(js.size)
  A = advantages(R, V, estimator, eps)
  return A[row, pos]


def gfpo_keep(rewards: np.ndarray, lengths: np.ndarray, valid: np.ndarray, k, metric: str):
  """[P, G] bool retention mask: top-k per group by the GFPO metric (jitted).
  A member whose reward is not finite can take none of the k places."""
  rewards = np.asarray(rewards, np.float32)
  scores = _gfpo_scores(rewards, np.asarray(lengths, np.float32), metric=metric)
  valid = np.asarray(valid, bool) & np.isfinite(rewards)
  return np.asarray(_gfpo_keep_mask(scores, valid, np.asarray(k, np.int32)), bool)


def all_zero_group_fraction(r1: np.ndarray) -> float:
  """Share of prompts whose round-1 rewards are all equal (no GRPO signal)."""
  return float(np.mean(r1.max(axis=1) == r1.min(axis=1)))


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
  n, c = num_samples, num_correct
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
