"""Attention over pages (fbos_jax/model/paged_attention.py): the XLA version
against the dense reference (decode steps and prefill chunks, GQA, shuffled
page tables, stacked layers), the cache write, the Pallas kernel's semantics
through its own reference, the kernel (fbos_kernels.ragged_paged_attention,
JAX's shipped kernel with three load/store changes) in the Pallas TPU
interpreter against the XLA version, the proof that it differs from the shipped
kernel in those lines only, and the kernel compiled for a TPU topology (libtpu;
no TPU needed).
"""

import ast
import difflib
import importlib.util
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fbos_jax.model import attention as A
from fbos_jax.model import paged_attention as PA

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="XLA's TPU compiler is missing: "
                                  "pip install libtpu==0.0.42.1; no TPU is needed")
TOL = 1e-5


def paged_case(seed, lengths, t, *, h=4, kv=2, dh=16, ps=4, pb=None, spare=3):
  """Random rows of the given lengths (tokens already in the cache, including the
  T new ones) scattered over a shuffled pool. Returns (q [B, T, H, Dh], pages,
  page_table, q_pos, dense k [B, S, K, Dh], dense v) with S = pb * ps."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  need = [-(-n // ps) for n in lengths]
  pb = pb or max(need)
  n_pages = 1 + sum(need) + spare
  perm = rng.permutation(np.arange(1, n_pages))  # page 0 is the null page
  table = np.zeros((b, pb), np.int32)
  at = 0
  for r, k in enumerate(need):
    table[r, :k] = perm[at:at + k]
    at += k
  pages = rng.normal(size=(n_pages, ps, 2 * kv, dh)).astype(np.float32)  # stale data everywhere
  q = rng.normal(size=(b, t, h, dh)).astype(np.float32)
  q_pos = np.stack([np.arange(n - t, n) for n in lengths]).astype(np.int32)
  g = pages[table].reshape(b, pb * ps, kv, 2, dh)
  return (jnp.asarray(q), jnp.asarray(pages), jnp.asarray(table), jnp.asarray(q_pos),
          g[..., 0, :], g[..., 1, :])


def dense_reference(q, k, v, q_pos):
  """attention.dense per row, cache layout, queries at their own offset."""
  outs = []
  for r in range(q.shape[0]):
    kr = jnp.asarray(k[r:r + 1]).transpose(0, 2, 3, 1)  # [1, K, Dh, S]
    vr = jnp.asarray(v[r:r + 1]).transpose(0, 2, 1, 3)  # [1, K, S, Dh]
    valid = jnp.ones((1, k.shape[1]), jnp.int32)
    outs.append(A.dense(q[r:r + 1], kr, vr, valid, q_offset=int(q_pos[r, 0]), cache_layout=True))
  return jnp.concatenate(outs, 0)


@pytest.mark.parametrize("t,lengths", [(1, [1, 7, 12, 4]), (5, [5, 9, 16]), (3, [3, 4, 11, 8])])
def test_xla_matches_dense(t, lengths):
  q, pages, table, q_pos, k, v = paged_case(0, lengths, t)
  out = jax.jit(PA.attend_xla)(q, pages, table, q_pos)
  ref = dense_reference(q, k, v, q_pos)
  err = float(jnp.abs(out - ref).max())
  assert err < TOL, err
  # a wider page table (bucketing) changes nothing: the extra pages are past every query
  q2, pages2, table2, q_pos2, _, _ = paged_case(0, lengths, t, pb=max(-(-n // 4) for n in lengths) + 2)
  np.testing.assert_allclose(jax.jit(PA.attend_xla)(q2, pages2, table2, q_pos2), out, atol=TOL)


def test_xla_ignores_stale_data_past_each_query():
  """Slots after a row's query position hold another owner's data: changing them
  leaves the output unchanged (they are never attended)."""
  lengths, ps = [6, 9], 4
  q, pages, table, q_pos, _, _ = paged_case(1, lengths, 2, ps=ps)
  out = PA.attend_xla(q, pages, table, q_pos)
  p = np.asarray(pages).copy()
  for r, n in enumerate(lengths):
    for pos in range(n, table.shape[1] * ps):
      p[int(table[r, pos // ps]), pos % ps] = 1e3
  np.testing.assert_array_equal(PA.attend_xla(q, jnp.asarray(p), table, q_pos), out)


def test_write_then_attend_and_stacked_layers():
  """write() puts k/v where the page table says (padding -> the null page); the
  stacked [L, N, ...] form with a layer index gives the per-layer result."""
  rng = np.random.default_rng(2)
  ps, kv, dh, h = 4, 2, 8, 4
  table = jnp.asarray([[3, 1, 0], [2, 5, 4]], jnp.int32)
  positions = jnp.asarray([[4, 5, 6], [7, 8, 9]], jnp.int32)
  valid = jnp.asarray([[1, 1, 0], [1, 1, 1]], bool)
  page, slot = PA.write_targets(table, positions, valid, ps)
  assert page.tolist() == [[1, 1, 0], [5, 4, 4]] and slot.tolist() == [[0, 1, 2], [3, 0, 1]]
  k = jnp.asarray(rng.normal(size=(2, 3, kv, dh)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 3, kv, dh)), jnp.float32)
  pages = jnp.zeros((6, ps, 2 * kv, dh), jnp.float32)
  pages = PA.write(pages, k, v, page, slot)
  gk, gv = PA.gather(pages, table)
  np.testing.assert_array_equal(gk[0, 4:6], k[0, :2])
  np.testing.assert_array_equal(gv[1, 7:10], v[1])
  np.testing.assert_array_equal(pages[0, 2], PA.interleave(k, v)[0, 2])  # padding: null page
  stacked = jnp.stack([jnp.zeros_like(pages), pages])
  stacked = PA.write(stacked, k, v, page, slot, layer=0)
  np.testing.assert_array_equal(stacked[0], pages)
  q = jnp.asarray(rng.normal(size=(2, 3, h, dh)), jnp.float32)
  np.testing.assert_array_equal(PA.attend_xla(q, stacked, table, positions, layer=1),
                                PA.attend_xla(q, pages, table, positions))


def _kernel_args(q, pages, table, q_pos):
  b, t = q_pos.shape
  return (q.reshape(b * t, *q.shape[2:]), pages, (q_pos[:, -1] + 1).astype(jnp.int32), table,
          jnp.arange(b + 1, dtype=jnp.int32) * t, jnp.full((1,), b, jnp.int32))


@pytest.mark.parametrize("t,lengths", [(1, [1, 7, 12]), (4, [4, 9, 16])])
def test_pallas_kernel_semantics_equal_ours(t, lengths):
  """The ragged kernel's own reference (ref_ragged_paged_attention) on our layout
  and call convention equals attend_xla: same page layout (k/v interleaved), same
  causal convention (the queries are the last T positions of each row)."""
  from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa
  q, pages, table, q_pos, _, _ = paged_case(3, lengths, t)
  b, _, h, dh = q.shape
  ref = rpa.ref_ragged_paged_attention(*_kernel_args(q, pages, table, q_pos),
                                       sm_scale=1.0 / np.sqrt(dh))
  ours = PA.attend_xla(q, pages, table, q_pos)
  np.testing.assert_allclose(np.asarray(ref).reshape(b, t, h, dh), ours, atol=TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t,lengths,h,kv,blocks", [
    (1, [3, 40, 17], 4, 2, (1, 8)),  # decode, GQA 2, up to 3 kv blocks of one page
    (4, [5, 20, 9], 8, 2, None),  # prefill chunks, GQA 4, the v5 block sizes
])
def test_pallas_kernel_in_the_tpu_interpreter(dtype, t, lengths, h, kv, blocks):
  """The kernel the engine runs on TPU, run by the Pallas TPU interpreter, equals
  attend_xla: to 1e-5 in float32; in bfloat16 within half a bf16 ulp of the float32
  result on the same (bf16) inputs (the kernel accumulates in float32 and rounds once)."""
  q, pages, table, q_pos, _, _ = paged_case(4, lengths, t, h=h, kv=kv, dh=128, ps=16)
  q, pages = q.astype(dtype), pages.astype(dtype)
  bkv, bq = blocks or (None, None)
  out = PA.attend_pallas(q, pages, table, q_pos, num_kv_pages_per_block=bkv,
                         num_queries_per_block=bq, interpret=True)
  assert out.dtype == q.dtype
  out = np.asarray(out.astype(jnp.float32))
  ref = np.asarray(PA.attend_xla(q.astype(jnp.float32), pages.astype(jnp.float32), table, q_pos))
  tol = TOL if dtype == "float32" else np.abs(ref) * 2.0 ** -8 + TOL
  assert (np.abs(out - ref) <= tol).all(), float(np.abs(out - ref).max())


# the kernel's lines that differ from JAX's shipped kernel (module docstring aside): each
# only changes how a buffer is loaded or stored (fbos_kernels/ragged_paged_attention.py)
SHIPPED_LINES = [
    "return [ref[start::step, :]], [ref[start + 1 :: step, :]]",
    "b_ref = ref.bitcast(jnp.uint32)",
    "b = b_ref[b_start::b_step, :]",
    "pltpu.store(ref, val, mask=jnp.logical_and(iota >= start, iota < end))",
    "kv_ref = cur_async_copy_kv.wait().reshape(",
    "num_kv_pages_per_blk * page_size * num_combined_kv_heads_per_blk,",
    "head_dim,",
    ")",
]
VENDORED_LINES = [
    "return ([ref[:, :, start, :].reshape(-1, ref.shape[-1])],  # fbos: 1",
    "[ref[:, :, start + 1, :].reshape(-1, ref.shape[-1])])  # fbos: 1",
    "b = pltpu.bitcast(ref[:, :, pl.ds(b_start * packing, packing), :],  # fbos: 1, 3",
    "jnp.uint32).reshape(-1, ref.shape[-1])  # fbos: 1, 3",
    "ref[...] = jnp.where(jnp.logical_and(iota >= start, iota < end), val, ref[...])  # fbos: 2",
    "kv_ref = cur_async_copy_kv.wait()  # fbos: 1 (not reshaped)",
]


def _code_lines(module):
  """The module's source lines after its docstring."""
  src = inspect.getsource(module)
  return src.splitlines()[ast.parse(src).body[0].end_lineno:]


