"""Mesh sharding on 8 fake CPU devices (tests/conftest.py): data=2 x fsdp=2 x tensor=2.

The sharded jitted forward equals the single-device forward; a checkpoint imported
with a mesh lands directly in the sharding the logical rules ask for; mesh
validation errors are clear.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open

from fbos_jax import sharding as shd
from fbos_jax.model import (ModelConfig, abstract_params, load_hf_params, param_logical_axes,
                            save_hf_checkpoint)
from fbos_jax.model import apply as model_apply

MESH_2x2x2 = {"dcn": 1, "data": 2, "fsdp": 2, "tensor": 2}


@pytest.fixture(scope="module")
def mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  m = shd.make_mesh(MESH_2x2x2, jax.devices()[:8])
  assert dict(m.shape) == MESH_2x2x2
  return m


def param_specs(cfg, mesh, rules=shd.DEFAULT_RULES):
  return shd.tree_specs(param_logical_axes(cfg), rules, abstract_params(cfg), mesh)


def random_params(cfg, seed=0):
  """Random params (numpy, no per-leaf jax compiles): norms around 1, biases around 0."""
  rng = np.random.default_rng(seed)
  shapes, treedef = jax.tree.flatten_with_path(abstract_params(cfg))
  out = []
  for path, a in shapes:
    name = path[-1].key
    noise = rng.standard_normal(a.shape).astype(np.float32)
    out.append(1.0 + 0.3 * noise if name.endswith("norm") else
               (0.2 if name.endswith("bias") else 0.1) * noise)
  return jax.tree.unflatten(treedef, out)


@pytest.mark.parametrize("model_type,tie", [("qwen3", True), ("qwen2", False)])
def test_sharded_forward_matches_single_device(mesh, model_type, tie):
  cfg = ModelConfig(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=tie)
  params = random_params(cfg)
  rng = np.random.default_rng(0)
  b, t = 8, 12
  tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  lengths = rng.integers(2, t + 1, b)
  mask = (np.arange(t)[None] >= (t - lengths)[:, None]).astype(np.int32)  # left padded

  fwd = jax.jit(model_apply, static_argnums=3)
  dev0 = jax.devices()[0]
  single = np.asarray(fwd(jax.device_put(params, dev0), jax.device_put(tokens, dev0),
                          jax.device_put(mask, dev0), cfg))

  specs = param_specs(cfg, mesh)
  sharded_params = jax.device_put(params, shd.tree_shardings(mesh, specs))
  q = sharded_params["layers"]["q"]
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)
  assert q.addressable_shards[0].data.shape == (2, 32, 2, 16)
  batch = NamedSharding(mesh, shd.batch_spec(2, mesh, b))
  assert batch.spec == P(("data", "fsdp"), None)
  tok_s, mask_s = jax.device_put(tokens, batch), jax.device_put(mask, batch)
  out = fwd(sharded_params, tok_s, mask_s, cfg)
  assert len(out.sharding.device_set) == 8
  out = np.asarray(out)
  real = mask.astype(bool)
  assert np.abs(single[real]).max() > 0.5
  np.testing.assert_allclose(out[real], single[real], atol=1e-5, rtol=0)
  np.testing.assert_allclose(out, single, atol=1e-5, rtol=0)


def _save_tiny_qwen2(path, vocab=100):
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.randn(p.shape))  # distinct values everywhere, biases and norms included
  model.save_pretrained(path, max_shard_size="60KB")


def test_import_with_mesh_places_each_param(mesh, tmp_path):
  _save_tiny_qwen2(tmp_path)
  ref, cfg = load_hf_params(tmp_path)  # single device
  assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(ref))
  params, cfg2 = load_hf_params(tmp_path, mesh=mesh)
  assert cfg2 == cfg
  specs = param_specs(cfg, mesh)
  # The rules, spelled out for the interesting ones.
  expect = {
      ("embed",): P("tensor", "fsdp"),
      ("unembed",): P("fsdp", "tensor"),
      ("layers", "q"): P(None, "fsdp", "tensor", None),
      ("layers", "k"): P(None, "fsdp", "tensor", None),
      ("layers", "o"): P(None, "tensor", None, "fsdp"),
      ("layers", "q_bias"): P(None, "tensor", None),
      ("layers", "gate"): P(None, "fsdp", "tensor"),
      ("layers", "down"): P(None, "tensor", "fsdp"),
  }
  flat = dict(jax.tree.flatten_with_path(params)[0])
  flat_specs = dict(jax.tree.flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0])
  flat_ref = dict(jax.tree.flatten_with_path(ref)[0])
  assert set(flat) == set(flat_ref)
  for kp, x in flat.items():
    key = tuple(k.key for k in kp)
    spec = flat_specs[kp]
    if key in expect:
      assert spec == expect[key], key
    assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh, key
    assert x.sharding.spec == spec, key
    want_shard = shd.shard_shape(x.shape, spec, mesh)
    assert len(x.addressable_shards) == 8
    full = np.asarray(flat_ref[kp])
    for s in x.addressable_shards:
      assert s.data.shape == want_shard, key
      np.testing.assert_array_equal(np.asarray(s.data), full[s.index], err_msg=str(key))
  # Export from the sharded params gathers one tensor at a time: same tensors, bit for bit.
  save_hf_checkpoint(params, cfg, tmp_path / "out")
  for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
               "model.layers.1.self_attn.v_proj.bias", "lm_head.weight",
               "model.embed_tokens.weight"):
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as h:
      got = h.get_tensor(name)
    src = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(tmp_path / src), framework="numpy") as h:
      np.testing.assert_array_equal(got, h.get_tensor(name), err_msg=name)
  # per-device bytes are a fraction of the model
  total = sum(x.nbytes for x in flat.values())
  on_dev0 = sum(s.data.nbytes for x in flat.values() for s in x.addressable_shards
                if s.device == mesh.devices.flat[0])
  assert on_dev0 < total / 3


def test_import_with_mesh_uneven_vocab_falls_back_to_replication(mesh, tmp_path):
  """vocab 101 is not divisible by tensor=2: fit_spec drops that axis, import still works."""
  _save_tiny_qwen2(tmp_path, vocab=101)
  params, cfg = load_hf_params(tmp_path, mesh=mesh, dtype="bfloat16")
  assert cfg.param_dtype == "bfloat16" and params["embed"].dtype == jnp.bfloat16
  assert params["embed"].sharding.spec == P(None, "fsdp")
  assert params["embed"].addressable_shards[0].data.shape == (101, 32)
  ref, _ = load_hf_params(tmp_path, dtype="bfloat16")
  np.testing.assert_array_equal(np.asarray(params["unembed"]), np.asarray(ref["unembed"]))


def test_mesh_axes_must_multiply_to_device_count(mesh):  # (mesh: skips without 8 devices)
  with pytest.raises(shd.ShardingError, match=r"multiply to 12.*8 devices"):
    shd.make_mesh({"dcn": 1, "data": 3, "fsdp": 2, "tensor": 2}, jax.devices()[:8])
  with pytest.raises(shd.ShardingError, match="does not divide"):
    shd.make_mesh({"data": -1, "fsdp": 3, "tensor": 1}, jax.devices()[:8])
  m = shd.make_mesh({"data": -1, "fsdp": 2, "tensor": 2}, jax.devices()[:8])
  assert dict(m.shape) == MESH_2x2x2


def test_heads_not_divisible_by_tensor_axis(mesh):
  cfg = ModelConfig(num_heads=3, num_kv_heads=3, head_dim=16, hidden_size=48)
  spec = shd.logical_to_spec(("layers", "embed", "heads", "head_dim"), shd.DEFAULT_RULES)
  with pytest.raises(shd.ShardingError) as e:
    shd.check_divisible("layers/q", (cfg.num_layers, 48, 3, 16), spec, mesh,
                        "Set model.num_heads to a multiple of mesh.tensor.")
  msg = str(e.value)
  assert "layers/q" in msg and "size 3" in msg and "tensor" in msg and "num_heads" in msg
  # (the first offending leaf in tree order is layers/k: 3 kv heads over tensor=2)
  with pytest.raises(shd.ShardingError, match=r"\['layers'\]\['k'\].*size 3.*tensor"):
    shd.tree_specs(param_logical_axes(cfg), shd.DEFAULT_RULES, abstract_params(cfg), mesh,
                   strict=True)


def test_import_with_custom_rules_splitting_head_dim(mesh, tmp_path):
  """Sharding inside a fused HF dim (q_proj rows = heads x head_dim) reads the right slices."""
  _save_tiny_qwen2(tmp_path)
  rules = dict(shd.rules_dict(shd.DEFAULT_RULES), heads=None, kv_heads=None,
               head_dim=("tensor", "data"), embed=None, mlp="fsdp")
  params, _ = load_hf_params(tmp_path, mesh=mesh, rules=list(rules.items()))
  ref, _ = load_hf_params(tmp_path)
  assert params["layers"]["q"].sharding.spec == P(None, None, None, ("tensor", "data"))
  assert params["layers"]["o"].sharding.spec == P(None, None, ("tensor", "data"), None)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
