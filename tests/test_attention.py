"""Attention implementations (fbos_jax/model/attention.py): blocked and pallas
(interpret mode) against the dense reference, forward and gradients, for the
training masks and the cache prefill layout with GQA; the ``auto`` choice; and
a compile of a 2-layer Qwen3 with real head sizes for a TPU v5p topology.

The TPU tests need libtpu (XLA's TPU compiler, no TPU): `pip install
libtpu==0.0.42.1` (or `pip install -r requirements-test.txt`); without it they
are skipped.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fbos_jax import sharding as sh
from fbos_jax.model import attention as A
from fbos_jax.model import qwen

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU, reason="XLA's TPU compiler is missing: pip install libtpu==0.0.42.1 "
    "(or pip install -r requirements-test.txt); no TPU is needed")
TOL = 1e-5


def _tpu_devices():
  from jax.experimental import topologies
  return topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices


def _inputs(seed, b, t, h, kv, dh, s=None, cache_layout=False):
  rng = np.random.default_rng(seed)
  s = s or t
  q = jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.float32)
  if cache_layout:
    k = jnp.asarray(rng.normal(size=(b, kv, dh, s)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, kv, s, dh)), jnp.float32)
  else:
    k = jnp.asarray(rng.normal(size=(b, s, kv, dh)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kv, dh)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.float32)
  return q, k, v, w


def _training_mask(b, t, left, right):
  """[B, T] 1/0: row r has left[r] pad slots before (prompt) and right[r] after (response)."""
  m = np.ones((b, t), np.int32)
  for r in range(b):
    m[r, :left[r]] = 0
    m[r, t - right[r]:] = 0
  return jnp.asarray(m)


def _value_and_grads(fn, q, k, v, kv_valid, q_valid, w, q_offset):
  """Output and d(sum(out * w over real query rows))/d(q, k, v), jitted."""
  def loss(q, k, v, off):
    out = fn(q, k, v, kv_valid, q_offset=off)
    return jnp.sum(out * w * q_valid[:, :, None, None]), out

  static = isinstance(q_offset, int)
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
              static_argnums=(3,) if static else ())
  (_, out), grads = f(q, k, v, q_offset if static else jnp.int32(q_offset))
  return out, grads


def _assert_matches_dense(fn, q, k, v, kv_valid, q_valid, w, *, q_offset=0, cache_layout=False):
  ref = lambda *a, **kw: A.dense(*a, cache_layout=cache_layout, **kw)
  got = lambda *a, **kw: fn(*a, cache_layout=cache_layout, **kw)
  out_r, grads_r = _value_and_grads(ref, q, k, v, kv_valid, q_valid, w, q_offset)
  out, grads = _value_and_grads(got, q, k, v, kv_valid, q_valid, w, q_offset)
  real = np.asarray(q_valid, bool)
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(out_r)[real], atol=TOL, rtol=0)
  for name, g, g_r in zip("qkv", grads, grads_r):
    assert np.all(np.isfinite(np.asarray(g))), f"d{name} not finite"
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_r), atol=TOL, rtol=0,
                               err_msg=f"d{name}")


def _prefill_mask(b, s, offset, t, left):
  """kv_mask [B, S] of a prefill: slots < offset + t filled, row r left-padded by left[r]."""
  m = np.zeros((b, s), np.int32)
  m[:, :offset + t] = 1
  for r in range(b):
    m[r, :left[r]] = 0
  return jnp.asarray(m)


# ------------------------------------------------------------------ blocked vs dense


@pytest.mark.parametrize("block_q,block_kv", [(16, 8), (8, 16)])
def test_blocked_matches_dense_training_masks_gqa(block_q, block_kv):
  # T=45 is not a multiple of either block: padded query rows and key slots too
  b, t, h, kv, dh = 3, 45, 4, 2, 16
  q, k, v, w = _inputs(0, b, t, h, kv, dh)
  mask = _training_mask(b, t, left=[5, 0, 12], right=[7, 0, 3])
  fn = lambda *a, **kw: A.blocked(*a, block_q=block_q, block_kv=block_kv, **kw)
  _assert_matches_dense(fn, q, k, v, mask, mask, w)


@pytest.mark.parametrize("offset,traced", [(0, False), (7, True)])
def test_blocked_matches_dense_cache_prefill(offset, traced):
  # cache layout (k transposed), queries in slots [offset, offset + T), slots past
  # the prompt empty; a traced cache_index is supported (dynamic loop bounds)
  b, t, s, h, kv, dh = 3, 20, 53, 4, 2, 16
  q, k, v, w = _inputs(1, b, t, h, kv, dh, s=s, cache_layout=True)
  kv_mask = _prefill_mask(b, s, offset, t, left=[4, offset + 2, 0])
  q_valid = kv_mask[:, offset:offset + t]
  fn = lambda *a, **kw: A.blocked(*a, block_q=8, block_kv=16, **kw)
  _assert_matches_dense(fn, q, k, v, kv_mask, q_valid, w,
                        q_offset=jnp.int32(offset) if traced else offset, cache_layout=True)


def test_blocked_does_not_hold_the_score_matrix_in_forward_or_backward():
  # CPU compile of forward+backward: dense holds [B, K, G, T, T] float32 scores
  # (and probabilities) for the backward; blocked holds a few [.., 128, 128] tiles.
  b, t, h, kv, dh = 1, 2048, 4, 2, 32
  shapes = (jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32),
            jax.ShapeDtypeStruct((b, t, kv, dh), jnp.float32),
            jax.ShapeDtypeStruct((b, t, kv, dh), jnp.float32),
            jax.ShapeDtypeStruct((b, t), jnp.int32))

  def temp_bytes(fn):
    loss = lambda q, k, v, m: jnp.sum(fn(q, k, v, m))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  scores = b * h * t * t * 4  # one float32 score tensor: 64 MiB
  dense = temp_bytes(A.dense)
  blocked = temp_bytes(lambda *a: A.blocked(*a, block_q=128, block_kv=128))
  assert dense >= scores
  assert blocked < scores / 8, (blocked, scores)


# ------------------------------------------------------------------ packed rows (segment ids)


def _segment_runs(segs):
  """[(row, segment id, start, end)] of the contiguous non-zero runs of segs [B, T]."""
  out = []
  for r, row in enumerate(np.asarray(segs)):
    start = 0
    for i in range(1, len(row) + 1):
      if i == len(row) or row[i] != row[start]:
        if row[start]:
          out.append((r, int(row[start]), start, i))
        start = i
  return out


PACKED_CASES = {  # impl: (fn, per-row segment lengths (then padding), T)
    "dense": (A.dense, [[12, 20, 9], [30, 15]], 45),
    "blocked": (lambda *a, **kw: A.blocked(*a, block_q=16, block_kv=8, **kw),
                [[12, 20, 9], [30, 15]], 45),
    "pallas": (lambda *a, **kw: A.pallas(*a, block_q=128, block_kv=128, interpret=True, **kw),
               [[70, 100, 20], [130, 70]], 200),
}


@pytest.mark.parametrize("impl", list(PACKED_CASES))
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_packed_segments_never_attend_across(impl):
  """A row packing several sequences (segment ids, padding at the end) gives, at
  every token of every sequence, the output and the q/k/v gradients that the
  sequence gives alone: nothing is attended across a segment, nothing within
  one is missed. Then changing one sequence's keys/values leaves the others'
  outputs bit-identical."""
  fn, lengths, t = PACKED_CASES[impl]
  b, h, kv, dh = len(lengths), 4, 2, 32 if impl == "pallas" else 16
  segs = np.zeros((b, t), np.int32)
  for r, ls in enumerate(lengths):
    segs[r, :sum(ls)] = np.repeat(np.arange(1, len(ls) + 1), ls)
  q, k, v, w = _inputs(7, b, t, h, kv, dh)
  valid = jnp.asarray(segs > 0, jnp.int32)

  def loss(q, k, v, seg):
    out = fn(q, k, v, (seg > 0).astype(jnp.int32), segment_ids=seg)
    return jnp.sum(out * w * (seg > 0)[:, :, None, None]), out

  vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, out), grads = vg(q, k, v, jnp.asarray(segs))
  runs = _segment_runs(segs)
  assert len(runs) == sum(map(len, lengths))
  for r, _, a, e in runs:
    sl = lambda x: x[r:r + 1, a:e]
    ones = jnp.ones((1, e - a), jnp.int32)
    ref = lambda q, k, v: jnp.sum(A.dense(q, k, v, ones) * sl(w))
    out_ref = A.dense(sl(q), sl(k), sl(v), ones)
    g_ref = jax.grad(ref, argnums=(0, 1, 2))(sl(q), sl(k), sl(v))
    np.testing.assert_allclose(np.asarray(out)[r, a:e], np.asarray(out_ref)[0], atol=TOL, rtol=0)
    for name, g, gr in zip("qkv", grads, g_ref):
      np.testing.assert_allclose(np.asarray(g)[r, a:e], np.asarray(gr)[0], atol=TOL, rtol=0,
                                 err_msg=f"d{name} of segment at row {r} [{a}, {e})")
  # another sequence's keys and values cannot reach this one's outputs
  r, _, a, e = runs[0]
  k2 = k.at[r, a:e].add(5.0)
  v2 = v.at[r, a:e].add(5.0)
  (_, out2), _ = vg(q, k2, v2, jnp.asarray(segs))
  others = np.asarray(valid, bool).copy()
  others[r, a:e] = False
  np.testing.assert_array_equal(np.asarray(out2)[others], np.asarray(out)[others])
  assert not np.allclose(np.asarray(out2)[r, a + 1:e], np.asarray(out)[r, a + 1:e])


def test_positions_restart_per_segment():
  segs = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 2]])
  np.testing.assert_array_equal(np.asarray(qwen.positions_from_segments(segs)),
                                [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0]])


# ------------------------------------------------------------------ pallas (interpret) vs dense


def test_pallas_interpret_matches_dense_training_masks_gqa():
  # T=200: two 128-row query blocks, the second partly padding
  b, t, h, kv, dh = 2, 200, 4, 2, 32
  q, k, v, w = _inputs(2, b, t, h, kv, dh)
  mask = _training_mask(b, t, left=[5, 0], right=[70, 9])
  fn = lambda *a, **kw: A.pallas(*a, block_q=128, block_kv=128, interpret=True, **kw)
  _assert_matches_dense(fn, q, k, v, mask, mask, w)


@pytest.mark.parametrize("offset", [0, pytest.param(5, marks=pytest.mark.slow)])
def test_pallas_interpret_matches_dense_cache_prefill(offset):
  b, t, s, h, kv, dh = 2, 130, 300, 4, 2, 32
  q, k, v, w = _inputs(3, b, t, h, kv, dh, s=s, cache_layout=True)
  kv_mask = _prefill_mask(b, s, offset, t, left=[3, offset + 10])
  q_valid = kv_mask[:, offset:offset + t]
  fn = lambda *a, **kw: A.pallas(*a, block_q=128, block_kv=128, interpret=True, **kw)
  _assert_matches_dense(fn, q, k, v, kv_mask, q_valid, w, q_offset=offset, cache_layout=True)


def test_pallas_needs_a_static_cache_index():
  q, k, v, _ = _inputs(4, 1, 4, 2, 1, 8, s=8, cache_layout=True)
  with pytest.raises(ValueError, match="model.attention"):
    jax.jit(lambda off: A.pallas(q, k, v, jnp.ones((1, 8)), q_offset=off,
                                 cache_layout=True, interpret=True))(jnp.int32(0))


# ------------------------------------------------------------------ selection


def test_choose_without_a_mesh():
  assert A.choose("auto", 160, 160) == "dense"  # the tiny run: one tile
  assert A.choose("auto", 512, 512) == "dense"
  assert A.choose("auto", 513, 513) == "blocked"  # no mesh: never an unpartitionable kernel
  assert A.choose("auto", 1, 10_000) == "dense"  # decode step
  assert A.choose("pallas", 1, 10_000) == "dense"
  assert A.choose("pallas", 4096, 4096) == "pallas"
  assert A.choose("dense", 4096, 4096) == "dense"
  with pytest.raises(ValueError, match="model.attention"):
    A.choose("flash", 4096, 4096)
  seen = []  # a traced cache_index: no static causal mask for the kernel

  def trace(off):
    seen.append(A.choose("auto", 1024, 4096, q_offset=off))
    return off

  jax.make_jaxpr(trace)(jnp.int32(3))
  assert seen == ["blocked"]


def test_choose_reads_the_platform_of_the_mesh_in_context():
  cpu = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 2, 2, 2), sh.MESH_AXES)
  with jax.set_mesh(cpu):
    assert A.mesh_platform() == "cpu"
    assert A.choose("auto", 4096, 4096) == "blocked"
    assert A.choose("auto", 64, 64) == "dense"
  abstract = jax.sharding.AbstractMesh((2, 2), ("fsdp", "tensor"))
  with jax.sharding.use_abstract_mesh(abstract):
    assert A.mesh_platform() is None
    assert A.choose("auto", 4096, 4096) == "platform"


@needs_libtpu
def test_choose_pallas_under_a_tpu_mesh_although_the_backend_is_cpu():
  assert jax.default_backend() == "cpu"
  mesh = Mesh(np.asarray(_tpu_devices()).reshape(1, 1, 2, 2), sh.MESH_AXES)
  with jax.set_mesh(mesh):
    assert A.mesh_platform() == "tpu"
    assert A.choose("auto", 4096, 4096) == "pallas"
    assert A.choose("auto", 1, 4096) == "dense"


def test_auto_under_a_deviceless_mesh_runs_blocked_on_cpu():
  # lax.platform_dependent: lowered for CPU, only the blocked branch is compiled, and it runs
  b, t, h, kv, dh = 2, 256, 4, 2, 16
  q, k, v, w = _inputs(5, b, t, h, kv, dh)
  mask = _training_mask(b, t, left=[3, 0], right=[0, 20])

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v, mask) * w * mask[:, :, None, None])

  auto = lambda *a: A.attention(*a, impl="auto", block_q=128, block_kv=128)
  fn = jax.jit(jax.grad(loss(auto), argnums=(0, 1, 2)))
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2, 2), ("fsdp", "tensor"))):
    lowered = fn.lower(q, k, v)
  assert "tpu_custom_call" not in lowered.as_text()
  got = lowered.compile()(q, k, v)
  ref = jax.jit(jax.grad(loss(A.dense), argnums=(0, 1, 2)))(q, k, v)
  for name, g, r in zip("qkv", got, ref):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=TOL, rtol=0, err_msg=name)


@needs_libtpu
def test_auto_under_a_deviceless_mesh_lowers_pallas_for_tpu():
  b, t, h, kv, dh = 2, 256, 4, 2, 128
  devices = _tpu_devices()
  mesh = Mesh(np.asarray(devices).reshape(2, 2), ("fsdp", "tensor"))
  s4 = NamedSharding(mesh, P("fsdp", None, "tensor"))
  s2 = NamedSharding(mesh, P("fsdp"))
  args = (jax.ShapeDtypeStruct((b, t, h, dh), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, t, kv, dh), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, t, kv, dh), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, t), jnp.int32))
  loss = lambda q, k, v, m: jnp.sum(
      A.attention(q, k, v, m, impl="auto", block_q=128, block_kv=128).astype(jnp.float32))
  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(s4, s4, s4, s2))
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2, 2), ("fsdp", "tensor"))):
    lowered = fn.lower(*args)
  assert "tpu_custom_call" in lowered.compile().as_text()


def test_model_config_validates_attention_fields():
  with pytest.raises(ValueError, match="model.attention="):
    qwen.ModelConfig(attention="flash")
  with pytest.raises(ValueError, match="model.attention_block_q"):
    qwen.ModelConfig(attention_block_q=100)
  with pytest.raises(ValueError, match="model.attention_block_kv"):
    qwen.ModelConfig(attention_block_kv=0)
  assert qwen.ModelConfig().attention == "auto"


# ------------------------------------------------------------------ the model


def test_model_blocked_matches_dense_training_and_prefill():
  # qwen.forward with attention="blocked" (128-tiles, T=160: 2 query blocks of 80)
  # against "dense": hidden states and parameter gradients of a padded batch,
  # and a cached prefill
  base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=16, attention_block_q=128,
              attention_block_kv=128)
  dense_cfg = qwen.ModelConfig(attention="dense", **base)
  blocked_cfg = qwen.ModelConfig(attention="blocked", **base)
  params = qwen.init_params(dense_cfg, jax.random.key(0))
  b, t = 2, 160
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, 64)
  mask = _training_mask(b, t, left=[17, 0], right=[30, 3])
  w = jax.random.normal(jax.random.key(2), (b, t, base["hidden_size"]))

  def loss(p, cfg):  # a weighted mean over real tokens: O(1) gradients
    h, _ = qwen.forward(p, tokens, mask, cfg)
    return jnp.sum(h * w * mask[..., None]) / jnp.sum(mask), h

  grad = lambda cfg: jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
      params, cfg)
  (_, h_d), g_d = grad(dense_cfg)
  (_, h_b), g_b = grad(blocked_cfg)
  real = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(h_b)[real], np.asarray(h_d)[real], atol=TOL)
  for (path, a), c in zip(jax.tree.leaves_with_path(g_b), jax.tree.leaves(g_d)):
    c = np.asarray(c)  # float32 sums over 2 x 160 tokens: tolerance relative to the largest
    np.testing.assert_allclose(np.asarray(a), c, atol=TOL * max(1.0, np.abs(c).max()), rtol=0,
                               err_msg=jax.tree_util.keystr(path))

  # prefill of a left-padded prompt into a longer cache
  p_len, s = 150, 170
  prompt_mask = _training_mask(b, p_len, left=[9, 0], right=[0, 0])
  kv_mask = jnp.pad(prompt_mask, ((0, 0), (0, s - p_len)))

  def prefill(cfg):
    cache = qwen.init_cache(cfg, b, s)
    h, c = qwen.forward(params, tokens[:, :p_len], prompt_mask, cfg, cache=cache,
                        cache_index=0, kv_mask=kv_mask)
    return h, c

  (h_d, c_d), (h_b, c_b) = (jax.jit(prefill, static_argnums=0)(c) for c in
                            (dense_cfg, blocked_cfg))
  real = np.asarray(prompt_mask, bool)
  np.testing.assert_allclose(np.asarray(h_b)[real], np.asarray(h_d)[real], atol=TOL)
  # the cache at real slots (pad slots hold the keys of pad rows, which differ)
  slots = np.asarray(kv_mask, bool)  # [B, S]
  k_b, k_d = (np.moveaxis(np.asarray(x), -1, 2) for x in (c_b.k, c_d.k))  # [L, B, S, K, Dh]
  v_b, v_d = (np.moveaxis(np.asarray(x), 3, 2) for x in (c_b.v, c_d.v))  # [L, B, S, K, Dh]
  for name, a, c in (("k", k_b, k_d), ("v", v_b, v_d)):
    np.testing.assert_allclose(a[:, slots], c[:, slots], atol=TOL, err_msg=name)


# ------------------------------------------------------------------ TPU compile


def _qwen3_real_heads_temp_bytes(t, hidden, ffn, attention="auto", b=2):
  """Compile forward+backward of a 2-layer Qwen3 (16 q / 8 kv heads, head_dim 128,
  bf16, remat full) for v5p:2x2x1 under jax.set_mesh (fsdp 2 x tensor 2).
  Returns (temp bytes per device, number of Mosaic custom calls)."""
  cfg = qwen.ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=hidden,
                         intermediate_size=ffn, num_layers=2, num_heads=16, num_kv_heads=8,
                         head_dim=128, param_dtype="bfloat16", compute_dtype="bfloat16",
                         remat="full", attention=attention)
  mesh = Mesh(np.asarray(_tpu_devices()).reshape(1, 1, 2, 2), sh.MESH_AXES)
  abstract = qwen.abstract_params(cfg)
  specs = sh.tree_specs(qwen.param_logical_axes(cfg), sh.DEFAULT_RULES, abstract, mesh)
  pshard = sh.tree_shardings(mesh, specs)
  bshard = NamedSharding(mesh, sh.batch_spec(2, mesh, b))

  def loss(params, tokens, mask):
    h, _ = qwen.forward(params, tokens, mask, cfg)
    return jnp.sum(h.astype(jnp.float32) ** 2 * mask[..., None])

  fn = jax.jit(jax.grad(loss), in_shardings=(pshard, bshard, bshard), out_shardings=pshard)
  tok = jax.ShapeDtypeStruct((b, t), jnp.int32)
  with jax.set_mesh(mesh):
    compiled = fn.lower(abstract, tok, tok).compile()
  return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text().count("tpu_custom_call")


def _dense_scores_per_device(t, b=2):
  # [B/fsdp, K/tensor, G, T, T] float32 on one device of the fsdp 2 x tensor 2 mesh
  return (b // 2) * (8 // 2) * 2 * t * t * 4


@needs_libtpu
def test_auto_is_pallas_on_v5p_and_its_temp_bytes_are_below_one_dense_score_tensor():
  t = 1024
  temp, kernels = _qwen3_real_heads_temp_bytes(t, hidden=256, ffn=512)
  assert kernels > 0  # auto resolved to the splash kernel under the TPU mesh
  assert temp < _dense_scores_per_device(t), (temp, _dense_scores_per_device(t))


@needs_libtpu
@pytest.mark.slow  # ~30 s on the idle 2-core machine, minutes under load
def test_pallas_qwen3_real_heads_t4096_temp_bytes_far_below_dense():
  t = 4096
  temp, kernels = _qwen3_real_heads_temp_bytes(t, hidden=1024, ffn=3072, attention="pallas")
  assert kernels > 0
  assert temp < _dense_scores_per_device(t) / 2, (temp, _dense_scores_per_device(t))
