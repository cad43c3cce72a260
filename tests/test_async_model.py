"""The faithful model of the asynchronous split (issue 31, item 5): analytic, nothing compiled.

``hardware.continuous_estimate`` drained (today's model: each call ends with its
longest row) and never drained, the decode step's cost (``hardware.DecodeCost``:
a fixed cost and FSDP weight gathers beside the roofline's bytes and FLOPs), and
``async_split.split_model``'s choice of the rollout mesh.
"""

import importlib.util

import jax.numpy as jnp
import pytest

from configs import load
from fbos_jax import sampling
from fbos_jax import sharding as sh
from fbos_jax.engine import EngineConfig
from fbos_jax.model import qwen
from fbos_jax.planning import hardware as hw
from fbos_jax.rl import shapes

V5P = hw.CHIP_SPECS["TPU v5"]
MC = qwen.ModelConfig(model_type="qwen3", vocab_size=1024, hidden_size=256,
                      intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=64, param_dtype="bfloat16", compute_dtype="bfloat16")
ONE = sh.make_abstract_mesh({"dcn": 1, "data": 1, "fsdp": 1, "tensor": 1}, 1)


def _call(slots, rows_prompts=64, n=4):
  scfg = sampling.SamplingConfig(max_new_tokens=1000, prompt_buckets=(64,))
  return shapes.EngineShape(rows_prompts, n, scfg, EngineConfig(slots=slots))


@pytest.mark.parametrize("lengths", [hw.ResponseLengths(0.5, 0.5), hw.ResponseLengths(0.25, 1.0),
                                     hw.ResponseLengths(0.1, 1.0)])
@pytest.mark.parametrize("slots", [16, 64, 256])
def test_continuous_generation_is_never_slower_than_drained(lengths, slots):
  """Never draining, the slots stay busy: total tokens / slots steps, never more
  than a drained call's (whose longest rows decide its tail); equal when every row
  has the same length and the slots divide the rows; shorter under a long tail."""
  cost = hw.DecodeCost(fixed_s=1e-3)
  est = {d: hw.continuous_estimate(MC, ONE, V5P, _call(slots), lengths, cost=cost, drain=d)
         for d in (True, False)}
  assert est[False]["total_s"] <= est[True]["total_s"] * (1 + 1e-9)
  assert est[False]["slot_util"] == 1.0
  if lengths.median_fraction == lengths.p99_fraction:
    assert est[False]["total_s"] == pytest.approx(est[True]["total_s"], rel=1e-6)
  elif slots == 256:  # one slot per row: the drained call runs to the longest row
    assert est[False]["decode_s"] < 0.6 * est[True]["decode_s"]


def test_decode_step_is_the_roofline_plus_a_fixed_cost():
  """With no fixed cost on a 1-device mesh the step is the old roofline formula,
  max((weights + KV) / HBM bandwidth, FLOPs / peak) (no gather on one device, even
  with an ICI bandwidth given); a fixed cost adds itself."""
  rows, ctx = 64.0, 700.0
  w = qwen.count_params(qwen.abstract_params(MC)) * 2  # bf16
  kv = rows * ctx * 2 * MC.num_layers * MC.num_kv_heads * MC.head_dim * 2
  old = max((w + kv) / V5P.hbm_bandwidth,
            hw.decode_flops(MC, rows, ctx) / V5P.peak_bf16_flops)
  for cost in (hw.DecodeCost(), hw.DecodeCost(0.0, 3e11)):
    got, bound = hw._step_time(MC, ONE, V5P, 1, rows, rows, ctx, cost)  # pylint: disable=protected-access
    assert got == pytest.approx(old, rel=1e-12) and bound in ("memory", "compute")
  got, _ = hw._step_time(MC, ONE, V5P, 1, rows, rows, ctx, hw.DecodeCost(2e-3))  # pylint: disable=protected-access
  assert got == pytest.approx(old + 2e-3, rel=1e-12)
  # drained on one device at no fixed cost: steps x that step + the prefill (today's model)
  est = hw.continuous_estimate(MC, ONE, V5P, _call(64), hw.RESPONSE_LENGTHS)
  per, _ = hw._step_time(MC, ONE, V5P, 1, 64, 64 * est["slot_util"],  # pylint: disable=protected-access
                         64 + float(sum(x * x for x in hw.RESPONSE_LENGTHS.sample(256, 1000)))
                         / (2 * float(sum(hw.RESPONSE_LENGTHS.sample(256, 1000)))))
  assert est["step_s"] == pytest.approx(per, rel=1e-9)
  assert est["total_s"] == pytest.approx(est["prefill_s"] + est["steps"] * per, rel=1e-9)


def test_weight_bytes_per_chip_follow_tensor_and_fsdp():
  """A chip reads 1 / tensor of the weights; FSDP-sharded, it first gathers the
  (fsdp - 1) / fsdp of that share it does not hold; ``data`` replicates (no gather).
  On a multi-device FSDP mesh, a slow enough ICI makes the gather the bound."""
  w = qwen.count_params(qwen.abstract_params(MC)) * 2
  assert hw.decode_weight_bytes(MC, {"data": 4, "fsdp": 1, "tensor": 2}) == (w / 2, 0.0)
  assert hw.decode_weight_bytes(MC, {"data": 1, "fsdp": 4, "tensor": 2}) == (w / 2, w / 2 * 3 / 4)
  fsdp = sh.make_abstract_mesh({"dcn": 1, "data": 1, "fsdp": 8, "tensor": 1}, 8)
  t, bound = hw._step_time(MC, fsdp, V5P, 8, 8, 8, 10.0, hw.DecodeCost(0.0, 1e6))  # pylint: disable=protected-access
  assert bound == "weight gather" and t == pytest.approx(w * 7 / 8 / 1e6)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_split_model_chooses_the_decode_mesh_and_never_drains():
  """qwen_8b_long on v5p:2x4x4 (analytic): for every split the chosen rollout mesh
  moves the fewest weight bytes per decode step among the valid ones (not the
  config's fsdp 8 x tensor 2); continuous generation is never slower than drained;
  each async step is max(rollout, update + sync); the best split is one the run
  accepts (16 / 16 over 8 hosts)."""
  from fbos_jax.planning import async_split
  m = async_split.split_model(load("configs/fbos.py:qwen_8b_long"), "v5p:2x4x4")
  timed = [r for r in m["rows"] if "weight_s_per_step" in r]
  assert timed and m["update"] == "packed"
  for r in timed:
    assert r["rollout_continuous_s"] <= r["rollout_drained_s"]
    assert r["async_packed_s"] == max(r["rollout_continuous_s"],
                                      r["train_packed_s"] + r["sync_s"])
  for n in {r["rollout_devices"] for r in timed}:
    valid = [r for r in timed if r["rollout_devices"] == n and "invalid" not in r]
    chosen = [r for r in valid if r.get("chosen")]
    if valid:
      assert len(chosen) == 1
      assert chosen[0]["weight_s_per_step"] == min(r["weight_s_per_step"] for r in valid)
  n16 = next(r for r in timed if r["rollout_devices"] == 16 and r.get("chosen"))
  config_mesh = next(r for r in timed if r["rollout_devices"] == 16 and r["rollout_mesh"] == "1x8x2")
  assert n16["weight_s_per_step"] < config_mesh["weight_s_per_step"]
  assert m["best"] is not None and m["best"]["rollout_devices"] == 16 and not m["best"]["refused"]
