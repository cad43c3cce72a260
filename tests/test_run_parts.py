"""The run's parts are built once (issue 21): typed configs, one shape model, PRNG
streams from the state, params-only restore, shared programs, and the code rules
that keep it so (no long functions, no ConfigDict reads below rl/config.py)."""

import ast
import os

import jax
import numpy as np
import pytest

import configs
from fbos_jax import checkpoint as ckpt_lib
from fbos_jax import sampling
from fbos_jax import sharding as sh
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import rollout as R
from fbos_jax.rl import shapes
from fbos_jax.rl import state as state_lib
from fbos_jax.rl import update as update_lib
from fbos_jax.rl.state import restore_params
from fbos_jax.rl.trainer import RLTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- typed parts


def test_parts_are_typed_hashable_and_complete():
  c = configs.load("configs/fbos.py:tiny")
  parts = config_lib.build_parts(c, pad_id=0, eos_id=1, vocab_limit=102)
  hash(parts)  # frozen all the way down: a key of compiled programs
  sp = parts.sampling
  assert sp.round1.prompt_buckets == (16, 32) and sp.round2.prompt_buckets[-1] == 656
  assert sp.eval.is_greedy and not sp.round1.is_greedy and sp.eval_sampled.temperature == 1.0
  assert sp.round1.stop_token_ids[0] == 1 and sp.round1.vocab_limit == 102
  assert parts.update.loss.vocab_limit == 102  # the trainer's log-probs: the same ids
  assert parts.rollout.round2 and parts.rollout.batch_names == ("epa", "ecc")
  assert parts.optim.total_steps == c.train.steps


@pytest.mark.parametrize("field", ["sampling.decode_phase", "rl.epa_selct"])
def test_unknown_sampling_or_rollout_field_fails_at_build(field):
  """A field no part reads (a typo in a config file) is refused, named."""
  c = configs.load("configs/fbos.py:tiny")
  section, name = field.split(".")
  with c.unlocked():
    c[section][name] = 3
  with pytest.raises(ValueError, match=rf"unknown config field\(s\) {field}"):
    config_lib.build_parts(c)


# ---------------------------------------------------------------- one shape model


def test_the_step_pads_to_the_shape_model(tmp_path, small, one_device_mesh, monkeypatch):
  """The rollout's padded batches and the sampler programs it runs are the
  shapes the compiled plan compiles (fbos_jax/rl/shapes.py)."""
  c = small("configs/fbos.py:tiny", **{"rl.fixed_row_buckets": True})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh, log_metrics=False)
  state = tr.init_state()
  calls, real = [], sampling.get_generate_fn

  def recording(cfg, scfg, *, batch, prompt_len, n_per_prompt=1, **kw):
    calls.append((batch, prompt_len, n_per_prompt))
    return real(cfg, scfg, batch=batch, prompt_len=prompt_len, n_per_prompt=n_per_prompt, **kw)

  monkeypatch.setattr(sampling.static, "get_generate_fn", recording)  # sample() looks it up there
  batches = R.rollout_step(tr.ctx, state.params, next(tr.train_iter),
                           state_lib.stream_key(state.rng, "sample", 0)).batches
  want = shapes.update_shapes(tr.parts, batch_shards=1)
  assert set(batches) == set(want) == {"epa", "ecc"}
  for name, b in batches.items():
    assert b.num_rows == want[name].rows, name
    assert b.prompt_len <= want[name].prompt_len and b.response_len == want[name].response_len
  largest = shapes.sampler_shapes(tr.parts, batch_shards=1)
  assert len(calls) == 2  # round 1 and round 2
  for batch, prompt_len, n in calls:
    assert any(batch <= s.prompts and prompt_len <= s.prompt_len and n == s.n
               for s in largest.values()), (batch, prompt_len, n)
  tr.close()


def test_call_buckets_are_the_samplers_chunks():
  assert sampling.call_buckets(5, (4, 8)) == [8]
  assert sampling.call_buckets(20, (4, 8)) == [8, 8, 4]
  assert sampling.call_buckets(3, (4, 8), shards=8) == [8]  # a multiple of the shards


