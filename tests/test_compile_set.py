"""The compile set (issue 29, item 5; fbos_jax/compile_set.py): a run compiles
every program it can call before step 1, so no step after the first compiles;
a compile after the start is counted and named; the plan counts the set.

The engine's enumeration (Engine.program_shapes) is checked the strict way: its
programs compiled, then many calls of every size, sampled and streamed, compile
nothing. The trainer runs (static sampler, engine, streamed rounds) check
``compile/after_start`` = 0 on the steps after the first.
"""
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from fbos_jax import compile_set
from fbos_jax import engine as E
from fbos_jax import metrics as metrics_lib
from fbos_jax import program_cache
from fbos_jax import sampling
from fbos_jax import sharding as sh
from fbos_jax.model import qwen
from fbos_jax.program_cache import count_compiles
from fbos_jax.rl import assemble
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import shapes
from fbos_jax.rl import sources
from fbos_jax.rl.trainer import RLTrainer

PARITY = "fbos_jax.testing.small:parity_reward"  # round 2 has rows every step


@pytest.fixture(scope="module")
def model():
  cfg = qwen.ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=32,
                         intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=16, rope_theta=10000.0)
  params = qwen.init_params(cfg, jax.random.PRNGKey(0))
  return params, cfg


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_engine_compile_set_covers_every_call(model):
  """Every engine program a run can call (rows, staged rows, page-table widths,
  prefill chunks, page copies), compiled from Engine.program_shapes: then calls
  of 1-9 prompts of 1-12 tokens, 1-3 samples each, and a streamed run whose
  requests arrive while it decodes, compile nothing."""
  params, cfg = model
  scfg = sampling.make_config(max_new_tokens=6, prompt_buckets=(12,), batch_buckets=(8,),
                              temperature=1.0, stop_token_ids=(3,))
  ecfg = E.EngineConfig(slots=4, page_size=4, window=4, prefill_chunk=8)
  eng = E.Engine(cfg, scfg, ecfg)
  progs = eng.program_shapes(n_max=3)
  kinds = [p[0] for p in progs]
  # rows (1, 2, 4) x pages (1, 2, 4, 5) + 4 widths with staged rows at 4 rows;
  # prefill: (chunk, pages) in {(8, 1), (8, 2), (8, 4)} x rows 3 x copies (0, 1, 2)
  assert (kinds.count("init"), kinds.count("window"), kinds.count("prefill")) == (1, 16, 27)
  for job in eng.compile_jobs(params, progs):
    job()
  rng = np.random.default_rng(0)
  with count_compiles() as compiles:
    for i, (count, n) in enumerate([(1, 1), (9, 3), (2, 2), (5, 1), (3, 3), (8, 2)]):
      prompts = [rng.integers(4, cfg.vocab_size, rng.integers(1, 13)).tolist()
                 for _ in range(count)]
      E.Engine(cfg, scfg, ecfg).sample(params, prompts, key=jax.random.PRNGKey(i),
                                       n_per_prompt=n)
    reqs = [E.Request(prompt=rng.integers(4, cfg.vocab_size, rng.integers(1, 13)).tolist(),
                      n=int(rng.integers(1, 4)), key=jax.random.PRNGKey(100 + j), tag=j)
            for j in range(10)]

    class Trickle:  # two requests per poll: admissions while rows decode
      def __init__(self):
        self.left = list(reqs)

      def poll(self):
        out, self.left = self.left[:2], self.left[2:]
        return out

      def finished(self):
        return not self.left

    E.Engine(cfg, scfg, ecfg).run(params, Trickle(), lambda row: None)
  assert compiles == [], [e.describe() for e in compiles]


def test_bucket_growth_bounds_the_engine_programs(model):
  """engine.bucket_growth: 4 gives fewer programs than 2, 0 (one bucket each)
  the fewest; every call still finds its bucket."""
  params, cfg = model
  scfg = sampling.make_config(max_new_tokens=6, prompt_buckets=(12,), batch_buckets=(8,),
                              temperature=0.0)
  counts = {g: len(E.Engine(cfg, scfg, E.EngineConfig(slots=8, page_size=2, prefill_chunk=8,
                                                      bucket_growth=g)).program_shapes(4))
            for g in (2, 4, 0)}
  assert counts[2] > counts[4] > counts[0]
  eng = E.Engine(cfg, scfg, E.EngineConfig(slots=8, page_size=2, prefill_chunk=8,
                                           bucket_growth=0))
  assert (eng.row_buckets, eng.page_buckets, eng.prefill_buckets) == ((8,), (9,), (8,))
  out = eng.sample(params, [[5, 6, 7], [8] * 11], key=jax.random.PRNGKey(0), n_per_prompt=2)
  assert out.tokens.shape == (4, 6)
  with pytest.raises(E.EngineError, match="engine.bucket_growth=1"):
    E.EngineConfig(bucket_growth=1).validate()


