"""fp32 master weights (issue 29): the trained params keep every small update, the
samplers read a compute-dtype copy, and a master too coarse for the learning rate
is refused at build and seen in ``update/param_change_frac``."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from fbos_jax.model import hf
from fbos_jax.model import qwen
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import export as export_lib
from fbos_jax.rl import guards
from fbos_jax.rl import state as state_lib
from fbos_jax.rl import update as update_lib
from fbos_jax.rl.context import RolloutContext

BIG = "configs/fbos.py:qwen_8b"


def _dtype_fields(spec: str) -> dict:
  """Every ``model.*dtype*`` and ``optim.*dtype*`` field of ``spec``."""
  c = configs.load(spec)
  return {f"{sec}.{k}": v for sec in ("model", "optim") for k, v in c[sec].items()
          if "dtype" in k}


def _with_big_dtypes(small, lr=1e-6, **over):
  """The shrunk tiny FBOS config with the dtypes of ``qwen_8b``, at ``lr``, constant
  (``qwen_8b``'s schedule) without warm-up (whose first step has lr 0)."""
  fields = dict(_dtype_fields(BIG), **{"optim.learning_rate": lr, "optim.warmup_steps": 0,
                                        "optim.schedule": configs.load(BIG).optim.schedule,
                                        # rewards with a spread, so the untrained model's
                                        # groups have advantages and gradients
                                        "data.verifier": "fbos_jax.testing.small:length_reward"})
  fields.update(over)
  return small("configs/fbos.py:tiny", **fields)


def _batch(n: int, seed: int, vocab: int, p_len: int = 6, r_len: int = 8):
  """n rows of random ids over the whole vocabulary, with random advantages."""
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(3, vocab, size=p_len)) for _ in range(n)]
  toks = rng.integers(3, vocab, size=(n, r_len)).astype(np.int32)
  mask = np.ones((n, r_len), np.int32)
  adv = rng.normal(size=n).astype(np.float32)
  old = np.full((n, r_len), -np.log(vocab), np.float32)
  return batch_lib.make_policy_batch(prompts, toks, mask, adv, old, np.zeros(n, bool),
                                     prompt_len=p_len, num_rows=n)


def _one_update(config, mesh):
  """(fraction of param elements the update changed, host-computed; the logged
  metric) of one RL update of ``config``'s fresh state on random batches."""
  parts = config_lib.build_parts(config)
  rules = dict(config.mesh.rules)
  state = state_lib.init_state(parts, mesh, rules)
  before = [np.asarray(a) for a in jax.tree.leaves(state.params)]  # the update donates
  batches = {name: _batch(8, k, parts.model.vocab_size)
             for k, name in enumerate(parts.update.batch_names)}
  with jax.set_mesh(mesh):
    new, m = update_lib.compiled_update(parts, mesh, rules)(state, batches)
  after = [np.asarray(a) for a in jax.tree.leaves(new.params)]
  changed = sum(int(np.sum(a != b)) for a, b in zip(before, after))
  frac = changed / sum(a.size for a in before)
  return frac, new, m


def test_qwen_8b_dtypes_keep_the_updates_at_lr_1e6(small, one_device_mesh):
  """The large configs' dtypes (master, compute, Adam) at their learning rate 1e-6:
  one update changes almost every element of the params. A bfloat16 master (the
  large configs before issue 29) kept about 2% of them."""
  c = _with_big_dtypes(small)
  frac, new, m = _one_update(c, one_device_mesh)
  assert frac >= 0.9, (frac, _dtype_fields(BIG))
  assert {a.dtype for a in jax.tree.leaves(new.params)} == {jnp.dtype("float32")}
  assert float(m.param_change_frac) == pytest.approx(frac, abs=1e-6)


def test_param_change_frac_sees_a_bf16_master(small, one_device_mesh):
  """The metric counts what a step changed: a bfloat16 master (allowed explicitly)
  at lr 1e-6 keeps most params as they were, and the metric says so."""
  c = _with_big_dtypes(small, **{"model.param_dtype": "bfloat16",
                                 "optim.allow_low_precision_params": True})
  frac, _, m = _one_update(c, one_device_mesh)
  assert frac < 0.1, frac
  assert float(m.param_change_frac) == pytest.approx(frac, abs=1e-6)


def test_every_variant_trains_a_float32_master():
  for variant in configs.base.VARIANTS:
    c = configs.load(f"configs/fbos.py:{variant}")
    assert (c.model.param_dtype, c.optim.opt_state_dtype) == ("float32", "float32"), variant
    config_lib.validate(c, process_count=1)
  assert configs.load(BIG).model.compute_dtype == "bfloat16"


def test_bf16_master_is_refused_at_build_naming_dtype_and_lr(small):
  c = small("configs/fbos.py:tiny", **{"model.param_dtype": "bfloat16",
                                        "optim.learning_rate": 1e-6})
  with pytest.raises(ValueError, match=r"model\.param_dtype=bfloat16.*"
                     r"optim\.learning_rate=1e-06.*allow_low_precision_params"):
    config_lib.validate(c, process_count=1)
  c.optim.allow_low_precision_params = True
  config_lib.validate(c, process_count=1)


