"""SFT warm start: verified demonstrations, FAP corrections in their own slot, caching."""

import os
import random

import jax
import numpy as np
import pytest

from fbos_jax.rl import sft
from fbos_jax.rl.trainer import RLTrainer
from fbos_jax.testing.small import one_device_mesh, small_config


def _setup(tmp_path, **over):
  c = small_config("configs/fbos.py:tiny", **{"sft.batch_size": 16, "sft.fap_fraction": 0.25,
                                              "sft.steps": 30, "sft.warmup_steps": 3, **over})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  return c, tr


def _plain(ctx, ex):
  return ctx.prompts.plain(ex["prompt"]).token_ids


def test_demonstrations_are_verified_and_corrections_are_faps(tmp_path):
  c, tr = _setup(tmp_path)
  rc = tr.ctx
  examples = next(tr.train_iter) + next(tr.train_iter)
  (pp, pr), (cp, cr) = sft.demonstration_rows(rc, examples, conditional=False,
                                              rng=random.Random(0), num_corrections=3)
  assert len(cp) == 3 and len(pp) == len(examples) - 3
  thr = c.verifier.success_threshold
  verifier, tok = rc.pool.verifier, rc.tokenizer
  for ex, ctx, resp in zip(examples[:3], cp, cr):
    text = tok.decode(resp[:-1])
    assert resp[-1] == tok.eos_token_id and verifier(ex, text).reward >= thr
    q = _plain(rc, ex)
    assert ctx[:len(q)] != q or len(ctx) > len(q)
    assert "wrong" in tok.decode(ctx) or "digit" in tok.decode(ctx)
  for ex, ctx, resp in zip(examples[3:], pp, pr):
    assert ctx == _plain(rc, ex)
    assert verifier(ex, tok.decode(resp[:-1])).reward >= thr
  tr.close()


def test_sft_lowers_both_nlls_and_is_cached(tmp_path):
  c, tr = _setup(tmp_path)
  state = tr.init_state()
  trained, hist = sft.train_sft(c, tr.ctx, state.params, state.rng, progress=False)
  assert hist[-1]["nll_plain"] < 0.7 * hist[0]["nll_plain"], hist
  assert hist[-1]["nll_corrections"] < 0.7 * hist[0]["nll_corrections"], hist
  # warm_start trains once, then reuses the cache
  p1, cached1 = sft.warm_start(c, tr.ctx, state, cache_dir=str(tmp_path / "sft"))
  p2, cached2 = sft.warm_start(c, tr.ctx, state, cache_dir=str(tmp_path / "sft"))
  assert (cached1, cached2) == (False, True)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # a cache trained under other SFT settings is not silently reused
  c.sft.steps += 1
  with pytest.raises(ValueError, match=r"(?s)different config.*sft\.steps: cached"):
    sft.warm_start(c, tr.ctx, state, cache_dir=str(tmp_path / "sft"))
  assert os.path.exists(tmp_path / "sft" / "params")  # nothing deleted
  tr.close()


def test_self_corrections_are_the_models_own_failures(tmp_path):
  """sft.corrections=self: a correction's wrong attempt is one of the model's own
  failed samples, with the verifier's feedback on it; a correct-only example
  falls back to a corruption."""
  c, tr = _setup(tmp_path, **{"sft.corrections": "self", "sft.self_samples": 3})
  rc = tr.ctx
  examples = next(tr.train_iter)
  params = tr.init_state().params
  own = sft.own_failures(c, rc, params, examples, key=jax.random.key(0))
  assert len(own) == len(examples) and any(o is not None for o in own)
  thr = c.verifier.success_threshold
  verifier = rc.pool.verifier
  for ex, o in zip(examples, own):
    if o is not None:
      assert verifier(ex, o).reward < thr
  failures = list(own)
  failures[0] = None  # a correct-only example: a corruption stands in
  stats = {}
  (_, _), (cp, cr) = sft.demonstration_rows(rc, examples, conditional=False,
                                            rng=random.Random(0), num_corrections=3,
                                            failures=failures, stats=stats)
  assert len(cp) == 3
  for ex, o, ctx in zip(examples[1:3], own[1:3], cp[1:3]):
    assert ctx == rc.prompts.fap(ex["prompt"], o, verifier(ex, o).feedback).token_ids
  assert stats["own"] == sum(o is not None for o in own[1:3]) and stats["truncated"] == 0
  tr.close()


def test_self_corrections_start_mid_run_and_the_recipe_is_fingerprinted(tmp_path):
  c, tr = _setup(tmp_path, **{"sft.corrections": "self", "sft.self_corrections_from": 0.5,
                              "sft.steps": 4})
  assert sft._self_corrections_start(c, 4) == 2
  state = tr.init_state()
  _, hist = sft.train_sft(c, tr.ctx, state.params, state.rng, progress=False)
  assert hist[0]["step"] == 0 and hist[0]["corrections_own"] == 0  # corruptions first
  assert hist[-1]["step"] == 3 and hist[-1]["corrections_own"] > 0  # then own failures
  # the recipe is part of the cache key; the corrupt recipe keeps the old key
  fp = sft._fingerprint(c, tr.parts)
  assert fp["sft"]["corrections"] == "self" and "sampling" in fp
  c.sft.corrections = "corrupt"
  old = sft._fingerprint(c, tr.parts)
  assert not set(sft._SELF_ONLY_FIELDS) & set(old["sft"]) and "sampling" not in old
  assert sft._diff(old, fp)
  tr.close()