def test_vendored_kernel_differs_from_shipped_only_in_load_store_lines():
  """fbos_kernels.ragged_paged_attention is JAX's shipped kernel but for the lines
  above (a new JAX kernel fails this: re-vendor it)."""
  from fbos_kernels import ragged_paged_attention as ours
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as shipped
  diff = list(difflib.unified_diff(_code_lines(shipped), _code_lines(ours), lineterm="", n=0))
  removed = [x[1:].strip() for x in diff if x.startswith("-") and not x.startswith("---")]
  added = [x[1:].strip() for x in diff if x.startswith("+") and not x.startswith("+++")]
  assert removed == SHIPPED_LINES, removed
  assert added == VENDORED_LINES, added


@needs_libtpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_kernel_compiles_for_tpu(dtype):
  """attend_pallas (the kernel the interpreter test runs) inside a jitted program
  compiled for a v5p chip with real head sizes (Dh 128, 16 query / 8 kv heads, bf16
  and f32 pages): one Mosaic custom call, and the pool is read in place (no gathered
  copy of the pages in the temporaries)."""
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[:1]
  mesh = Mesh(np.asarray(dev), ("x",))
  rep = NamedSharding(mesh, P())
  b, t, h, kv, dh, ps, n, pb = 8, 1, 16, 8, 128, 16, 2048, 64
  args = (jax.ShapeDtypeStruct((b, t, h, dh), dtype, sharding=rep),
          jax.ShapeDtypeStruct((n, ps, 2 * kv, dh), dtype, sharding=rep),
          jax.ShapeDtypeStruct((b, pb), jnp.int32, sharding=rep),
          jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rep))
  fn = jax.jit(lambda *a: PA.attend_pallas(*a, device_kind=dev[0].device_kind))
  with jax.set_mesh(mesh):  # the kernel's lowering reads the target chip from the mesh
    compiled = fn.lower(*args).compile()
  assert compiled.as_text().count("tpu_custom_call") >= 1
  gathered = b * pb * ps * 2 * kv * dh * jnp.dtype(dtype).itemsize  # what XLA would gather
  assert compiled.memory_analysis().temp_size_in_bytes < gathered / 4


