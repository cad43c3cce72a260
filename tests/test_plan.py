"""Compile-for-topology plans (fbos_jax/planning/programs.py): XLA's TPU compiler
on this CPU; the roofline's response-length model (fbos_jax/planning/hardware.py), static vs continuous.

These tests need libtpu (the TPU compiler, no TPU): `pip install libtpu==0.0.42.1`
(requirements-test.txt installs it). Without it the compiling tests are skipped.
"""

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from configs import load
from fbos_jax.planning import hardware as hw
from fbos_jax.planning import programs as plan_lib
from fbos_jax import sharding as sh
from fbos_jax.model import qwen
from fbos_jax.engine import EngineConfig
from fbos_jax.rl import shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU, reason="XLA's TPU compiler is missing: pip install libtpu==0.0.42.1 "
    "(or pip install -r requirements-test.txt); no TPU is needed")


def small_real_heads(spec="configs/grpo.py:qwen3_0_6b", engine="static"):
  """A 2-layer Qwen3 with Qwen3-0.6B's real head sizes and vocabulary, small step
  shapes, on the static sampler or the continuous engine (``engine``: 16 slots,
  64-token prefill chunks)."""
  c = load(spec)
  c.sampling.engine = engine
  c.engine.slots = 16
  c.engine.prefill_chunk = 64
  c.model.num_layers = 2
  c.rl.prompts_per_step = 8
  c.rl.group_size = 4
  c.rl.round2_size = 4
  c.rl.micro_batches = 2
  c.sampling.max_new_tokens = 32
  c.sampling.prompt_buckets = (64,)
  c.sampling.fap_prompt_buckets = (128,)
  c.templates.max_prompt_tokens = 128
  c.sampling.batch_buckets = (8, 32)
  c.train.eval_every = 0
  return c


# ---------------------------------------------------------------- bad input (no compiler)


def test_unknown_topology_lists_accepted_forms():
  for bad in ("v5p-32", "tpu", "v9x:2x2", "v5p:2x"):
    with pytest.raises(hw.PlanError, match="accepted forms.*v5p:2x4x4"):
      hw.topology_devices(bad)


def test_update_shapes_follow_the_config():
  c = load("configs/fbos.py:qwen_8b")
  c.rl.micro_batches = 8
  got = shapes.update_shapes(plan_lib.plan_parts(c), batch_shards=8)
  # P * (n + epa_max_per_prompt) rows on q; P * m rows on the FAPs
  epa, ecc = got["epa"], got["ecc"]
  assert (epa.rows, epa.prompt_len, epa.response_len) == (64 * (8 + 8), 2048, 512)
  assert (ecc.rows, ecc.prompt_len) == (64 * 8, 4096)
  g = load("configs/grpo.py:qwen_8b")
  got = shapes.update_shapes(plan_lib.plan_parts(g), batch_shards=8)
  assert set(got) == {"epa"} and got["epa"].rows == 64 * 8  # ECC off: no batch at all
  f = load("configs/fcp.py:qwen_8b")
  got = shapes.update_shapes(plan_lib.plan_parts(f), batch_shards=8)
  # FCP: its MLE batch on <EF>c</EF>q contexts (FAP buckets), P * n rows
  assert set(got) == {"fcp"} and (got["fcp"].rows, got["fcp"].prompt_len) == (64 * 8, 4096)


def test_analytic_flops_counts_the_obvious_cases():
  mc = qwen.ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                        num_kv_heads=2, head_dim=16, vocab_size=100)
  trunk = 2 * (64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + 3 * 64 * 128)
  one = hw.analytic_flops(mc, kind="logprob", rows=1, seq=1, response_len=1)
  assert one == 2 * trunk + 4 * 2 * 4 * 16 * 1 + 2 * 64 * 100
  fwd = hw.analytic_flops(mc, kind="logprob", rows=3, seq=10, response_len=4)
  assert hw.analytic_flops(mc, kind="train", rows=3, seq=10, response_len=4) == 3 * fwd


# ---------------------------------------------------------------- the compiler


