"""AReaL's system (issues 25, 31): the one loop over its rollout sources, its config
and bad input, the device split, versions per token under in-flight weight
updates, the weight sync, and resume after kill -9 (the multi-process split:
tests/test_async_processes.py)."""

import os

import jax
import numpy as np
import pytest

import configs
from fbos_jax import metrics as metrics_lib
from fbos_jax import sharding as sh
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import sources
from fbos_jax.rl import split as split_lib
from fbos_jax.rl.trainer import RLTrainer

DROP = ("time/", "tokens/per_s", "async/", "staleness/")


def _drop(row):
  return {k: v for k, v in row.items() if not k.startswith(DROP)}


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_eta0_split_equals_the_synchronous_loop(tmp_path, small):
  """rl.max_staleness=0 on a 4 / 4 split: the worker thread, the buffer, the
  admission rule and the weight sync give the synchronous loop's params and
  metrics bit for bit (the synchronous run on a mesh of the trainer's shape)."""
  spec = "configs/fbos.py:tiny"
  over = {"train.steps": 3, "data.verifier": "fbos_jax.testing.small:parity_reward"}
  c = small(spec, **over)
  tr = RLTrainer(c, str(tmp_path / "sync"), mesh=sh.make_mesh(c.mesh, jax.devices()[4:8]))
  assert isinstance(tr.source, sources.InlineSource)
  s_sync, _ = tr.train()
  tr.close()
  tr = RLTrainer(small(spec, **over, **{"rl.rollout_devices": 4}), str(tmp_path / "async"))
  assert isinstance(tr.source, sources.ThreadSource)
  s_async, hist = tr.train()
  tr.close()
  for x, y in zip(jax.tree.leaves(jax.device_get(s_sync)), jax.tree.leaves(jax.device_get(s_async))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ra, rb = (metrics_lib.read_jsonl(os.path.join(tmp_path, d, "metrics.jsonl"))
            for d in ("sync", "async"))
  assert [_drop(r) for r in ra] == [_drop(r) for r in rb]
  assert all(r["staleness/max"] == 0 and r["staleness/hist_0"] > 0 for r in ra + rb)
  assert {"async/rollout_busy", "async/trainer_busy", "async/sync_s",
          "async/buffer_depth"} <= set(rb[-1])
  steps = metrics_lib.read_jsonl(os.path.join(tmp_path, "async", "steps.jsonl"))
  assert [(r["step"], r["batch"], r["admit_version"]) for r in steps] == [(1, 0, 0), (2, 1, 1),
                                                                           (3, 2, 2)]


def test_the_weight_sync_sends_the_compute_copy(tmp_path, small):
  """A float32 master with model.compute_dtype=bfloat16 on a 4 / 4 split: what the
  rollout samples with, and what every sync moves, is the bfloat16 compute copy
  (half the master's bytes), made once per policy version."""
  import jax.numpy as jnp
  c = small("configs/fbos.py:tiny", **{"train.steps": 2, "rl.rollout_devices": 4,
                                       "rl.max_staleness": 1, "model.compute_dtype": "bfloat16",
                                       "data.verifier": "fbos_jax.testing.small:parity_reward"})
  tr = RLTrainer(c, str(tmp_path))
  published = []
  state, _ = tr.train(on_step=lambda s, st, m: published.append(
      {jnp.dtype(x.dtype).name for x in jax.tree.leaves(tr.source.store.current()[0])}))
  tr.close()
  master = jax.tree.leaves(jax.device_get(state.params))
  assert {np.asarray(x).dtype.name for x in master} == {"float32"}
  assert published == [{"bfloat16"}] * 2
  rows = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  half = sum(np.asarray(x).nbytes for x in master) // 2
  assert [r["async/sync_bytes"] for r in rows] == [4 * half] * 2  # on the 4 rollout devices
  assert tr.policy.copies == 3  # versions 0 (start), 1 and 2


@pytest.mark.parametrize("eta", [1, 2])
def test_split_4_4_runs_with_bounded_staleness(tmp_path, small, eta):
  """8 fake devices split 4 / 4, eta = 1 and 2: every trained token is at most eta
  updates old, some are stale (the sides overlapped), both sides report their busy
  fractions, and each sync moved the params device to device."""
  c = small("configs/fbos.py:tiny", **{"train.steps": 4, "rl.rollout_devices": 4,
                                       "rl.max_staleness": eta,
                                       "data.verifier": "fbos_jax.testing.small:parity_reward"})
  tr = RLTrainer(c, str(tmp_path))
  assert tr.mesh.size == 4 and tr.source.rollout_mesh.size == 4
  assert not set(tr.mesh.devices.flat) & set(tr.source.rollout_mesh.devices.flat)
  state, hist = tr.train()
  tr.close()
  assert int(state.step) == 4
  rows = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert max(r["staleness/max"] for r in rows) <= eta
  assert sum(r[f"staleness/hist_{d}"] for r in rows for d in range(1, eta + 1)) > 0
  assert rows[0]["staleness/max"] == 0  # batch 0 is sampled by version 0, trained at 0
  nparams = sum(np.asarray(x).nbytes for x in jax.tree.leaves(jax.device_get(state.params)))
  for i, r in enumerate(rows):
    assert 0 < r["async/trainer_busy"] <= 1 and 0 <= r["async/rollout_busy"] <= 1
    if i < len(rows) - eta:  # the worker samples batch i + eta while step i trains
      assert r["async/rollout_busy"] > 0
    assert r["async/sync_bytes"] == 4 * nparams  # the tiny model's params, on 4 devices
    assert r["async/sync_s"] > 0 and r["async/buffer_depth"] >= 0


# ---------------------------------------------------------------- versions per token


def _tiny_model(seed):
  from fbos_jax.model import qwen
  import jax.numpy as jnp
  cfg = qwen.ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64,
                         intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, rope_theta=10000.0)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(
      lambda s: jnp.asarray(1.0 + 0.2 * rng.standard_normal(s[0]) if len(s[0]) < 3 and
                            s[1][-1] == "norm" else 0.12 * rng.standard_normal(s[0]), jnp.float32),
      qwen.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple))
  return params, cfg