def test_kernel_kv_block_stays_within_its_vmem_budget():
  """The kernel's default block (128 pages) of 16 tokens x 16 combined kv heads
  (Qwen3-0.6B's 8 kv heads on one chip) x 128 in bf16 is 2 x 8 MiB of VMEM, which
  did not compile for v5e (CompileTimeScopedVmemOom in qwen3_0_6b's plan): the
  block is capped so that both buffers fit KV_BLOCK_VMEM_BYTES; the tuned sizes
  of smaller head counts are kept."""
  q = jax.ShapeDtypeStruct((64, 16, 128), jnp.bfloat16)
  for kv, want in ((8, 64), (2, 128)):  # combined heads 16: capped; 4: the default 128
    pages = jax.ShapeDtypeStruct((100, 16, 2 * kv, 128), jnp.bfloat16)
    bkv, bq = PA.kernel_block_sizes("TPU v5 lite", q, pages, pages_per_seq=160)
    assert bkv == want and bq == 32, (kv, bkv, bq)
    assert bkv * 2 * 16 * 2 * kv * 128 * 2 <= PA.KV_BLOCK_VMEM_BYTES


def test_pallas_is_refused_where_it_cannot_run():
  """engine.attention=pallas off TPU names the field and the platform; auto picks the
  kernel on TPU only when head_dim fits its 128 lanes; the kernel refuses other head_dims."""
  with pytest.raises(ValueError, match=r"engine.attention='pallas'.*platform 'cpu'"):
    PA.choose("pallas", "cpu")
  with pytest.raises(ValueError, match=r"engine.attention='pallas'.*platform 'gpu'"):
    PA.choose("pallas", "gpu", 128)
  assert PA.choose("pallas", "tpu", 128) == "pallas"
  assert PA.choose("pallas_interpret", "cpu", 128) == "pallas_interpret"
  assert PA.choose("auto", "tpu", 128) == "pallas" and PA.choose("auto", "tpu", 64) == "xla"
  assert PA.choose("auto", "cpu", 128) == "xla"
  with pytest.raises(ValueError, match=r"engine.attention='pallas_interpret'.*model.head_dim=16"):
    PA.choose("pallas_interpret", "cpu", 16)