@needs_libtpu
def test_cost_analysis_counts_a_loop_body_once():
  """Why the plan carries analytic FLOPs: XLA counts a scan body once."""
  devs = hw.topology_devices("v5p:2x2x1")
  mesh = Mesh(np.asarray(devs[:1]), ("x",))
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))

  def loop(a, n):
    return jax.lax.scan(lambda c, _: (c @ a, None), a, None, length=n)[0]

  f1 = jax.jit(lambda a: loop(a, 1)).lower(x).compile().cost_analysis()["flops"]
  f10 = jax.jit(lambda a: loop(a, 10)).lower(x).compile().cost_analysis()["flops"]
  assert f1 == pytest.approx(2 * 256 ** 3, rel=0.01)
  assert f10 == pytest.approx(f1, rel=0.01)  # not 10x


@needs_libtpu
def test_hbm_comes_from_the_compiler():
  v5p = hw.hbm_bytes(hw.topology_devices("v5p:2x2x1")[0])
  v5e = hw.hbm_bytes(hw.topology_devices("v5e:2x4")[0])
  assert 90 * hw.GiB < v5p < 96 * hw.GiB
  assert 15 * hw.GiB < v5e <= 16 * hw.GiB


@needs_libtpu
def test_mesh_that_does_not_match_the_topology_names_both_numbers():
  c = small_real_heads()
  c.mesh.fsdp = 1
  c.mesh.tensor = 3
  c.mesh.data = 1
  with pytest.raises(hw.PlanError, match=r"3.*4 devices|4 devices.*3"):
    hw.target_mesh(c, hw.topology_devices("v5p:2x2x1"), "v5p:2x2x1")


@needs_libtpu
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_real_head_sizes_compile_and_fit_on_v5p():
  """A 2-layer Qwen3 with real head sizes (and the 151,936-word vocabulary):
  the round-1 sampler and the update compile for 4 v5p chips and fit."""
  c = small_real_heads()
  plan = plan_lib.compile_plan(c, "v5p:2x2x1", search=False)
  assert set(plan["programs"]) == {"sample_round1", "update"}
  for name, rep in plan["programs"].items():
    assert not rep.error, (name, rep.error)
    assert 0 < rep.peak <= hw.FIT_FRACTION * plan["hbm_bytes"], name
    # the compiled program holds the weights: at least this device's param shard
    assert rep.argument >= 2 * 151_936 * 1024 // 4 * 0.9, name
  assert plan["fits"]
  js = plan_lib.plan_json(plan)
  assert js["fits"] and js["programs"]["update"]["peak_bytes"] == plan["programs"]["update"].peak
  assert js["est_step_s"] > 0


@needs_libtpu
def test_a_program_that_does_not_fit_is_reported_with_knobs():
  """The same model with a huge update batch on 16 GiB v5e chips: the plan says
  it does not fit, names the program and the knobs."""
  c = small_real_heads()
  c.mesh.fsdp = -1
  c.rl.prompts_per_step = 64
  c.rl.group_size = 16
  c.rl.micro_batches = 1
  c.sampling.prompt_buckets = (2048,)
  c.sampling.max_new_tokens = 2048
  c.model.remat = "none"
  c.model.num_layers = 8
  devs = hw.topology_devices("v5e:2x4")
  mesh = hw.target_mesh(c, devs)
  prog = plan_lib.step_programs(plan_lib.plan_parts(c), mesh, sh.rules_dict(c.mesh.rules),
                                only="update")[0]
  rep = plan_lib.compile_program(prog, mesh)
  hbm = hw.hbm_bytes(devs[0])
  assert rep.error or rep.peak > hw.FIT_FRACTION * hbm
  assert rep.temp > hbm  # the compiler's figure is kept even when it refuses
  assert "rl.micro_batches" in rep.knobs