class _Source:
  """Version 0 for the engine's first loop iterations, then version 1."""

  def __init__(self, versions, kv_mode, swap_after=2):
    self.versions, self.kv_mode, self.swap_after = versions, kv_mode, swap_after
    self.calls = 0

  def current(self):
    self.calls += 1
    v = 0 if self.calls <= self.swap_after else 1
    return self.versions[v], v


def _sample_with_swap(mode):
  from fbos_jax import engine as E
  from fbos_jax import sampling
  (pa, cfg), (pb, _) = _tiny_model(0), _tiny_model(1)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (9, 1, 4, 5, 12, 3)]
  ecfg = E.EngineConfig(slots=4, page_size=4, window=4, prefill_chunk=4, row_buckets=(4,),
                        page_buckets=(6,), prefill_buckets=(4,))
  src = _Source((pa, pb), mode)
  stats = E.EngineStats()
  kw = dict(max_new_tokens=12, prompt_buckets=(12,), batch_buckets=(8,), temperature=0.8)
  out = E.sample(src, cfg, prompts, key=jax.random.PRNGKey(5), n_per_prompt=2,
                 engine_config=ecfg, stats=stats, **kw)
  versions = out.versions
  fn = jax.jit(sampling.teacher_forced_logprobs, static_argnums=1,
               static_argnames="temperature")
  tf = [np.asarray(fn(p, cfg, out.prompt_tokens, out.prompt_mask, out.tokens,
                      out.response_mask, temperature=0.8)) for p in (pa, pb)]
  return out, versions, tf, stats