# ------------------------------------------------------------------ the GPU decode kernel


@pytest.mark.parametrize("lengths,h,kv,dh,ps", [([1, 17, 36, 50], 4, 2, 16, 16),
                                                ([5, 64, 130, 33], 8, 2, 128, 32),
                                                ([144, 3, 77], 32, 8, 128, 16)])
def test_gpu_decode_kernel_in_the_interpreter_matches_xla(lengths, h, kv, dh, ps):
  """fbos_kernels.paged_decode_gpu (issue 32: the engine on GPU reads pages in place)
  in Pallas's interpreter against attend_xla on decode steps: float32, GQA (G = 2, 4,
  16 padded to Triton's 16), several pages a row, a row of one token, shuffled pages
  with stale data past each row."""
  q, pages, table, q_pos, _, _ = paged_case(3, lengths, 1, h=h, kv=kv, dh=dh, ps=ps, spare=5)
  ref = PA.attend_xla(q, pages, table, q_pos)
  out = PA.attend("pallas_gpu_interpret", q, pages, table, q_pos)
  np.testing.assert_allclose(out, ref, atol=TOL, rtol=TOL)
  # a prefill chunk (T > 1) goes to attend_xla: the kernel is for decode steps
  q2, pages2, table2, q_pos2, _, _ = paged_case(4, [9, 20], 5, h=h, kv=kv, dh=dh, ps=ps)
  np.testing.assert_array_equal(PA.attend("pallas_gpu_interpret", q2, pages2, table2, q_pos2),
                                PA.attend_xla(q2, pages2, table2, q_pos2))


def test_gpu_decode_kernel_in_bfloat16_is_no_further_from_float32_than_xla():
  """In bfloat16 the kernel and attend_xla round at different points (the kernel keeps
  its online softmax and p.v in float32; attend_xla rounds the probabilities to bf16),
  so they differ by rounding; the kernel's output must be no further from the float32
  attention of the same bf16 inputs than attend_xla's (max and mean over 16 rows)."""
  q, pages, table, q_pos, _, _ = paged_case(5, list(range(3, 144, 9)), 1, h=8, kv=2, dh=128,
                                            ps=16, spare=4)
  qb, pb_ = q.astype(jnp.bfloat16), (2 * pages).astype(jnp.bfloat16)
  truth = PA.attend_xla(qb.astype(jnp.float32), pb_.astype(jnp.float32), table, q_pos)
  err = {}
  for impl in ("pallas_gpu_interpret", "xla"):
    out = PA.attend(impl, qb, pb_, table, q_pos).astype(jnp.float32)
    assert out.dtype == jnp.float32 and bool(jnp.isfinite(out).all())
    e = jnp.abs(out - truth)
    err[impl] = (float(e.max()), float(e.mean()))
  assert err["pallas_gpu_interpret"][0] <= err["xla"][0], err
  assert err["pallas_gpu_interpret"][1] <= err["xla"][1], err


def test_the_gpu_kernel_is_chosen_on_gpu_and_refused_elsewhere():
  """auto picks the GPU kernel on GPU when head_dim and page_size are powers of two
  >= 16; pallas_gpu off GPU names the field and the platform; shapes the kernel
  cannot tile name their field."""
  assert PA.choose("auto", "gpu", 128, 16) == "pallas_gpu"
  assert PA.choose("auto", "gpu", 128, 8) == "xla" and PA.choose("auto", "gpu", 96, 16) == "xla"
  assert PA.choose("pallas_gpu_interpret", "cpu", 16, 16) == "pallas_gpu_interpret"
  with pytest.raises(ValueError, match=r"engine.attention='pallas_gpu'.*platform 'cpu'"):
    PA.choose("pallas_gpu", "cpu", 128, 16)
  with pytest.raises(ValueError, match=r"engine.attention='pallas_gpu'.*engine.page_size=8"):
    PA.choose("pallas_gpu", "gpu", 128, 8)
  with pytest.raises(ValueError, match=r"model.head_dim=96"):
    PA.choose("pallas_gpu_interpret", "cpu", 96, 16)