@needs_libtpu
def test_dry_run_cli_bad_topology_and_json_line():
  bad = subprocess.run([sys.executable, "launch/train.py", "--config=configs/grpo.py:tiny",
                        "--dry_run", "--topology=v5p-32"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0
  assert "accepted forms" in bad.stderr + bad.stdout


def _have_cuda_plugin() -> bool:
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    return False


@pytest.mark.skipif(not _have_cuda_plugin(), reason="XLA's GPU compiler is missing: pip install "
                    "jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 (no GPU is needed)")
@pytest.mark.parametrize("spec,engine", [("configs/grpo.py:qwen_8b_h100", "static"),
                                         ("configs/fbos.py:qwen_8b_h100", "continuous")])
def test_real_head_sizes_compile_for_h100s(spec, engine):
  """The same small real-head model on one 8xH100 node (tensor parallel 8):
  compiled by XLA's GPU compiler from a target description, no GPU. On the engine
  (qwen_8b_h100's sampler) the decode window on GPU is the Pallas GPU kernel (issue
  32: a Triton call reading the pages in place, not a dense gather)."""
  c = small_real_heads(spec, engine)
  plan = plan_lib.compile_plan(c, "h100:1x8", search=False)
  assert plan["chip"] == "NVIDIA H100 SXM" and plan["num_devices"] == 8
  assert plan["fit_fraction"] == hw.GPU_FIT_FRACTION
  if engine == "continuous":
    assert set(engine_program_names()) == set(plan["programs"]), plan["programs"]
    for rnd in ("sample_round1", "sample_round2"):
      assert "pallas_gpu attention" in plan["programs"][f"{rnd}/window"].what
  for name, rep in plan["programs"].items():
    assert not rep.error and 0 < rep.peak <= 0.75 * plan["hbm_bytes"], name


# ---------------------------------------------------------------- the continuous engine


def engine_program_names(eval_prompts=0):
  base = ["sample_round1", "sample_round2"] + (["eval_greedy"] if eval_prompts else [])
  return [f"{b}/{k}" for b in base for k in plan_lib.ENGINE_KINDS] + ["update"]


@needs_libtpu
def test_the_plan_has_the_engine_programs_when_the_engine_is_on():
  """sampling.engine=continuous: each sampler call of a step is the engine's decode
  window and prefill, with the page pool of that call's prompts; static: the static
  sampler's programs and no engine program."""
  devs = hw.topology_devices("v5p:2x2x1")
  names = {}
  for engine in ("static", "continuous"):
    c = small_real_heads("configs/fbos.py:qwen3_0_6b", engine)
    mesh = hw.target_mesh(c, devs)
    progs = plan_lib.step_programs(plan_lib.plan_parts(c), mesh, sh.rules_dict(c.mesh.rules),
                                   eval_prompts=16)
    names[engine] = [p.name for p in progs]
    if engine == "continuous":
      what = {p.name: p.what for p in progs}
      assert "16 slots + 16 staged over 4 batch shard(s), prompt <= 64 + 32" in what[
          "sample_round1/window"]
      assert "prompt <= 128 + 32" in what["sample_round2/window"]  # the FAP buckets
      assert "copies" in what["sample_round1/prefill"]  # 4 samples share a prompt's pages
      assert "copies" not in what["sample_round2/prefill"]  # one sample per FAP
      assert "(greedy)" in what["eval_greedy/window"]
      assert all("engine.slots" in p.knobs and "engine.num_pages" in p.knobs
                 for p in progs if "/" in p.name)
  assert names["static"] == ["sample_round1", "sample_round2", "eval_greedy", "update"]
  assert names["continuous"] == engine_program_names(eval_prompts=16)


@needs_libtpu
def test_engine_programs_compile_and_fit_in_the_plan(monkeypatch):
  """The compiled plan with the engine on: round 1's window and prefill compile for
  4 v5p chips with the pool sized from the config (the donated pool is an
  argument, aliased by the output), fit, and the report and its JSON line say
  which sampler ran and both roofline numbers. (The update is left out here: the
  static test above compiles it.)"""
  c = small_real_heads("configs/grpo.py:qwen3_0_6b", "continuous")
  real = plan_lib.step_programs
  monkeypatch.setattr(plan_lib, "step_programs", lambda *a, **k: [
      p for p in real(*a, **k) if p.name != "update"])
  plan = plan_lib.compile_plan(c, "v5p:2x2x1", search=False)
  assert list(plan["programs"]) == ["sample_round1/window", "sample_round1/prefill"]
  parts = plan_lib.plan_parts(c)
  from fbos_jax.planning import engine as eplan
  mesh = hw.target_mesh(c, hw.topology_devices("v5p:2x2x1"))
  eng = eplan.abstract_programs(parts.model, parts.sampling.round1, parts.sampling.engine_config,
                                mesh, sh.rules_dict(c.mesh.rules))["engine"]
  pool = eplan.describe(eng)["pool_bytes_per_device"]
  for name, rep in plan["programs"].items():
    assert not rep.error, (name, rep.error)
    assert rep.argument >= pool and rep.alias >= pool, name  # the pool, updated in place
    assert 0 < rep.peak <= hw.FIT_FRACTION * plan["hbm_bytes"], name
  assert plan["fits"] and plan["sampler"] == "continuous"
  text = plan_lib.format_compiled_plan(plan)
  assert "sampler continuous" in text and "ASSUMED response lengths" in text
  assert "static     1 call(s) of 32 rows" in text and "continuous 16 slots" in text
  assert "<- this run" in text.split("continuous 16 slots")[1].splitlines()[0]
  js = plan_lib.plan_json(plan)
  assert js["sampler"] == "continuous" and js["est_step_s"] == js["est_step_s_continuous"]
  assert js["est_step_s_static"] > 0


@needs_libtpu
def test_an_engine_pool_that_cannot_fit_is_reported_with_the_knobs(monkeypatch):
  """2,048 slots of 64 + 8,192 tokens on 8 v5e chips: the pool alone is 16 GiB per
  device. The plan says the window does not fit and names the engine's knobs."""
  c = small_real_heads("configs/grpo.py:qwen3_0_6b", "continuous")
  c.engine.slots = 2048
  c.engine.staged = 0
  c.sampling.max_new_tokens = 8192
  real = plan_lib.step_programs
  monkeypatch.setattr(plan_lib, "step_programs", lambda *a, **k: real(
      *a, **dict(k, only="sample_round1/window")))
  plan = plan_lib.compile_plan(c, "v5e:2x4", search=False)
  rep = plan["programs"]["sample_round1/window"]
  assert not plan["fits"]
  assert rep.error or rep.peak > hw.FIT_FRACTION * plan["hbm_bytes"]
  assert rep.temp + rep.argument > 16 * hw.GiB  # the compiler's figure, kept when it refuses
  text = plan_lib.format_compiled_plan(plan)
  assert "sample_round1/window does not fit" in text
  knobs = text.split("sample_round1/window does not fit")[1]
  for knob in ("engine.slots", "engine.staged", "engine.num_pages", "engine.page_size",
               "sampling.max_new_tokens"):
    assert knob in knobs, knob


@needs_libtpu
def test_an_engine_config_the_engine_refuses_is_reported_with_the_numbers():
  """engine.num_pages below what the slots need: the engine refuses it at start, so
  the plan reports the refusal (with the engine's numbers) without compiling."""
  c = small_real_heads("configs/grpo.py:qwen3_0_6b", "continuous")
  c.engine.num_pages = 10
  mesh = hw.target_mesh(c, hw.topology_devices("v5p:2x2x1"))
  progs = plan_lib.step_programs(plan_lib.plan_parts(c), mesh, sh.rules_dict(c.mesh.rules),
                                 only="sample_round1")
  assert [p.name for p in progs] == ["sample_round1/window", "sample_round1/prefill"]
  rep = plan_lib.compile_program(progs[0], mesh)
  assert rep.refused and "engine.num_pages=10 per batch shard is too small" in rep.error
  assert not plan_lib._fits(rep, 1e18)


def test_engine_search_drops_staged_rows_then_slots():
  c = small_real_heads("configs/grpo.py:qwen3_0_6b", "continuous")
  c.engine.slots = 64
  opts = plan_lib._engine_options(plan_lib.plan_parts(c), shards=8)
  assert opts == [dict(staged=32), dict(staged=16), dict(staged=8), dict(staged=0),
                  dict(slots=32, staged=0), dict(slots=16, staged=0), dict(slots=8, staged=0)]


def test_engine_shapes_are_whole_calls():
  """The engine takes a whole call (no batch buckets); its pool holds the call's
  longest prompt bucket, or engine.max_prompt_len."""
  c = load("configs/fbos.py:qwen_8b")
  parts = plan_lib.plan_parts(c)
  got = shapes.engine_shapes(parts, eval_prompts=128, eval_k=4)
  assert {k: (s.rows, s.n, s.prompt_len) for k, s in got.items()} == {
      "sample_round1": (64 * 8, 8, 2048), "sample_round2": (64 * 8, 1, 4096),
      "eval_greedy": (128, 1, 2048), "eval_sampled": (128 * 4, 4, 2048)}
  static = shapes.sampler_shapes(parts, 8, eval_prompts=128, eval_k=4)
  assert static["sample_round2"].chunks == (256, 256)  # batch buckets up to 256 prompts
  c.engine.max_prompt_len = 1000
  assert shapes.engine_shapes(plan_lib.plan_parts(c))["sample_round2"].prompt_len == 1000


# ---------------------------------------------------------------- the roofline's lengths


def test_response_lengths_follow_the_assumed_lognormal():
  """mean, E[max of k] and the rows' lengths of the model against numpy draws of
  the same capped lognormal."""
  lengths, cap = hw.ResponseLengths(median_fraction=0.25, p99_fraction=1.0), 1000
  sigma = np.log(4.0) / 2.3263478740408408
  rng = np.random.default_rng(0)
  draws = np.minimum(rng.lognormal(np.log(250.0), sigma, (20_000, 64)), cap)
  assert lengths.mean(cap) == pytest.approx(draws.mean(), rel=0.01)
  assert lengths.expected_max(64, cap) == pytest.approx(draws.max(axis=1).mean(), rel=0.01)
  assert lengths.expected_max(1, cap) == pytest.approx(lengths.mean(cap))
  rows = lengths.sample(1000, cap)
  assert rows.min() >= 1 and rows.max() <= cap and np.median(rows) == pytest.approx(250, abs=2)
  assert np.quantile(rows, 0.99) == pytest.approx(1000, rel=0.02)
  assert rows.mean() == pytest.approx(lengths.mean(cap), rel=0.01)
  with pytest.raises(hw.PlanError, match="median_fraction"):
    hw.ResponseLengths(median_fraction=0.5, p99_fraction=0.25)


def test_engine_schedule_refills_slots_as_rows_stop():
  assert hw.engine_schedule([5, 1, 1, 1, 1, 1], slots=2) == (5, 1.0)
  assert hw.engine_schedule([4, 4, 1], slots=2) == (5, 0.9)
  assert hw.engine_schedule([3, 1], slots=8) == (3, 4 / 6)  # 2 rows use 2 of the 8 slots


def _roofline_calls(lengths, *, slots=64, chunks=(16, 16, 16, 16), engine="continuous"):
  from fbos_jax import sampling
  mc = qwen.ModelConfig(model_type="qwen3", vocab_size=1024, hidden_size=256,
                        intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=64, param_dtype="bfloat16", compute_dtype="bfloat16")
  mesh = sh.make_abstract_mesh({"dcn": 1, "data": 1, "fsdp": 1, "tensor": 1}, 1)
  scfg = sampling.SamplingConfig(max_new_tokens=1000, prompt_buckets=(64,))
  static = {"sample_round1": shapes.SamplerShape(max(chunks), 64, 4, scfg, chunks)}
  eng = {"sample_round1": shapes.EngineShape(sum(chunks), 4, scfg, EngineConfig(slots=slots))}
  return hw.roofline(mc, mesh, hw.CHIP_SPECS["TPU v5"], static, {}, engine_shapes=eng,
                     engine=engine, lengths=lengths)["sample_round1"]


def test_roofline_static_and_continuous_decode_follow_the_lengths():
  """Equal lengths: static runs 4 calls x L steps, the engine 256 rows / 64 slots x
  L steps at full utilisation. Long-tailed lengths: each static call runs to its
  longest row (~ the cap), the engine about total tokens / slots; so the engine's
  decode is shorter, by about E[max] / mean."""
  equal = _roofline_calls(hw.ResponseLengths(0.5, 0.5))
  assert equal["static"]["steps"] == pytest.approx(4 * 500, abs=2)
  assert equal["continuous"]["steps"] == 4 * 500 and equal["continuous"]["slot_util"] == 1.0
  assert equal["continuous"]["decode_s"] == pytest.approx(equal["static"]["decode_s"], rel=0.05)

  tail = hw.ResponseLengths(0.1, 1.0)
  got = _roofline_calls(tail)
  st, ct = got["static"], got["continuous"]
  assert st["steps"] == pytest.approx(4 * tail.expected_max(64, 1000))
  assert st["steps"] > 4 * 800  # a call of 64 rows meets a row near the cap
  total = 256 * tail.mean(1000)
  assert ct["steps"] == pytest.approx(total / (64 * ct["slot_util"]), rel=0.01)
  assert total / 64 <= ct["steps"] <= total / 64 + 1000  # the tail: at most one more longest row
  assert ct["decode_s"] < st["decode_s"] / 2
  assert got["total_s"] == ct["total_s"]
  assert _roofline_calls(tail, engine="static")["total_s"] == st["total_s"]
  # one slot per row: no refills, the longest row sets the steps, utilisation mean / max
  one = _roofline_calls(tail, slots=256)["continuous"]
  assert one["slot_util"] == pytest.approx(tail.mean(1000) / one["steps"], rel=0.01)


@needs_libtpu
def test_async_model_uses_the_runs_sampler():
  """The asynchronous system's modelled step (async_split.modelled_speedup, analytic:
  nothing compiled) estimates the rollout with the run's sampler, as the compiled
  plan does: the continuous engine's rollout is shorter than the static sampler's
  under the same assumed lengths, and the asynchronous step is max(rollout, train +
  sync) on the split."""
  from fbos_jax.planning import async_split
  out = {}
  for engine in ("continuous", "static"):
    c = load("configs/fbos.py:qwen_8b_long", {"sampling.engine": engine})
    out[engine] = m = async_split.modelled_speedup(c, "v5p:2x4x4", 16)
    a, s = m["async_step"], m["sync_step"]
    assert m["engine"] == engine and m["trainer_devices"] == 16
    assert a["step_s"] == max(a["rollout_s"], a["train_s"] + a["sync_s"])
    assert s["step_s"] == s["rollout_s"] + s["train_s"]
    assert 0 < a["sync_s"] < 1.0  # paired hosts, over their network: a fraction of a second
  assert out["continuous"]["sync_step"]["rollout_s"] < 0.5 * out["static"]["sync_step"]["rollout_s"]
  assert out["continuous"]["sync_step"]["train_s"] == out["static"]["sync_step"]["train_s"]


@needs_libtpu
def test_split_plan_puts_the_engine_programs_on_the_rollout_side(monkeypatch):
  """The asynchronous split plan compiles every sampler program of the step on the
  rollout mesh (on the engine: each call's window and prefill) and the update on the
  trainer mesh; a side the step has no program for is refused, never a 0-byte fit.
  (Compiling is stubbed: the plan's own tests compile these programs.)"""
  from fbos_jax.planning import async_split
  compiled, resident = [], {}

  def fake_compile(prog, mesh):
    compiled.append((prog.name, mesh.size))
    resident[prog.name] = prog.resident
    return plan_lib.ProgramReport(prog.name, prog.what, prog.knobs, prog.flops, argument=2 ** 20)

  monkeypatch.setattr(plan_lib, "compile_program", fake_compile)
  c = small_real_heads("configs/fbos.py:qwen3_0_6b", "continuous")
  plan = async_split.compile_split_plan(c, "v5p:2x2x1", 2)
  assert sorted(compiled) == sorted(
      [("update", 2)] + [(f"{b}/{k}", 2) for b in ("sample_round1", "sample_round2")
                         for k in plan_lib.ENGINE_KINDS])
  assert plan["sides"]["rollout"]["largest_program"] == 2 ** 20 and plan["fits"]
  # each side's compile set: the rollout (one process) streams the steps through one
  # engine run; the trainer holds the update (and the eval's samplers), no round
  cs = plan["compile_set"]
  assert list(cs["rollout"]["groups"]) == ["rounds (streamed) (engine)"], cs["rollout"]
  assert cs["rollout"]["programs"] > 0 and "update" in cs["trainer"]["groups"]
  assert not [n for n in cs["trainer"]["groups"] if n.startswith(("sample_", "rounds"))]
  assert "rollout side's compile set" in async_split.format_split_plan(plan)
  # several rollout processes (2 hosts of v5p:2x4x2) sample step by step
  # (fbos_jax/rl/remote.py): one engine per round, none streamed
  meshes = async_split.split_meshes(c, hw.topology_devices("v5p:2x4x2"), 8)
  cs = async_split.split_compile_sets(c, plan_lib.plan_parts(c), meshes, {})
  assert list(cs["rollout"]["groups"]) == ["sample_round1 (engine)", "sample_round2 (engine)"]
  # with a periodic eval the trainer also samples (its engine beside the train state)
  c.train.eval_every, c.train.eval_prompts, c.train.eval_k = 5, 8, 2
  compiled.clear()
  plan = async_split.compile_split_plan(c, "v5p:2x2x1", 2)
  assert sorted(n for n, _ in compiled if not n.startswith("sample_")) == sorted(
      ["update"] + [f"{e}/{k}" for e in ("eval_greedy", "eval_sampled")
                    for k in plan_lib.ENGINE_KINDS])
  assert resident["eval_greedy/window"] > 0 and plan["fits"]  # the state held beside it
  monkeypatch.setattr(async_split.shapes_lib, "sampler_shapes", lambda *a, **k: {})
  with pytest.raises(RuntimeError, match="no program of the rollout side"):
    async_split.compile_split_plan(c, "v5p:2x2x1", 2)


@needs_libtpu
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_packed_update_compiles_with_splash_and_the_plan_prints_both_layouts():
  """rl.micro_batch_tokens: the packed update (segment ids through the splash
  kernel) compiles for 4 v5p chips and fits; the roofline prints the padded and
  the packed update's FLOPs and time, this run's marked, and the JSON line both."""
  c = small_real_heads()
  c.model.attention = "pallas"
  c.rl.micro_batches = 1
  c.rl.micro_batch_tokens = 2 * (64 + 32)
  plan = plan_lib.compile_plan(c, "v5p:2x2x1", search=False, only="update")
  rep = plan["programs"]["update"]
  assert list(plan["programs"]) == ["update"] and not rep.error, rep.error
  assert 0 < rep.peak <= hw.FIT_FRACTION * plan["hbm_bytes"]
  assert "packed rows x 96" in rep.what and "192 tokens per batch shard" in rep.what
  u = plan["roofline"]["update"]
  assert u["packed_this_run"] and u["total_s"] == u["packed_s"] and u["padded_s"] > 0
  text = plan_lib.format_compiled_plan(plan)
  padded_line = next(ln for ln in text.splitlines() if ln.strip().startswith("padded "))
  packed_line = next(ln for ln in text.splitlines() if ln.strip().startswith("packed "))
  assert "<- this run" in packed_line and "<- this run" not in padded_line
  assert "one step with the padded update" in text
  js = plan_lib.plan_json(plan)
  assert js["update_s"] == {"padded": u["padded_s"], "packed": u["packed_s"]}