def test_version_labels_under_an_inflight_update_recompute():
  """A weight update lands between decode windows while rows are in flight; with
  ``recompute`` each row's KV is redone under the new weights, and every token is
  labelled with the version that drew it: its log-prob is the teacher-forced
  log-prob under the params of its label, so a wrong label (the version at
  admission, or one read after the window as in AReaL's PR #1569) fails."""
  out, versions, (tf0, tf1), stats = _sample_with_swap("recompute")
  m = out.response_mask.astype(bool)
  assert (versions[m] >= 0).all() and (versions[~m] == -1).all()
  assert stats.swaps == 1 and stats.recomputed_tokens > 0
  spans = [(versions[r][m[r]] == 0).any() and (versions[r][m[r]] == 1).any()
           for r in range(out.num_rows)]
  assert sum(spans) >= 2, "some rows must run under both versions"
  assert all((np.diff(versions[r][m[r]]) >= 0).all() for r in range(out.num_rows))
  v0, v1 = m & (versions == 0), m & (versions == 1)
  np.testing.assert_allclose(out.logprobs[v0], tf0[v0], atol=1e-4)
  np.testing.assert_allclose(out.logprobs[v1], tf1[v1], atol=1e-4)
  # the labels decide: version 0 does not explain the version-1 tokens
  assert np.abs(out.logprobs[v1] - tf0[v1]).max() > 1e-2
  admitted = np.where(m, versions[:, :1], -1)  # every token labelled like its first one
  wrong = m & (admitted != versions)
  assert wrong.any() and np.abs(out.logprobs - np.where(admitted == 0, tf0, tf1))[wrong].max() > 1e-2


def test_keep_kv_labels_each_row_with_the_oldest_version_of_its_kv():
  """``keep_kv``: a row in flight goes on under version 1 with the KV version 0
  wrote, so its tokens are not version 1's (nor version 0's) and every token is
  labelled with its row's oldest version (the eta check reads the true lag): the
  labels are constant per row, the rows admitted before the swap are labelled 0
  although part of their tokens were drawn by version 1's weights."""
  out, versions, (tf0, tf1), stats = _sample_with_swap("keep_kv")
  rec, rversions, _, _ = _sample_with_swap("recompute")
  m = out.response_mask.astype(bool)
  assert stats.swaps == 1 and stats.recomputed_tokens == 0
  assert (versions[m] >= 0).all() and (versions[~m] == -1).all()
  for r in range(out.num_rows):
    assert len(set(versions[r][m[r]].tolist())) == 1, "one label per row: its KV's oldest"
  drawn_by_1 = m & (rversions == 1) & (versions == 0)  # same schedule: where version 1 drew
  assert drawn_by_1.any(), "rows admitted under version 0 ran on under version 1"
  v0 = m & (versions == 0) & (rversions == 0)
  np.testing.assert_allclose(out.logprobs[v0], tf0[v0], atol=1e-4)
  assert np.abs(out.logprobs[drawn_by_1] - tf0[drawn_by_1]).max() > 1e-2


def test_rows_a_feed_admits_are_labelled_with_the_version_it_admitted_them_under():
  """The trainer publishes version 1 while the feed polls (the stream's staleness
  rule reads the store's version there): the rows that poll admits are labelled
  1, never the version the engine held before the poll (labelled 0, a row of
  batch k admitted under version k - eta would read eta + 1 updates old)."""
  from fbos_jax import engine as E
  from fbos_jax import sampling
  (pa, cfg), (pb, _) = _tiny_model(0), _tiny_model(1)
  store = sources.PolicyStore("keep_kv")
  store.publish(pa, 0)
  prompts = [[5, 6, 7], [8, 9]]

  class Publishing(E.ListFeed):
    def poll(self):
      if store.current()[1] == 0:
        store.publish(pb, 1)  # the update lands while the feed admits its requests
      return super().poll()

  feed = Publishing([E.Request(p, n=2, key=np.zeros(2, np.uint32), sid_base=2 * i, tag=i)
                     for i, p in enumerate(prompts)])
  rows = []
  E.run(store, cfg, feed, rows.append, max_new_tokens=4, prompt_buckets=(4,),
        batch_buckets=(4,), temperature=0.8,
        engine_config=E.EngineConfig(slots=4, page_size=4, window=4, row_buckets=(4,)))
  assert len(rows) == 4
  assert all((r.versions == 1).all() for r in rows), [r.versions.tolist() for r in rows]


