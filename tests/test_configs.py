"""Config files, validation messages and the dry-run memory plans."""

import os
import subprocess
import sys

import numpy as np
import pytest
from ml_collections import config_flags  # noqa: F401  (the loader launch/train.py uses)

import configs
from configs import load
from fbos_jax.planning.hardware import HBM_BYTES
from fbos_jax.planning.programs import memory_plan
from fbos_jax.rl.config import validate as validate_rl_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_8B_PARAMS = 8_190_735_360


ALL_TINY = ["configs/grpo.py:tiny", "configs/grpo.py:tiny,drgrpo", "configs/gfpo.py:tiny",
            "configs/gfpo.py:tiny,token_efficiency", "configs/gfpo.py:tiny,adaptive",
            "configs/golf.py:tiny", "configs/fbos.py:tiny", "configs/fcp.py:tiny",
            "configs/sft.py:tiny"]


@pytest.mark.parametrize("spec", ALL_TINY)
def test_every_tiny_config_builds_and_validates(spec):
  c = load(spec)
  validate_rl_config(c)
  assert c.variant == "tiny"


def test_unknown_variant_and_flavor_are_clear():
  with pytest.raises(ValueError, match="Unknown config variant 'huge'"):
    load("configs/fbos.py:huge")
  with pytest.raises(ValueError, match="flavor"):
    load("configs/grpo.py:tiny,nope")


def test_bad_rl_combinations_name_the_fields():
  c = load("configs/grpo.py:tiny")
  c.rl.group_size = 1
  with pytest.raises(ValueError, match="rl.group_size=1"):
    validate_rl_config(c)
  c = load("configs/gfpo.py:tiny")
  c.rl.gfpo_k = c.rl.group_size
  with pytest.raises(ValueError, match="rl.gfpo_k=16"):
    validate_rl_config(c)
  c = load("configs/fbos.py:tiny")
  c.data.verifier = "none"
  with pytest.raises(ValueError, match="data.verifier"):
    validate_rl_config(c)
  c = load("configs/fbos.py:tiny")
  with pytest.raises(ValueError, match="batch shards"):
    validate_rl_config(c, num_batch_shards=3)
  c = load("configs/grpo.py:tiny")
  c.rl.gfpo_k = 0
  validate_rl_config(c, num_batch_shards=8)


def test_qwen_8b_param_count_and_memory_plans():
  c = load("configs/fbos.py:qwen_8b")
  for n in (32, 64):
    plan = memory_plan(c, n)
    assert plan["param_count"] == QWEN3_8B_PARAMS
    total = plan["bytes_per_device"]["total_static"]
    assert total < HBM_BYTES["v5p"], (n, total)
    assert plan["bytes_per_device"]["params"] * n >= QWEN3_8B_PARAMS * 2  # bf16, sharded
  h100 = memory_plan(load("configs/fbos.py:qwen_8b_h100"), 16)
  assert h100["bytes_per_device"]["total_static"] < HBM_BYTES["h100"]
  assert h100["mesh"]["tensor"] == 8 and h100["mesh"]["dcn"] == 2


def test_mesh_that_does_not_divide_heads_is_rejected():
  c = load("configs/fbos.py:qwen_8b")
  with c.unlocked():
    c.mesh.tensor = 3
    c.mesh.fsdp = 1
    c.mesh.data = -1
  with pytest.raises(ValueError, match="does not divide"):
    memory_plan(c, 24)


def test_dry_run_cli_prints_plan():
  out = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/fbos.py:qwen_8b", "--dry_run",
       "--mesh_devices=32"], cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert "params: 8,190,735,360" in out.stdout
  assert "fsdp=8 x tensor=4 (32 devices)" in out.stdout
  # the sharded arrays only; whether it fits is the compiled plan's call (tests/test_plan.py)
  assert "of a v5p (95.74 GiB HBM)" in out.stdout and "--topology" in out.stdout


def test_cli_override_reaches_config():
  out = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/grpo.py:qwen3_0_6b", "--dry_run",
       "--mesh_devices=8", "--config.rl.group_size=16", "--config.mesh.tensor=2"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert "KV cache for 1024 rows" in out.stdout  # 64 prompts x 16
  assert "tensor=2" in out.stdout


def test_config_sharding_rules_are_the_library_default():
  """The rules have one home (fbos_jax/sharding.py); a config starts from them."""
  from fbos_jax import sharding as sh
  assert sh.rules_dict(load("configs/fbos.py:tiny").mesh.rules) == sh.rules_dict(sh.DEFAULT_RULES)


def test_the_batch_axes_come_from_the_rules():
  """mesh.rules' "batch" entry decides where the rows go: the batch spec, the
  shard count and the process-local placement all follow it."""
  import jax
  from jax.sharding import PartitionSpec as P
  from fbos_jax import sharding as sh
  c = load("configs/fbos.py:tiny")
  c.mesh.data, c.mesh.fsdp = 4, 2
  mesh = sh.make_mesh(c.mesh)
  rules = sh.rules_dict(c.mesh.rules)
  assert sh.batch_spec(2, rules=rules) == P(("dcn", "data", "fsdp"), None)
  assert sh.batch_shard_count(mesh, rules) == 8
  moved = dict(rules, batch=("data",))
  assert sh.batch_spec(2, rules=moved) == P(("data",), None)
  assert sh.batch_shard_count(mesh, moved) == 4
  x = sh.put_process_local(np.zeros((8, 3), np.float32), mesh, moved)
  assert x.sharding.spec == P(("data",), None)
  assert len({str(s.index) for s in x.addressable_shards}) == 4  # fsdp replicates, data splits


def test_one_loader_and_one_setter():
  """configs.load (tests, compare.py) gives what absl's --config gives, and
  set_field parses text as --config.a.b=v does, naming a field that does not exist."""
  c = configs.load("configs/fbos.py:tiny", {"rl.group_size": "16", "sampling.top_p": "0.9",
                                            "train.progress": "false",
                                            "sampling.prompt_buckets": "(16, 64)"})
  assert (c.rl.group_size, c.sampling.top_p, c.train.progress) == (16, 0.9, False)
  assert c.sampling.prompt_buckets == (16, 64)
  assert configs.load("fbos:tiny").to_dict() == load("configs/fbos.py:tiny").to_dict()
  with pytest.raises(KeyError, match="rl.no_such_field"):
    configs.set_field(c, "rl.no_such_field", 1)
  with pytest.raises(ValueError, match="rl.group_size='many'"):
    configs.set_field(c, "rl.group_size", "many")
  with pytest.raises(ValueError, match="unknown config file"):
    configs.load("configs/nope.py:tiny")


@pytest.mark.parametrize("variant", ["tiny", "tiny_hard"])
def test_equal_rollout_variants_sample_the_same_rollouts_per_step(variant):
  """On the comparison variants every algorithm samples the same rollouts per
  step (GFPO's group of 16 at half the prompts; FBOS and GOLF's two rounds at
  half the prompts). GFPO used to halve only on tiny: 256 against 128 on tiny_hard."""
  def rollouts(name):
    c = load(f"configs/{name}.py:{variant}")
    per_prompt = c.rl.group_size + (c.rl.round2_size if c.rl.round2 else 0)
    return c.rl.prompts_per_step * per_prompt
  counts = {name: rollouts(name) for name in ("grpo", "gfpo", "golf", "fbos")}
  assert len(set(counts.values())) == 1, counts