def test_param_change_watch_warns_after_five_low_steps(caplog):
  w = guards.ParamChangeWatch("bfloat16", 1e-6)
  with caplog.at_level(logging.WARNING):
    fired = [w.check({"update/param_change_frac": f}, s)
             for s, f in enumerate([0.02, 0.02, 0.9, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02], 1)]
  assert fired == [False] * 7 + [True, False]  # the 5th low step in a row, once
  assert "model.param_dtype=bfloat16" in caplog.text and "learning_rate=1e-06" in caplog.text
  assert not guards.ParamChangeWatch("float32", 1e-6).check({"update/param_change_frac": 0.99}, 1)


def test_compute_copy_once_per_version_and_the_sampler_refuses_the_master(small,
                                                                        one_device_mesh):
  c = _with_big_dtypes(small)
  parts = config_lib.build_parts(c)
  rules = dict(c.mesh.rules)
  master = state_lib.init_state(parts, one_device_mesh, rules).params
  policy = state_lib.ComputeCopy(parts.model)
  p1 = policy(master)
  assert policy(master) is p1 and policy.copies == 1  # one copy per version
  assert {a.dtype for a in jax.tree.leaves(p1)} == {jnp.dtype("bfloat16")}
  for a, b in zip(jax.tree.leaves(master), jax.tree.leaves(p1)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))
  newer = jax.tree.map(lambda a: a + 1e-3, master)
  assert policy(newer) is not p1 and policy.copies == 2
  # the abstract copy a plan compiles against has the same dtypes and shardings
  abstract = state_lib.compute_abstract(
      state_lib.abstract_state(parts, one_device_mesh, rules).params, parts.model)
  assert [(a.dtype, a.sharding) for a in jax.tree.leaves(abstract)] == [
      (b.dtype, b.sharding) for b in jax.tree.leaves(p1)]
  ctx = RolloutContext(parts, tokenizer=None, prompt_builder=None, pool=None,
                       mesh=one_device_mesh, rules=rules)
  with pytest.raises(TypeError, match=r"float32 .*model\.param_dtype=float32.*"
                     r"model\.compute_dtype=bfloat16.*ComputeCopy"):
    ctx.sample(master, [[5, 6, 7]], 1, jax.random.key(0), parts.sampling.round1)


def test_import_fills_the_f32_master_and_export_writes_the_source_dtype(small, tmp_path):
  """A bfloat16 checkpoint loads into the float32 master exactly; the export's
  dtype is the source's (bfloat16 by default), so an untrained master exports
  bit for bit."""
  c = _with_big_dtypes(small)
  cfg16 = qwen.ModelConfig.from_dict(dict(c.model, param_dtype="bfloat16"))
  src = tmp_path / "src"
  hf.save_hf_checkpoint(qwen.init_params(cfg16, jax.random.key(1)), cfg16, src,
                        dtype="bfloat16")
  assert hf.checkpoint_dtype(src) == "bfloat16"
  master, _ = hf.load_hf_params(src, qwen.ModelConfig.from_dict(c.model))
  assert {a.dtype for a in jax.tree.leaves(master)} == {jnp.dtype("float32")}
  assert export_lib.export_dtype(c, "", str(src)) == "bfloat16"
  assert export_lib.export_dtype(c) == export_lib.DEFAULT_EXPORT_DTYPE == "bfloat16"
  assert export_lib.export_dtype(c, "float32", str(src)) == "float32"
  out = tmp_path / "out"
  hf.save_hf_checkpoint(master, qwen.ModelConfig.from_dict(c.model), out,
                        dtype=export_lib.export_dtype(c, "", str(src)))
  from safetensors.numpy import load_file
  a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_tiny_run_with_the_large_dtypes_logs_param_change_frac(small, one_device_mesh, tmp_path):
  """Two RL steps of the tiny run with qwen_8b's dtypes at lr 1e-6: every step
  logs update/param_change_frac >= 0.9, and the samplers read one bfloat16 copy
  per policy version."""
  from fbos_jax.rl.trainer import RLTrainer
  c = _with_big_dtypes(small, **{"train.checkpoint_every": 0})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh, log_metrics=False)
  try:
    state, history = tr.train(tr.init_state())
  finally:
    tr.close()
  fracs = [r["update/param_change_frac"] for r in history]
  assert len(fracs) == 2 and min(fracs) >= 0.9, fracs
  assert tr.policy.copies == 2 and tr.param_watch.warnings == 0


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_plan_samplers_take_the_compute_copy_with_the_state_held_beside(small, one_device_mesh,
                                                                        engine):
  """The plan compiles the samplers against the bfloat16 copy, and counts the train
  state (the float32 master and Adam's moments) as held in HBM beside them."""
  from fbos_jax.planning import programs as plan_lib
  c = _with_big_dtypes(small, **{"sampling.engine": engine})
  parts = plan_lib.plan_parts(c)
  rules = dict(c.mesh.rules)
  state = state_lib.abstract_state(parts, one_device_mesh, rules)
  master = {(tuple(a.shape), a.dtype) for a in jax.tree.leaves(state.params)}
  progs = plan_lib.step_programs(parts, one_device_mesh, rules)
  samplers = [p for p in progs if p.name != "update"]
  assert samplers and all(p.fn is not None for p in samplers)
  for p in samplers:
    args = {(tuple(a.shape), a.dtype) for a in jax.tree.leaves(p.args)}
    assert not args & master, p.name  # no float32 master leaf among its arguments
    assert p.resident == plan_lib.device_bytes(state) > 0, p.name
  assert [p.resident for p in progs if p.name == "update"] == [0]