def test_sampling_engine_auto_streams_when_the_rollout_samples_ahead():
  """sampling.engine=auto (the tiny config's): the continuous engine when eta > 0
  (the rollout streams the steps), the static sampler at eta = 0, split or not
  (bit for bit the synchronous run); rl.stream_rounds needs the engine, so auto
  refuses it only where it means static."""
  load = lambda **o: configs.load("configs/fbos.py:tiny", o)
  assert load().sampling.engine == "auto"
  for over in ({}, {"rl.rollout_devices": 4}):
    assert config_lib.build_parts(load(**over), eos_id=1).sampling.engine == "static"
  for over in ({"rl.max_staleness": 1}, {"rl.rollout_devices": 4, "rl.max_staleness": 2}):
    assert config_lib.build_parts(load(**over), eos_id=1).sampling.engine == "continuous"
  assert config_lib.resolve_engine("static", True) == "static"
  assert config_lib.resolve_engine("continuous", False) == "continuous"
  with pytest.raises(ValueError, match=r"sampling\.engine='static' \(sampling\.engine='auto' at "
                                       r"rl\.max_staleness=0\)"):
    config_lib.validate(load(**{"rl.stream_rounds": True}), 1, process_count=1)
  config_lib.validate(load(**{"rl.stream_rounds": True, "rl.max_staleness": 1}), 1,
                      process_count=1)
  with pytest.raises(ValueError, match=r"sampling\.engine='fast': expected one of static"):
    config_lib.build_parts(load(**{"sampling.engine": "fast"}), eos_id=1)


def test_the_decoupled_loss_reads_the_per_token_behaviour_logprobs():
  """Rows sampled across an in-flight update (versions 0 then 1): the batch's
  old_logp is pi_behav per token, the sampler's log-prob under the version that
  drew it, and the decoupled term weighs each token by pi_prox / pi_behav with
  it: the loss equals the kernel's on those per-token values, and differs from
  the loss with one version's log-probs for the whole row."""
  import fbos_kernels as K
  from fbos_jax.rl import objectives
  from fbos_jax.rl.batch import make_policy_batch
  from fbos_jax.rl.config import LossConfig
  out, versions, (tf0, tf1), _ = _sample_with_swap("recompute")
  m = out.response_mask.astype(bool)
  assert (m & (versions == 1)).any() and (m & (versions == 0)).any()
  (_, cfg), (pb, _) = _tiny_model(0), _tiny_model(1)
  prompts = [row[mask.astype(bool)].tolist() for row, mask in zip(out.prompt_tokens,
                                                                   out.prompt_mask)]
  adv = np.where(np.arange(out.num_rows) % 2, 1.0, -1.0).astype(np.float32)

  def batch(behav):
    return make_policy_batch(prompts, out.tokens, out.response_mask, adv, behav,
                             np.zeros(out.num_rows, bool), prompt_len=12, num_rows=out.num_rows)

  lc = LossConfig(temperature=0.8, behav_weight_cap=1e6)
  b = batch(out.logprobs)
  np.testing.assert_array_equal(np.asarray(b.old_logp)[m], out.logprobs[m])
  prox, _ = objectives.sequence_logprobs(pb, cfg, b, temperature=0.8, compute_entropy=False)
  got = objectives.term_sums(pb, cfg, b, "decoupled", lc, prox_logp=prox)["loss"]

  def manual(behav):
    loss, _ = K.decoupled_ppo_loss(prox, prox, behav, adv, behav_weight_cap=1e6,
                                   mask=b.loss_mask)
    return float(K.aggregate(loss, b.loss_mask, "token-mean")[0])

  assert float(got) == pytest.approx(manual(out.logprobs), rel=1e-5)
  row_version0 = np.where(m, tf0, 0.0).astype(np.float32)  # pi_behav as if all version 0
  assert abs(manual(row_version0) - float(got)) > 1e-3 * max(abs(float(got)), 1.0)


