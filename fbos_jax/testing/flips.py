"""Two samplers' rows compared token for token, with every difference proven to be
a float near-tie (issue 29, "flips proven, not tolerated").

Two runs of the same rows (the static sampler and the engine, two engine
configs, one process and two) compute the same logits up to float rounding, so
a row may take another token where the draw was a near-tie. :func:`assert_same_rows`
lets a row differ only where its **first** differing token is proven to be one,
on the logits recomputed by teacher forcing (``sampling.teacher_forced_logits``)
at that position:

- greedy: the two tokens' probabilities are both within ``tol`` of the largest;
- sampled: the row's uniform (``sampling.key_uniform(key, step, stream)``, the
  samplers' own draw) lies within ``tol`` of the CDF boundary between the two
  tokens (``sampling.draw_weights``, the samplers' own distribution), with at
  most ``tol`` of probability between them.

Before that step the rows must agree (tokens, and log-probs to ``atol``); rows
without a difference must agree in everything. A wrong stream id, key, step or
page on one row is not a near-tie and fails. Returns the flips (counted by the
callers); ``NEAR_TIE`` = 1e-4, the bound the issue sets.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fbos_jax import sampling

NEAR_TIE = 1e-4


@dataclasses.dataclass(frozen=True)
class Flip:
  """Row ``row`` took ``tokens`` = (a's, b's) at ``step``; ``gap`` is the proven
  distance to the tie (probabilities, or uniform vs CDF boundary)."""
  row: int
  step: int
  tokens: tuple
  gap: float


def _streams(num_rows: int, n: int, stream_ids: Optional[Sequence[int]]) -> np.ndarray:
  """Each row's stream (sample j of prompt i: ``stream_ids[i] * n + j``, the samplers'
  key contract; default ``stream_ids = arange(prompts)``)."""
  prompts = num_rows // n
  ids = np.arange(prompts) if stream_ids is None else np.asarray(stream_ids, np.int64)
  if ids.shape != (prompts,):
    raise ValueError(f"stream_ids has shape {ids.shape}; expected ({prompts},) for "
                     f"{num_rows} rows of {n} samples per prompt.")
  return (ids[:, None] * n + np.arange(n)[None, :]).reshape(-1)


def near_tie_gaps(params, cfg, prompt_tokens, prompt_mask, tokens, steps, picks, *, key,
                  streams, scfg: sampling.SamplingConfig, logit_bias=None) -> np.ndarray:
  """How far each draw was from a tie: [F] float64 for F rows, where row f took
  ``picks[f] = (a, b)`` at ``steps[f]`` in two runs after the same ``tokens[f, :step]``.

  prompt_tokens / prompt_mask [F, P], tokens [F, R], steps [F], picks [F, 2],
  streams [F] (the rows' streams), logit_bias [F, V] or None."""
  f, r = np.asarray(tokens).shape
  steps = np.asarray(steps, np.int64)
  rmask = (np.arange(r)[None, :] < steps[:, None]).astype(np.int32)
  fn = jax.jit(sampling.teacher_forced_logits, static_argnums=1, static_argnames="vocab_limit")
  logits = fn(params, cfg, prompt_tokens, prompt_mask, tokens, rmask,
              vocab_limit=int(scfg.vocab_limit))
  logits = jnp.take_along_axis(logits, jnp.asarray(steps)[:, None, None], axis=1)[:, 0]
  logits = sampling.add_logit_bias(logits, None if logit_bias is None
                                   else jnp.asarray(logit_bias, jnp.float32))
  picks = np.asarray(picks, np.int64)
  if scfg.is_greedy:
    p = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    top = p.max(axis=-1)
    return top - np.take_along_axis(p, picks, axis=1).min(axis=1)
  _, _, w = sampling.draw_weights(logits, jnp.float32(scfg.temperature), jnp.float32(scfg.top_p),
                                  top_k=int(scfg.top_k), use_top_p=float(scfg.top_p) < 1.0)
  w = np.asarray(w, np.float64)
  cdf = np.cumsum(w, axis=-1) / w.sum(axis=-1, keepdims=True)
  u = np.asarray(jax.vmap(sampling.key_uniform, in_axes=(None, 0, 0))(
      key, jnp.asarray(steps, jnp.int32), jnp.asarray(streams, jnp.uint32)), np.float64)
  lo, hi = picks.min(axis=1), picks.max(axis=1)
  rows = np.arange(f)
  boundary = cdf[rows, lo]  # below it: lo is drawn; from it on: a later token
  between = cdf[rows, hi - 1] - boundary  # probability strictly between the two tokens
  return np.maximum(np.abs(u - boundary), between)


def assert_same_rows(a, b, params, cfg, *, key=None, n_per_prompt: int = 1,
                     stream_ids: Optional[Sequence[int]] = None, logit_bias=None,
                     atol: float = 1e-5, rtol: float = 1e-7, tol: float = NEAR_TIE,
                     config: Optional[sampling.SamplingConfig] = None, **options) -> list:
  """``a`` and ``b`` (two :class:`~fbos_jax.sampling.SampleOutput` of the same
  prompts under the same sampling options, ``config`` / ``**options`` as for
  ``sampling.sample``) hold the same rows, but for proven near-tie flips (see the
  module docstring). ``key``, ``n_per_prompt``, ``stream_ids`` (global prompt
  index of each prompt; default 0, 1, ...) and ``logit_bias`` [prompts, V] as
  given to the samplers; ``params`` / ``cfg`` the model they sampled; log-probs
  compared to ``atol + rtol * |log p|``. Returns
  the :class:`Flip` of every row that differs (raises AssertionError on any other
  difference)."""
  scfg = sampling.make_config(config, **options)
  n = int(n_per_prompt)
  for name in ("prompt_tokens", "prompt_mask", "prompt_truncated"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
  ta, tb = np.asarray(a.tokens), np.asarray(b.tokens)
  assert ta.shape == tb.shape, (ta.shape, tb.shape)
  if not ta.size:
    return []
  if not scfg.is_greedy and key is None:
    raise ValueError("assert_same_rows: sampled rows need the samplers' key to prove a flip.")
  streams = _streams(ta.shape[0], n, stream_ids)
  flipped, steps = [], []
  for r in range(ta.shape[0]):
    diff = np.nonzero(ta[r] != tb[r])[0]
    if diff.size:
      t = int(diff[0])
      np.testing.assert_allclose(b.logprobs[r, :t], a.logprobs[r, :t], atol=atol, rtol=rtol,
                                 err_msg=f"row {r} before its first differing step {t}")
      flipped.append(r)
      steps.append(t)
      continue
    np.testing.assert_allclose(b.logprobs[r], a.logprobs[r], atol=atol, rtol=rtol,
                               err_msg=f"row {r}")
    assert a.lengths[r] == b.lengths[r] and a.stopped[r] == b.stopped[r], f"row {r}"
    np.testing.assert_array_equal(a.response_mask[r], b.response_mask[r], err_msg=f"row {r}")
  if not flipped:
    return []
  rows, steps = np.asarray(flipped), np.asarray(steps)
  picks = np.stack([ta[rows, steps], tb[rows, steps]], axis=1)
  bias = None if logit_bias is None else np.asarray(logit_bias, np.float32)[rows // n]
  gaps = near_tie_gaps(params, cfg, np.asarray(a.prompt_tokens)[rows],
                       np.asarray(a.prompt_mask)[rows], ta[rows], steps, picks, key=key,
                       streams=streams[rows], scfg=scfg, logit_bias=bias)
  flips = [Flip(int(r), int(t), (int(x), int(y)), float(g))
           for r, t, (x, y), g in zip(rows, steps, picks, gaps)]
  bad = [f for f in flips if not f.gap <= tol]
  kind = "probabilities" if scfg.is_greedy else "uniform vs CDF boundary"
  assert not bad, (f"{len(bad)} of {len(flips)} differing rows are not near-ties ({kind} "
                   f"further apart than {tol}): {bad}")
  return flips