def _run(small, one_device_mesh, tmp_path, **over):
  c = small("configs/fbos.py:tiny", **{"data.verifier": PARITY, "train.steps": 3,
                                       "sampling.prompt_buckets": (32,),
                                       "sampling.fap_prompt_buckets": (128, 656), **over})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh)
  state = tr.init_state()
  report = tr.compile_at_start(state)
  _, hist = tr.train(state)
  events = list(tr.compile_watch.events)
  tr.close()
  return report, hist, events


@pytest.mark.parametrize("engine", ["static", "continuous", "streamed"])
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_no_compile_after_the_first_step(engine, small, one_device_mesh, tmp_path):
  """A run compiles its set before step 1: no step after the first compiles
  (``compile/after_start`` = 0), and step 1 compiles none of the samplers',
  engine's or update's programs (only small helpers on their first call)."""
  over = {}
  if engine != "static":
    over = {"sampling.engine": "continuous", "engine.slots": 8, "engine.page_size": 8,
            "engine.bucket_growth": 0, "rl.stream_rounds": engine == "streamed"}
  report, hist, events = _run(small, one_device_mesh, tmp_path, **over)
  assert report["programs"] == sum(g["programs"] for g in report["groups"].values()) > 0
  rows = [r for r in hist if "compile/after_start" in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert [r["compile/after_start"] for r in rows[1:]] == [0, 0], events
  assert [e.call for e in events if e.call] == []


@pytest.mark.parametrize("eta", [0, 1])
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_a_split_run_compiles_its_rollout_programs_before_step_1(eta, small, tmp_path):
  """AReaL's split on a thread (rl.rollout_devices=4 of 8): the compile set holds
  the rollout worker's programs on its own mesh (the static sampler at eta 0; at
  eta 1 the engine streaming the steps, round 1 and round 2 in one run) besides
  the trainer's update, so neither side compiles a program after step 1."""
  over = {"data.verifier": PARITY, "train.steps": 3, "rl.rollout_devices": 4,
          "rl.max_staleness": eta, "sampling.prompt_buckets": (32,),
          "sampling.fap_prompt_buckets": (128, 656)}
  if eta:
    over.update({"engine.slots": 8, "engine.page_size": 8, "engine.bucket_growth": 0})
  tr = RLTrainer(small("configs/fbos.py:tiny", **over), str(tmp_path))
  assert isinstance(tr.source, sources.ThreadSource)
  state = tr.init_state()
  report = tr.compile_at_start(state)
  names = list(report["groups"])
  rollout = [n for n in names if n.startswith("rollout ")]
  kind = "rounds (streamed) (engine)" if eta else "sample_round1 (static sampler)"
  assert f"rollout {kind}" in rollout and "update" in names, names
  _, hist = tr.train(state)
  events = list(tr.compile_watch.events)
  tr.close()
  rows = [r for r in hist if "compile/after_start" in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert [r["compile/after_start"] for r in rows[1:]] == [0, 0], [e.describe() for e in events]
  assert [e.call for e in events if e.call] == []


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_packed_run_compiles_nothing_after_the_first_step(small, one_device_mesh, tmp_path):
  """rl.micro_batch_tokens: the compile set holds the packed update's programs
  (each batch at each prompt bucket x each micro-batch-count bucket of the token
  budget), so a packed run compiles none after the start either."""
  r = small("configs/fbos.py:tiny").sampling.max_new_tokens
  # 4 rows of the longest FAP row per micro-batch: its batch takes 1 to 4 micro-batches
  over = {"rl.micro_batch_tokens": 4 * (656 + r), "rl.fixed_row_buckets": False}
  report, hist, events = _run(small, one_device_mesh, tmp_path, **over)
  c = small("configs/fbos.py:tiny", **{"sampling.prompt_buckets": (32,),
                                       "sampling.fap_prompt_buckets": (128, 656), **over})
  combos = shapes.update_programs(config_lib.build_parts(c), 1)
  assert all(isinstance(s, shapes.PackedShape) for combo in combos for s in combo.values())
  assert report["groups"]["update"]["programs"] == len(combos) > 1
  rows = [r for r in hist if "compile/after_start" in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert [r["compile/after_start"] for r in rows[1:]] == [0, 0], events
  assert [e.call for e in events if e.call] == []
  assert all(0 < r["update/real_token_frac"] <= 1 for r in rows)


def test_a_fixed_packed_run_has_one_update_program_per_prompt_bucket_pair(small):
  """rl.fixed_row_buckets with packing: each batch at its most micro-batches, so the
  update's programs are the prompt buckets' combinations, as in a padded run."""
  r = small("configs/fbos.py:tiny").sampling.max_new_tokens
  over = {"sampling.prompt_buckets": (16, 32), "sampling.fap_prompt_buckets": (128, 656)}
  parts = lambda **kw: config_lib.build_parts(small("configs/fbos.py:tiny", **over, **kw))
  fixed = shapes.update_programs(parts(**{"rl.micro_batch_tokens": 4 * (656 + r)}), 1)
  padded = shapes.update_programs(parts(), 1)
  bucketed = shapes.update_programs(parts(**{"rl.micro_batch_tokens": 4 * (656 + r),
                                             "rl.fixed_row_buckets": False}), 1)
  assert len(fixed) == len(padded) == 4 < len(bucketed)
  assert all(isinstance(s, shapes.PackedShape) for combo in fixed for s in combo.values())


def test_compile_after_start_is_counted_and_named(caplog):
  """A tracked program compiled after the start: counted, and the warning names
  the program and the shapes of the call."""
  fn = program_cache.tracked(jax.jit(lambda x: x * 2), "doubler")
  x = jnp.ones((3, 5), jnp.float32)
  watch = program_cache.CompileWatch()
  try:
    fn(x)
    fn(x)  # compiled: nothing new
    events = watch.take()
  finally:
    watch.close()
  assert len(events) == 1 and events[0].call == "doubler f32[3,5]"
  with caplog.at_level(logging.WARNING):
    m = compile_set.after_start(events, step=7)
  assert m["compile/after_start"] == 1 and m["time/compile_after_start_s"] > 0
  assert "step 7" in caplog.text and "doubler f32[3,5]" in caplog.text


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_a_set_over_the_map_budget_stops_early_and_names_the_fields(monkeypatch):
  """XLA's CPU backend maps each kernel of a loaded program; a set that would
  pass vm.max_map_count (the tiny engine run's 278 programs died at 272 with
  "LLVM: Cannot allocate memory", 8 minutes in) stops once its projection says
  so, naming the fields that shrink it, and compiles none of the rest."""
  jobs_run, loaded = [], []

  def f(x, w):  # a few dozen kernels, each mapped on its own
    for _ in range(8):
      x = jnp.tanh(x @ w) + jnp.sin(x) * jnp.cumsum(x, axis=-1)
    return jax.nn.softmax(x).sum()

  def jobs():
    def job(i):
      jobs_run.append(i)
      loaded.append(jax.jit(jax.grad(f)).lower(jnp.ones((i + 1, 32)), jnp.ones((32, 32))).compile())
    return [lambda i=i: job(i) for i in range(40)]

  budget = compile_set.MapBudget.here()
  assert budget is not None and budget.limit > 0       # Linux: /proc/sys/vm/max_map_count
  # a limit the 40 loaded programs' maps (about 100 each) cannot fit under
  monkeypatch.setattr(compile_set.MapBudget, "here", classmethod(
      lambda cls: cls(start=cls.count(), limit=int((cls.count() + 2000) / 0.9))))
  group = compile_set.ProgramGroup("probe", list(range(40)), jobs)
  with pytest.raises(compile_set.CompileSetTooLarge, match="engine.bucket_growth"):
    compile_set.compile_all([group])
  assert 8 <= len(jobs_run) < 40
  # the real limit holds them: compiled to the end
  jobs_run.clear()
  loaded.clear()
  monkeypatch.setattr(compile_set.MapBudget, "here", classmethod(
      lambda cls: cls(start=cls.count(), limit=budget.limit)))
  assert compile_set.compile_all([group])["programs"] == 40 and len(jobs_run) == 40


def test_ecc_advantages_take_one_program():
  """ECC's group advantages go to the kernel as [P, round2_size]: the same
  values as without the padding, and steps whose prompts with round-2 rows (and
  their group sizes) differ reuse one compiled program."""
  rng = np.random.default_rng(0)
  r1 = rng.random((6, 4)).astype(np.float32)
  kw = dict(mode="improvement", estimator="grpo", eps=1e-6)

  def rows(prompts, size):
    p = np.repeat(np.asarray(prompts), size)
    return rng.random(p.size).astype(np.float32), p, np.tile(np.arange(size), len(prompts))

  r2, p, src = rows([0, 2, 5], 3)
  padded = assemble.ecc_advantages(r1, r2, p, src, width=4, **kw)
  want = np.zeros_like(r2)
  for q in (0, 2, 5):  # each group on its own
    sel = p == q
    want[sel] = assemble.advantages((r2[sel] - r1[q, src[sel]])[None], np.ones((1, 3), bool),
                                    "grpo", 1e-6)[0]
  np.testing.assert_allclose(padded, want, rtol=1e-6, atol=1e-7)
  with count_compiles() as compiles:
    assemble.ecc_advantages(r1, *rows([1, 3], 2), width=4, **kw)
    assemble.ecc_advantages(r1, *rows([4], 4), width=4, **kw)
  assert compiles == []


def test_plan_counts_the_compile_set(one_device_mesh):
  """The plan's count of the compile set is the trainer's enumeration: the
  static samplers' chunks x prompt buckets, the update's row x prompt buckets,
  each engine's program_shapes; bucket_growth=0 bounds the engine's."""
  from fbos_jax.planning import programs as plan_lib
  c = configs.load("configs/fbos.py:tiny")
  parts = plan_lib.plan_parts(c)
  rules = sh.rules_dict(c.mesh.rules)
  static = plan_lib.compile_set_plan(parts, one_device_mesh, rules, {}, eval_prompts=256,
                                     eval_k=4)
  # round 1: 8 prompts x (16, 32); round 2: chunks (8, 16, 64) x 5 FAP buckets;
  # eval: 128-prompt chunks x 2, greedy and pass@4; update: 2 x 5 prompt buckets
  assert {k: g["programs"] for k, g in static["groups"].items()} == {
      "sample_round1 (static sampler)": 2, "sample_round2 (static sampler)": 15,
      "eval_greedy (static sampler)": 2, "eval_sampled (static sampler)": 2, "update": 10}
  c.sampling.engine = "continuous"
  # the default buckets (tiny sets its own, which bucket_growth leaves alone)
  c.engine.row_buckets = c.engine.page_buckets = c.engine.prefill_buckets = ()
  counts = {}
  for g in (2, 0):
    c.engine.bucket_growth = g
    cs = plan_lib.compile_set_plan(plan_lib.plan_parts(c), one_device_mesh, rules, {},
                                   eval_prompts=256, eval_k=4)
    counts[g] = cs["programs"]
    parts = plan_lib.plan_parts(c)
    want = 10 + sum(len(E.Engine(parts.model, s, parts.sampling.engine_config,
                                 mesh=one_device_mesh, rules=rules).program_shapes(n))
                    for _, s, n in shapes.engine_runs(parts, eval_prompts=256, eval_k=4))
    assert cs["programs"] == want
  assert counts[0] < counts[2] // 4
  assert "compile set" in "\n".join(plan_lib.format_compile_set(cs))


def test_qwen_8b_compile_set_is_bounded():
  """qwen_8b on its 32-chip slice: one engine bucket per dimension and fixed
  update rows keep the set at a few dozen programs (each a 36-layer program that
  takes minutes to compile), counted without compiling."""
  from fbos_jax.planning import hardware as hw
  from fbos_jax.planning import programs as plan_lib
  try:
    devices = hw.topology_devices("v5p:2x4x4")
  except hw.PlanError as e:
    pytest.skip(str(e))
  c = configs.load("configs/fbos.py:qwen_8b")
  mesh = hw.target_mesh(c, devices, "v5p:2x4x4")
  cs = plan_lib.compile_set_plan(plan_lib.plan_parts(c), mesh, sh.rules_dict(c.mesh.rules), {},
                                 processes=8, eval_prompts=c.train.eval_prompts,
                                 eval_k=c.train.eval_k)
  assert cs["programs"] <= 40, cs["groups"]