# ---------------------------------------------------------------- config, split, bad input


@pytest.mark.parametrize("field,value,match", [
    ("rl.max_staleness", -1, r"rl\.max_staleness=-1: must be an integer >= 0"),
    ("rl.buffer_groups", 3, r"rl\.buffer_groups=3 is smaller than one batch.*prompts_per_step=8"),
    ("rl.rollout_devices", -2, r"rl\.rollout_devices=-2: must be an integer >= 0"),
    ("rl.inflight_update", "pause", r"rl\.inflight_update='pause': expected one of keep_kv"),
    ("rl.sync_chunk_mib", 0, r"rl\.sync_chunk_mib=0: must be > 0"),
])
def test_bad_async_fields_are_refused_by_name(field, value, match):
  c = configs.load("configs/fbos.py:tiny", {field: value})
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c, 1, process_count=1)


def test_async_fields_become_a_typed_part():
  c = configs.load("configs/fbos.py:tiny", {"rl.rollout_devices": 4, "rl.max_staleness": 2,
                                            "rl.inflight_update": "recompute",
                                            "rl.sync_chunk_mib": 8})
  a = config_lib.build_parts(c, eos_id=1).asynchronous
  assert a == config_lib.AsyncConfig(4, 2, 0, "recompute", 8 * 2 ** 20) and a.enabled
  assert a.buffer_batches(8) == 3  # (eta + 1) batches by default
  assert not config_lib.build_parts(configs.load("configs/fbos.py:tiny")).asynchronous.enabled
  with pytest.raises(KeyError, match=r"rl\.staleness' does not exist"):  # one way: eta
    configs.load("configs/grpo.py:tiny,decoupled", {"rl.staleness": 1})


