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

from configs import load
from fbos_jax import hardware as hw
from fbos_jax import plan as plan_lib
from fbos_jax import sharding as sh
from fbos_jax.model import qwen
from fbos_jax.rl import shapes

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
def test_real_head_sizes_compile_for_h100s():
  """The same small real-head model on one 8xH100 node (tensor parallel 8):
  compiled by XLA's GPU compiler from a target description, no GPU."""
  c = small_real_heads("configs/grpo.py:qwen_8b_h100")
  c.model.num_layers = 2
  plan = plan_lib.compile_plan(c, "h100:1x8", search=False)
  assert plan["chip"] == "NVIDIA H100 SXM" and plan["num_devices"] == 8
  assert plan["fit_fraction"] == hw.GPU_FIT_FRACTION
  for name, rep in plan["programs"].items():
    assert not rep.error and 0 < rep.peak <= 0.75 * plan["hbm_bytes"], name