# ---------------------------------------------------------------- randomness


def test_streams_are_distinct_and_named():
  rng = state_lib.root_rng(0)
  keys = {name: np.asarray(jax.random.key_data(state_lib.stream_key(rng, name, 3)))
          for name in state_lib.STREAMS}
  assert len({k.tobytes() for k in keys.values()}) == len(keys)
  with pytest.raises(ValueError, match="unknown PRNG stream 'noise'"):
    state_lib.stream_key(rng, "noise")


def test_no_randomness_outside_the_state_streams():
  """Below rl/, a PRNG key or a host generator comes from TrainState.rng's
  streams (or a rollout's own key): no seed arithmetic on config.seed, no
  fixed keys."""
  bad = []
  for f in sorted(os.listdir(os.path.join(ROOT, "fbos_jax", "rl"))):
    if not f.endswith(".py"):
      continue
    src = open(os.path.join(ROOT, "fbos_jax", "rl", f)).read()
    for pattern in ("jax.random.key(", "PRNGKey(", "config.seed +", "seed + ", "10_000 + step"):
      if pattern in src and not (f == "state.py" and pattern == "jax.random.key("):
        bad.append((f, pattern))
  assert not bad, bad


# ---------------------------------------------------------------- restore


def test_params_only_restore_and_the_layout_check(tmp_path, small, one_device_mesh):
  """Eval/export read only the params (a changed rl.kl_beta, which adds the KL
  reference to the state, does not matter to them); a model change names the field and both values; a resume whose state
  layout changed names the layout field and both values."""
  c = small("configs/grpo.py:tiny,decoupled")
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh)
  state, _ = tr.train()
  tr.close()
  stale = small("configs/grpo.py:tiny,decoupled", **{"rl.kl_beta": 0.1})
  params, step = restore_params(stale, str(tmp_path), mesh=one_device_mesh)
  assert step == 2
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  bigger = small("configs/grpo.py:tiny,decoupled", **{"model.num_layers": 2})
  with pytest.raises(ckpt_lib.CheckpointMismatchError,
                     match=r"model\.num_layers: checkpoint=1 config=2"):
    restore_params(bigger, str(tmp_path), mesh=one_device_mesh)
  tr = RLTrainer(stale, str(tmp_path), mesh=one_device_mesh)
  with pytest.raises(ckpt_lib.CheckpointMismatchError,
                     match=r"rl\.kl_beta > 0: checkpoint=False config=True"):
    tr.maybe_restore(tr.init_state())
  tr.close()


def test_the_state_layout_is_what_the_state_holds(one_device_mesh):
  """StateLayout.of(parts) is the one home of the TrainState's optional parts:
  the KL reference with rl.kl_beta > 0, the GFPO history with rl.gfpo_adaptive,
  the optimizer's clip state with optim.grad_clip > 0; abstract_state holds
  exactly those, and runs of one layout share it (a hashable program key)."""
  def parts(spec, **fields):
    c = configs.load(spec)
    with c.unlocked():
      for k, v in fields.items():
        *section, name = k.split(".")
        (c[section[0]] if section else c)[name] = v
    return config_lib.build_parts(c, pad_id=0, eos_id=1)

  rules = sh.DEFAULT_RULES
  bare = parts("configs/grpo.py:tiny", **{"rl.kl_beta": 0.0, "optim.grad_clip": 0.0})
  full = parts("configs/gfpo.py:tiny,adaptive", **{"rl.kl_beta": 0.1, "rl.gfpo_history": 32,
                                                   "optim.grad_clip": 1.0})
  lb, lf = state_lib.StateLayout.of(bare), state_lib.StateLayout.of(full)
  assert (lb.kl_reference, lb.gfpo_history, lf.kl_reference, lf.gfpo_history) == (
      False, 0, True, 32)
  sb = state_lib.abstract_state(bare, one_device_mesh, rules)
  sf = state_lib.abstract_state(full, one_device_mesh, rules)
  assert sb.ref_params is None and sb.gfpo is None
  assert jax.tree.structure(sf.ref_params) == jax.tree.structure(sf.params)
  assert jax.tree.leaves(sf.gfpo)[0].shape[0] == 32
  assert (len(sb.opt_state), len(sf.opt_state)) == (1, 2)  # optax.chain: [the clip,] adamw
  assert state_lib.abstract_state(lf, one_device_mesh, rules) == sf  # parts or their layout
  other_seed = parts("configs/grpo.py:tiny", seed=7, **{"rl.kl_beta": 0.0,
                                                       "optim.grad_clip": 0.0})
  assert state_lib.StateLayout.of(other_seed) == lb and hash(lb) == hash(
      state_lib.StateLayout.of(other_seed))