def test_admission_rule_is_areals():
  """floor((N_r - 1) / B) <= i + eta with N_r = (k + 1) B: batch k waits for
  version k - eta; eta = 0 is the synchronous loop."""
  for eta in (0, 1, 2):
    for k in range(6):
      for v in range(6):
        assert sources.admitted(k, v, 8, eta) == (k <= v + eta)
  # the rule on groups: the 17th group requested (N_r = 17, B = 8) needs i + eta >= 2
  assert ((17 - 1) // 8 <= 1 + 1) and not ((17 - 1) // 8 <= 0 + 1)


class _Dev:
  def __init__(self, i, proc):
    self.id, self.process_index = i, proc

  def __repr__(self):
    return f"d{self.id}"


def test_split_in_one_process_and_bad_splits():
  """One process: the rollout takes the first N devices. Splits that leave a side
  nothing, do not fit the mesh or cannot be synced shard by shard are refused,
  named, with the numbers."""
  one = [_Dev(i, 0) for i in range(8)]
  mesh = {"dcn": 1, "data": -1, "fsdp": 1, "tensor": 1}
  trainer, rollout = split_lib.split_devices(one, 4, mesh)
  assert [d.id for d in rollout] == [0, 1, 2, 3] and [d.id for d in trainer] == [4, 5, 6, 7]
  with pytest.raises(split_lib.AsyncConfigError, match=r"rl\.rollout_devices=8: .* 0 < N < 8"):
    split_lib.split_devices(one, 8, mesh)
  with pytest.raises(split_lib.AsyncConfigError, match=r"rl\.rollout_devices=2 leaves the "
                                                       r"rollout mesh 2 of 8 devices"):
    split_lib.split_devices(one, 2, {"dcn": 1, "data": -1, "fsdp": 1, "tensor": 4})
  with pytest.raises(split_lib.AsyncConfigError, match=r"rl\.rollout_devices=3: the weight "
                                                       r"sync .*rollout 3, trainer 5"):
    split_lib.split_devices(one, 3, mesh)


def test_split_over_processes_gives_each_side_whole_processes():
  """2 processes x 4 devices: rl.rollout_devices=4 makes process 0 the trainer and
  process 1 the rollout; a split that cuts a process in two, or eta > 0 without a
  split, is refused naming the fields and the counts."""
  devs = [_Dev(i, i // 4) for i in range(8)]
  c = configs.load("configs/fbos.py:tiny", {"rl.rollout_devices": 4, "rl.max_staleness": 1})
  trainer, rollout = split_lib.process_sides(c, devs)
  assert trainer.processes == (0,) and rollout.processes == (1,)
  c.rl.rollout_devices = 2
  with pytest.raises(split_lib.AsyncConfigError,
                     match=r"rl\.rollout_devices=2 with 2 processes of 4 devices: .* whole "
                           r"processes.* must be 4"):
    split_lib.process_sides(c, devs)
  c.rl.rollout_devices = 0
  with pytest.raises(split_lib.AsyncConfigError,
                     match=r"rl\.max_staleness=1 with 2 processes needs rl\.rollout_devices"):
    split_lib.process_sides(c, devs)
  c.rl.max_staleness = 0
  assert split_lib.process_sides(c, devs) is None  # the synchronous loop on every process
  assert split_lib.process_sides(c, devs[:4]) is None  # one process


def test_the_rollout_mesh_has_its_own_axes():
  """rl.rollout_mesh sets the rollout side's axes over mesh.* (0 = as mesh.*): 8
  devices split 4 / 4 with rollout tensor=2 give a rollout mesh of 2 data x 2
  tensor and a trainer mesh of 4 data; a split the rollout axes do not fit, an
  unknown axis and a bad size are refused by field."""
  c = configs.load("configs/fbos.py:tiny", {"rl.rollout_devices": 4, "rl.max_staleness": 1,
                                            "rl.rollout_mesh.tensor": 2})
  trainer, rollout, colocated = split_lib.build_meshes(c, jax.devices()[:8])
  assert not colocated
  assert dict(rollout.shape) == {"dcn": 1, "data": 2, "fsdp": 1, "tensor": 2}
  assert dict(trainer.shape) == {"dcn": 1, "data": 4, "fsdp": 1, "tensor": 1}
  assert c.mesh.tensor == 1  # the run's own mesh config is untouched
  c.rl.rollout_mesh.tensor = 3
  with pytest.raises(split_lib.AsyncConfigError, match=r"leaves the rollout mesh 4 of 8"):
    split_lib.build_meshes(c, jax.devices()[:8])
  c.rl.rollout_mesh.tensor = -2
  with pytest.raises(ValueError, match=r"rl\.rollout_mesh\.tensor=-2"):
    config_lib.build_parts(c, eos_id=1)
  c.rl.rollout_mesh = {"model": 2}
  with pytest.raises(ValueError, match=r"rl\.rollout_mesh\.model: not a mesh"):
    config_lib.async_config(c)


def test_a_split_without_room_for_the_params_is_refused_with_the_numbers():
  """qwen_8b on 32 v5p-sized devices (abstract meshes, FSDP only): 16 / 16 fits its
  params, optimizer state and gradients; 31 / 1 leaves the trainer 1 device that
  cannot: 8.19e9 params x (4 + 4 + 4 + 4) bytes (the float32 master, Adam's two
  float32 moments, float32 gradients) = 122.05 GiB."""
  from fbos_jax import sharding as sh
  c = configs.load("configs/fbos.py:qwen_8b", {"mesh.tensor": 1})
  parts = config_lib.build_parts(c, eos_id=1)
  rules = sh.rules_dict(c.mesh.rules)
  hbm = int(95.74 * 2 ** 30)
  need = split_lib.check_split_fits(parts, sh.make_abstract_mesh(c.mesh, 16),
                                   sh.make_abstract_mesh(c.mesh, 16), rules, hbm)
  assert need["trainer"] > need["rollout"] > 0
  with pytest.raises(split_lib.AsyncConfigError,
                     match=r"rl\.rollout_devices=31 leaves the trainer mesh 1 devices, each of "
                           r"which would need 122\.05 GiB .* more than 90% of its 95\.74 GiB"):
    split_lib.check_split_fits(parts, sh.make_abstract_mesh(c.mesh, 1),
                              sh.make_abstract_mesh(c.mesh, 31), rules, hbm)


# ---------------------------------------------------------------- kill -9 and resume


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_kill_between_checkpoints_loses_and_repeats_no_prompt(tmp_path, small):
  """eta = 2, 4 / 4 split, checkpoints at steps 2, 4, 6: SIGKILL after step 3 (the
  worker has pulled the prompts of batches 4 and 5 by then), restart: the
  restored run regenerates batches 2.. from the checkpoint's iterator state, so
  steps 1-6 train exactly the prompts of batches 0-5, each once."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root)
  cmd = [sys.executable, "-u", os.path.join(root, "tests", "async_kill_worker.py"),
         str(tmp_path)]
  first = subprocess.run(cmd + ["3"], env=env, cwd=root, capture_output=True, text=True,
                         timeout=500)
  assert first.returncode == -9, first.stdout[-2000:] + first.stderr[-3000:]
  second = subprocess.run(cmd + ["-1"], env=env, cwd=root, capture_output=True, text=True,
                          timeout=500)
  assert second.returncode == 0 and "done" in second.stdout, second.stderr[-3000:]
  log = metrics_lib.read_jsonl(os.path.join(tmp_path, "steps.jsonl"))
  # step 3 was trained again after the restart: its first line is gone (issue 34)
  assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
  last = {r["step"]: r for r in log}
  assert [last[s]["batch"] for s in range(1, 7)] == list(range(6))
  c = small("configs/fbos.py:tiny")  # the data order: the same seed and prompts per step
  it = RLTrainer(c, str(tmp_path / "order"), log_metrics=False)
  want = [[str(ex["id"]) for ex in next(it.train_iter)] for _ in range(6)]
  it.close()
  assert [last[s]["ids"] for s in range(1, 7)] == want
  trained = [i for s in range(1, 7) for i in last[s]["ids"]]
  assert len(trained) == len(set(trained)) == 6 * c.rl.prompts_per_step


# ---------------------------------------------------------------- weight sync


@pytest.mark.parametrize("n_src,n_dst,src_mesh,dst_mesh,dst_spec", [
    (4, 4, {"fsdp": 2, "tensor": 2}, {"tensor": 4}, ("_", "tensor")),  # another split
    (6, 2, {"data": 6}, {"tensor": 2}, ("_", "tensor")),  # more trainer devices
    (2, 6, {"fsdp": 2}, {"data": 3, "tensor": 2}, ("_", "tensor")),  # more rollout devices
])
def test_weight_sync_copies_shard_by_shard_in_chunks(n_src, n_dst, src_mesh, dst_mesh, dst_spec):
  """Trainer params onto a rollout mesh of another size and sharding: the values
  arrive on the rollout shardings, in chunks of at most the chunk size (a larger
  leaf alone), with the bytes every rollout device received."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from fbos_jax import sharding as sh
  from fbos_jax.rl import weight_sync as ws
  devs = jax.devices()
  sm = sh.make_mesh(src_mesh, devs[:n_src])
  dm = sh.make_mesh(dst_mesh, devs[n_src:n_src + n_dst])
  spec = P(*(None if a == "_" else a for a in dst_spec))
  src = {"w": jax.device_put(jnp.arange(24 * 16, dtype=jnp.float32).reshape(24, 16),
                             NamedSharding(sm, P("fsdp" if "fsdp" in src_mesh else None))),
         "b": jax.device_put(jnp.arange(8.0), NamedSharding(sm, P())),
         "c": jax.device_put(jnp.ones((4, 6)), NamedSharding(sm, P()))}
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          src)
  specs = {"w": spec, "b": P(), "c": P()}
  sync = ws.make_sync(abstract, specs, dm, colocated=False, max_staleness=1, chunk_bytes=512)
  assert [len(g) for g in sync.groups] == [2, 1]  # b + c (128 bytes), then w (1,536: alone)
  out, stats = sync(src)
  for k in src:
    assert out[k].sharding == NamedSharding(dm, specs[k])
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(src[k]))
  total, _ = ws.received_bytes(abstract, ws.rollout_shardings(abstract, specs, dm))
  assert stats.bytes == total and stats.chunks == 2 and stats.largest_chunk == 24 * 16 * 4
  assert total == n_dst * (32 + 96) + 24 * 16 * 4 * n_dst // dm.shape["tensor"]


def _engine_split_run(tmp_path, small, steps: int, **over):
  """The tiny config shrunk, the continuous engine (8 slots) on a 4-device
  rollout mesh, eta = 1, trained ``steps`` steps: (final state, metrics rows)."""
  c = small("configs/fbos.py:tiny", **{
      "train.steps": steps, "rl.rollout_devices": 4, "rl.max_staleness": 1,
      "sampling.engine": "continuous", "engine.slots": 8, "engine.window": 2,
      "engine.page_size": 8, "data.verifier": "fbos_jax.testing.small:parity_reward", **over})
  tr = RLTrainer(c, str(tmp_path))
  state, _ = tr.train()
  tr.close()
  return state, metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))


