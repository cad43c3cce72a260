"""Compile-for-topology plans (fbos_jax/plan.py): XLA's TPU compiler on this CPU.

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

from test_configs import load

from fbos_jax import plan as plan_lib
from fbos_jax.model import qwen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU, reason="XLA's TPU compiler is missing: pip install libtpu==0.0.42.1 "
    "(or pip install -r requirements-test.txt); no TPU is needed")


def small_real_heads(spec="configs/grpo.py:qwen3_0_6b"):
  """A 2-layer Qwen3 with Qwen3-0.6B's real head sizes and vocabulary, small step shapes."""
  c = load(spec)
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
    with pytest.raises(plan_lib.PlanError, match="accepted forms.*v5p:2x4x4"):
      plan_lib.topology_devices(bad)


def test_update_shapes_follow_the_config():
  c = load("configs/fbos.py:qwen_8b")
  c.rl.micro_batches = 8
  epa, ecc = plan_lib.update_shapes(c, batch_shards=8)
  # P * (n + epa_max_per_prompt) rows on q; P * m rows on the FAPs
  assert (epa.rows, epa.prompt_len, epa.response_len) == (64 * (8 + 8), 2048, 512)
  assert (ecc.rows, ecc.prompt_len) == (64 * 8, 4096)
  g = load("configs/grpo.py:qwen_8b")
  epa, ecc = plan_lib.update_shapes(g, batch_shards=8)
  assert epa.rows == 64 * 8 and ecc.rows == 8 * g.rl.micro_batches  # ECC off: one masked row


def test_analytic_flops_counts_the_obvious_cases():
  mc = qwen.ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                        num_kv_heads=2, head_dim=16, vocab_size=100)
  trunk = 2 * (64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + 3 * 64 * 128)
  one = plan_lib.analytic_flops(mc, kind="logprob", rows=1, seq=1, response_len=1)
  assert one == 2 * trunk + 4 * 2 * 4 * 16 * 1 + 2 * 64 * 100
  fwd = plan_lib.analytic_flops(mc, kind="logprob", rows=3, seq=10, response_len=4)
  assert plan_lib.analytic_flops(mc, kind="train", rows=3, seq=10, response_len=4) == 3 * fwd


# ---------------------------------------------------------------- the compiler


@needs_libtpu
def test_cost_analysis_counts_a_loop_body_once():
  """Why the plan carries analytic FLOPs: XLA counts a scan body once."""
  devs = plan_lib.topology_devices("v5p:2x2x1")
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
  v5p = plan_lib.hbm_bytes(plan_lib.topology_devices("v5p:2x2x1")[0])
  v5e = plan_lib.hbm_bytes(plan_lib.topology_devices("v5e:2x4")[0])
  assert 90 * plan_lib.GiB < v5p < 96 * plan_lib.GiB
  assert 15 * plan_lib.GiB < v5e <= 16 * plan_lib.GiB


@needs_libtpu
def test_mesh_that_does_not_match_the_topology_names_both_numbers():
  c = small_real_heads()
  c.mesh.fsdp = 1
  c.mesh.tensor = 3
  c.mesh.data = 1
  with pytest.raises(plan_lib.PlanError, match=r"3.*4 devices|4 devices.*3"):
    plan_lib.target_mesh(c, plan_lib.topology_devices("v5p:2x2x1"), "v5p:2x2x1")


@needs_libtpu
def test_real_head_sizes_compile_and_fit_on_v5p():
  """A 2-layer Qwen3 with real head sizes (and the 151,936-word vocabulary):
  the round-1 sampler and the update compile for 4 v5p chips and fit."""
  c = small_real_heads()
  plan = plan_lib.compile_plan(c, "v5p:2x2x1", search=False)
  assert set(plan["programs"]) == {"sample_round1", "update"}
  for name, rep in plan["programs"].items():
    assert not rep.error, (name, rep.error)
    assert 0 < rep.peak <= plan_lib.FIT_FRACTION * plan["hbm_bytes"], name
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
  devs = plan_lib.topology_devices("v5e:2x4")
  mesh = plan_lib.target_mesh(c, devs)
  prog = next(p for p in plan_lib.step_programs(c, mesh) if p.name == "update")
  rep = plan_lib.compile_program(prog, mesh)
  hbm = plan_lib.hbm_bytes(devs[0])
  assert rep.error or rep.peak > plan_lib.FIT_FRACTION * hbm
  assert rep.temp > hbm  # the compiler's figure is kept even when it refuses
  assert "rl.micro_batches" in rep.knobs


@needs_libtpu
def test_dry_run_cli_bad_topology_and_json_line():
  env = dict(os.environ, PYTHONPATH=ROOT)
  bad = subprocess.run([sys.executable, "launch/train.py", "--config=configs/grpo.py:tiny",
                        "--dry_run", "--topology=v5p-32"], cwd=ROOT, env=env,
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
def test_real_head_sizes_compile_for_h100s():
  """The same small real-head model on one 8xH100 node (tensor parallel 8):
  compiled by XLA's GPU compiler from a target description, no GPU."""
  c = small_real_heads("configs/grpo.py:qwen_8b_h100")
  c.model.num_layers = 2
  plan = plan_lib.compile_plan(c, "h100:1x8", search=False)
  assert plan["chip"] == "NVIDIA H100 SXM" and plan["num_devices"] == 8
  assert plan["fit_fraction"] == plan_lib.GPU_FIT_FRACTION
  for name, rep in plan["programs"].items():
    assert not rep.error and 0 < rep.peak <= 0.75 * plan["hbm_bytes"], name