# ---------------------------------------------------------------- shared programs


def test_trainers_with_the_same_shapes_share_the_update_program(tmp_path, small,
                                                                one_device_mesh):
  a = RLTrainer(small("configs/grpo.py:tiny"), str(tmp_path / "a"), mesh=one_device_mesh)
  b = RLTrainer(small("configs/grpo.py:tiny", seed=7), str(tmp_path / "b"),
                mesh=one_device_mesh)
  fa = update_lib.compiled_update(a.parts, a.mesh, a.rules)
  assert fa is update_lib.compiled_update(b.parts, b.mesh, b.rules)
  c = RLTrainer(small("configs/grpo.py:tiny", **{"rl.micro_batches": 2}), str(tmp_path / "c"),
                mesh=one_device_mesh)
  assert update_lib.compiled_update(c.parts, c.mesh, c.rules) is not fa
  for t in (a, b, c):
    t.close()


# ---------------------------------------------------------------- the rules that keep it so


def _functions(path):
  tree = ast.parse(open(path).read(), path)
  return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_in_the_library_is_over_80_lines():
  long = []
  for dp, _, fs in os.walk(os.path.join(ROOT, "fbos_jax")):
    for f in fs:
      if f.endswith(".py"):
        path = os.path.join(dp, f)
        long += [(os.path.relpath(path, ROOT), n.name, n.end_lineno - n.lineno + 1)
                 for n in _functions(path) if n.end_lineno - n.lineno + 1 > 80]
  assert not long, long


def test_config_sampling_and_rl_are_read_only_in_rl_config():
  """Below rl/config.py nothing reads ``<config>.sampling`` or ``<config>.rl``
  (code, not docstrings): the typed parts are handed down."""
  reads = []
  for sub in ("fbos_jax", "launch"):
    for dp, _, fs in os.walk(os.path.join(ROOT, sub)):
      for f in fs:
        path = os.path.join(dp, f)
        if not f.endswith(".py") or path.endswith(os.path.join("rl", "config.py")):
          continue
        for n in ast.walk(ast.parse(open(path).read(), path)):
          if (isinstance(n, ast.Attribute) and n.attr in ("sampling", "rl")
              and isinstance(n.value, ast.Name) and n.value.id in ("config", "cfg")):
            reads.append((os.path.relpath(path, ROOT), n.lineno, n.attr))
  assert not reads, reads


def test_nothing_edits_sys_path():
  """The project is installed (requirements.txt: -e .): no module puts the
  repository on sys.path (the sandbox's child program aside)."""
  edits = []
  for sub in ("fbos_jax", "launch", "tests", "configs"):
    for dp, _, fs in os.walk(os.path.join(ROOT, sub)):
      for f in fs:
        path = os.path.join(dp, f)
        if (f.endswith(".py") and not path.endswith(os.path.join("verifiers", "sandbox.py"))
            and f != "test_run_parts.py"):
          src = open(path).read()
          if "sys.path.insert" in src or "sys.path.append" in src:
            edits.append(os.path.relpath(path, ROOT))
  assert not edits, edits