def test_split_with_the_continuous_engine_and_recompute(tmp_path, small):
  """The continuous engine on the rollout mesh, eta = 1, ``recompute``: the worker's
  rounds take weight updates between decode windows; every trained token has a
  version within eta (every engine row carries the versions of its tokens)."""
  state, rows = _engine_split_run(tmp_path, small, 3, **{"rl.inflight_update": "recompute"})
  assert int(state.step) == 3 and max(r["staleness/max"] for r in rows) <= 1
  assert sum(r["staleness/hist_1"] for r in rows) > 0
  assert all(r["rollout/windows"] > 0 for r in rows)


def test_streamed_rounds_with_the_engine_in_the_asynchronous_loop(tmp_path, small):
  """Issue 34: rl.stream_rounds=True with the continuous engine on the rollout
  thread, eta = 1, keep_kv: the streamed path carries every token's version, so
  the step trains (it used to stop with "row 0 ... never recorded")."""
  state, rows = _engine_split_run(tmp_path, small, 2, **{"rl.stream_rounds": True})
  assert int(state.step) == 2 and max(r["staleness/max"] for r in rows) <= 1
  assert all(r["round2/rollouts"] > 0 and r["rollout/windows"] > 0 for r in rows)


def test_the_engine_admits_the_next_steps_prompts_before_a_step_drains(tmp_path, small):
  """The continuous engine on the rollout thread, eta = 1: one engine run for the
  whole loop, step k + 1's prompts admitted while step k still decodes (AReaL's
  streaming: generation never drains between steps), slot utilisation over the
  run reported, every trained token within eta."""
  state, rows = _engine_split_run(tmp_path, small, 4)
  assert int(state.step) == 4 and max(r["staleness/max"] for r in rows) <= 1
  assert any(r["rollout/steps_beside"] > 0 for r in rows)  # admitted beside a step in flight
  assert all(0 < r["rollout/slot_util"] <= 1 for r in rows)
  windows = [r["rollout/windows"] for r in rows]
  assert windows == sorted(windows) and windows[0] > 0  # one engine run: counts over the run
