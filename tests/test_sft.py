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


@pytest.mark.isolated  # the SFT update's compile: see tests/conftest.py
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
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


@pytest.mark.isolated  # the SFT update's compile: see tests/conftest.py
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


# ----------------------------------------------------------------------------- issue 24


def _two_stages(tmp_path, **over):
  return _setup(tmp_path, **{
      "sft.steps": 6,  # the stages' total
      "sft.stages": ({"name": "demos", "steps": 3, "learning_rate": 2e-3, "fap_fraction": 0.0},
                     {"name": "fixes", "steps": 3, "learning_rate": 1e-3, "warmup_steps": 1,
                      "fap_fraction": 0.75, "corrections": "self",
                      "self_corrections_from": 0.0}), **over})


def test_stage_configs_apply_each_stages_fields(tmp_path):
  c, tr = _two_stages(tmp_path)
  (n1, c1), (n2, c2) = sft.stage_configs(c)
  assert (n1, n2) == ("demos", "fixes")
  assert (c1.sft.steps, c1.sft.learning_rate, c1.sft.fap_fraction) == (3, 2e-3, 0.0)
  assert (c2.sft.steps, c2.sft.learning_rate, c2.sft.fap_fraction, c2.sft.corrections) == \
      (3, 1e-3, 0.75, "self")
  assert c1.sft.stages == () and c.sft.stages[0]["name"] == "demos"  # the config is untouched
  one = c.copy_and_resolve_references()
  one.sft.stages = ()
  assert [n for n, _ in sft.stage_configs(one)] == ["sft"]  # no stages: one
  c.sft.stages = ({"steps": 2, "learnign_rate": 1.0},)
  with pytest.raises(ValueError, match=r"sft.stages\[0\] \('stage1'\): unknown sft field\(s\) "
                                       r"\['learnign_rate'\]"):
    sft.stage_configs(c)
  tr.close()


@pytest.mark.isolated  # the SFT update's compile: see tests/conftest.py
def test_stages_run_in_order_and_a_stopped_warm_start_resumes(tmp_path, monkeypatch, capsys):
  """A straight run trains stage 1 then stage 2. A run stopped during stage 2 keeps
  stage 1's cache; the next run resumes at stage 2 (it does not train stage 1
  again) and ends with the same params as the straight run; a third run is cached."""
  c, tr = _two_stages(tmp_path)
  state = tr.init_state()
  init = state.params
  calls = []
  real = sft.train_sft

  def spy(config, ctx, params, rng, **kw):
    calls.append((kw["stage"], config.sft.steps, config.sft.fap_fraction))
    if kw["stage"] == 1 and stop["now"]:
      raise KeyboardInterrupt("stopped during stage 2")
    return real(config, ctx, params, rng, **kw)

  stop = {"now": False}
  monkeypatch.setattr(sft, "train_sft", spy)
  straight, cached = sft.warm_start(c, tr.ctx, state, cache_dir=str(tmp_path / "straight"))
  assert not cached and calls == [(0, 3, 0.0), (1, 3, 0.75)]  # in order, each its own fields
  calls.clear()
  stop["now"] = True
  with pytest.raises(KeyboardInterrupt):
    sft.warm_start(c, tr.ctx, state, cache_dir=str(tmp_path / "stopped"))
  assert calls == [(0, 3, 0.0), (1, 3, 0.75)]
  assert os.path.exists(tmp_path / "stopped" / "stages" / "0" / "params")
  assert not os.path.exists(tmp_path / "stopped" / "params")
  calls.clear()
  stop["now"] = False
  capsys.readouterr()
  resumed, cached = sft.warm_start(c, tr.ctx, state, cache_dir=str(tmp_path / "stopped"))
  assert not cached and calls == [(1, 3, 0.75)]  # stage 1 was not trained again
  assert "resuming at stage 2 (fixes)" in capsys.readouterr().out
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))  # stage 2 did train
             for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(init)))
  calls.clear()
  _, cached = sft.warm_start(c, tr.ctx, state, cache_dir=str(tmp_path / "stopped"))
  assert cached and calls == []
  # a changed second stage: stage 1's cache is still good, the final one refuses
  c.sft.stages = (c.sft.stages[0], dict(c.sft.stages[1], steps=4))
  c.sft.steps = 7
  with pytest.raises(ValueError, match=r"(?s)different config.*sft\.stages: cached"):
    sft.warm_start(c, tr.ctx, state, cache_dir=str(tmp_path / "stopped"))
  tr.close()


@pytest.mark.isolated  # the SFT update's compile: see tests/conftest.py
def test_a_cache_without_its_fingerprint_is_retrained_saying_so(tmp_path, capsys):
  """Issue 23 item 4: the fingerprint is written before the params; params whose
  sft_config.json was deleted are not reused silently: they are moved aside and
  the warm start is retrained, and the run says so."""
  c, tr = _setup(tmp_path, **{"sft.steps": 2, "sft.warmup_steps": 1})
  state = tr.init_state()
  cache = tmp_path / "sft"
  first, cached = sft.warm_start(c, tr.ctx, state, cache_dir=str(cache))
  assert not cached and (cache / "sft_config.json").exists()
  os.remove(cache / "sft_config.json")
  capsys.readouterr()
  again, cached = sft.warm_start(c, tr.ctx, state, cache_dir=str(cache))
  out = capsys.readouterr().out
  assert not cached and "has no fingerprint" in out and "RETRAINING" in out
  assert (cache / "sft_config.json").exists()
  assert [p for p in os.listdir(cache) if p.startswith("params.unverified-")]  # kept aside
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):  # the same recipe again
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, cached = sft.warm_start(c, tr.ctx, state, cache_dir=str(cache))
  assert cached
  tr.close()


def test_sft_over_long_prompt_names_file_and_line(tmp_path):
  """The SFT path's over-long prompt error names the record's file:line and id, as
  the RL rollout's does (fbos_jax/rl/rollout.py:prompt_ids)."""
  import json
  path = tmp_path / "train.jsonl"
  rows = [{"id": f"r{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "arithmetic"}
          for i in range(20)]
  rows[2]["prompt"] = "1+" + "1" * 700 + "="  # line 3
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  c, tr = _setup(tmp_path, **{"data.source": "jsonl", "data.path": str(path),
                              "data.verifier": "procedural", "data.shuffle": False,
                              "data.eval_fraction": 0.0, "train.eval_prompts": 0,
                              "sft.steps": 1})
  from fbos_jax import buckets
  with pytest.raises(buckets.BucketError, match=r"train\.jsonl:3 \(id 'r2'\)"):
    state = tr.init_state()
    sft.train_sft(c, tr.ctx, state.params, state.rng, progress=False)
  tr.close()
