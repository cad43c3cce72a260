"""The continuous engine (fbos_jax/engine): equal to the static sampler under the
key contract (greedy and sampled; one device and the 8-device mesh), log-probs
equal to teacher forcing, pages never leaked (also after an error), the pool
size check, the early-returning window, streamed requests submitted while the
engine runs, compile-once buckets and bad input. Tiny random models.

Most tests share one engine shape: 4 slots, 4-token pages, windows of 4 steps,
prefill chunks of 4 tokens (a 9-token prompt is prefilled in 2 chunks), with
single row / page / chunk buckets so that each config compiles few programs.
"""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fbos_jax import engine as E
from fbos_jax import sampling
from fbos_jax.program_cache import count_compiles
from fbos_jax.testing.flips import assert_same_rows
from fbos_jax import sharding as sh
from fbos_jax.engine import programs
from fbos_jax.model import qwen

R = 12
BASE = dict(max_new_tokens=R, prompt_buckets=(12,), batch_buckets=(8,))
GREEDY = dict(BASE, temperature=0.0)
SAMPLED = dict(BASE, temperature=0.8, top_k=0)
PROMPT_LENGTHS = [9, 1, 4, 5, 12, 3]  # 1 token (nothing to prefill), page multiples, 2 chunks
ECFG = E.EngineConfig(slots=4, page_size=4, window=4, prefill_chunk=4, row_buckets=(4,),
                      page_buckets=(6,), prefill_buckets=(4,))


@pytest.fixture(scope="module")
def tiny():
  cfg = qwen.ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64,
                         intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, rope_theta=10000.0)
  rng = np.random.default_rng(0)  # peaked next-token distributions (as tests/test_sampling.py)
  params = jax.tree.map(
      lambda s: jnp.asarray(1.0 + 0.2 * rng.standard_normal(s[0]) if len(s[0]) < 3 and
                            s[1][-1] == "norm" else 0.12 * rng.standard_normal(s[0]), jnp.float32),
      qwen.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple))
  return params, cfg


def random_prompts(lengths, vocab, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, n).tolist() for n in lengths]


def common_stop(out, lo=2):
  """A token the free-running rows emit often after step ``lo``: as a stop id it
  ends rows at different lengths."""
  vals, counts = np.unique(out.tokens[:, lo:], return_counts=True)
  return int(vals[np.argmax(counts)])




def compare(static, eng, params, cfg, kw, *, key, n, config=None, **extra):
  """The same rows (fbos_jax.testing.flips.assert_same_rows): greedy rows exactly,
  a sampled row up to a proven near-tie flip. Returns the number of flipped rows."""
  flips = assert_same_rows(static, eng, params, cfg, key=key, n_per_prompt=n, config=config,
                           **kw, **extra)
  greedy = sampling.make_config(config, **kw).is_greedy
  assert not (greedy and flips), f"greedy rows differ: {flips}"
  if flips:
    print(f"{len(flips)} of {static.num_rows} rows flipped at a proven near-tie: {flips}")
  return len(flips)


def as_output(rows, like, pad_id):
  """Finished rows (prompt-major) as a SampleOutput with ``like``'s prompts and width."""
  r_len = like.tokens.shape[1]
  tokens = np.full((len(rows), r_len), pad_id, np.int32)
  logprobs = np.zeros((len(rows), r_len), np.float32)
  for k, row in enumerate(rows):
    tokens[k, :row.tokens.size], logprobs[k, :row.tokens.size] = row.tokens, row.logprobs
  lengths = np.asarray([row.tokens.size for row in rows], np.int32)
  return sampling.SampleOutput(
      tokens=tokens, lengths=lengths, logprobs=logprobs,
      response_mask=(np.arange(r_len)[None, :] < lengths[:, None]).astype(np.int32),
      prompt_tokens=like.prompt_tokens, prompt_mask=like.prompt_mask,
      stopped=np.asarray([row.stopped for row in rows]), prompt_truncated=like.prompt_truncated)


def teacher_forced(params, cfg, out, temperature):
  fn = jax.jit(sampling.teacher_forced_logprobs, static_argnums=1, static_argnames="temperature")
  return np.asarray(fn(params, cfg, out.prompt_tokens, out.prompt_mask, out.tokens,
                       out.response_mask, temperature=temperature))


# ----------------------------------------------------------------------------- equality


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_engine_equals_static_one_device(tiny, mode):
  """12 rows through 4 slots (refills), windows of 4 steps, chunked prefill, rows
  stopping at different lengths: the static sampler's rows; log-probs == teacher
  forcing."""
  params, cfg = tiny
  kw = GREEDY if mode == "greedy" else SAMPLED
  prompts = random_prompts(PROMPT_LENGTHS, cfg.vocab_size, seed=1)
  key = jax.random.PRNGKey(5)
  free = sampling.sample(params, cfg, prompts, key=key, n_per_prompt=2, **kw)
  stop = common_stop(free)
  static = sampling.sample(params, cfg, prompts, key=key, n_per_prompt=2, stop_token_ids=(stop,),
                           **kw)
  assert len(set(static.lengths.tolist())) >= 3, static.lengths  # ragged: refills happen
  stats = E.EngineStats()
  eng = E.sample(params, cfg, prompts, key=key, n_per_prompt=2, stop_token_ids=(stop,),
                 engine_config=ECFG, stats=stats, **kw)
  compare(static, eng, params, cfg, dict(kw, stop_token_ids=(stop,)), key=key, n=2)
  temp = 1.0 if mode == "greedy" else kw["temperature"]
  tf = teacher_forced(params, cfg, eng, temp)
  m = eng.response_mask.astype(bool)
  err = float(np.abs(tf - eng.logprobs)[m].max())
  assert err < 1e-5, f"engine vs teacher-forced log-prob max error {err}"
  assert (eng.tokens[~m] == 0).all() and (eng.logprobs[~m] == 0).all()
  # the statistics describe this call
  assert stats.rows == static.num_rows and stats.tokens == int(eng.lengths.sum())
  assert stats.refills >= 2 and stats.windows >= 3 and stats.prefills >= 2
  assert 0 < stats.slot_util <= 1 and stats.slot_steps >= stats.tokens
  assert 0 < stats.pages_peak <= 4 * 6  # 4 slots x 6 pages


def test_stacked_pool_with_the_scan_layer_loop(tiny):
  """layer_loop='scan': one stacked pool array [Sh, L, N, ...], prefill in a fori_loop
  over the layers; the same rows as the static sampler."""
  params, cfg = tiny
  prompts = random_prompts([9, 1, 6, 4], cfg.vocab_size, seed=11)
  key = jax.random.PRNGKey(2)
  kw = dict(SAMPLED, layer_loop="scan")
  static = sampling.sample(params, cfg, prompts, key=key, n_per_prompt=2, **kw)
  eng = E.Engine(cfg, sampling.make_config(**kw), ECFG)
  assert not eng.st.unroll
  out = eng.sample(params, prompts, key=key, n_per_prompt=2)
  compare(static, out, params, cfg, kw, key=key, n=2)


def test_engine_config_does_not_change_the_samples(tiny):
  """The key contract: slots, pages, windows and chunks change where and when a
  row runs, not what it draws."""
  params, cfg = tiny
  prompts = random_prompts([6, 3, 10, 2], cfg.vocab_size, seed=2)
  key = jax.random.key(9)  # a typed key works too
  a = E.sample(params, cfg, prompts, key=key, n_per_prompt=3, engine_config=ECFG, **SAMPLED)
  other = E.EngineConfig(slots=8, page_size=8, window=16, prefill_chunk=16, refill_fraction=1.0)
  b = E.sample(params, cfg, prompts, key=key, n_per_prompt=3, engine_config=other, **SAMPLED)
  compare(a, b, params, cfg, SAMPLED, key=key, n=3)
  assert len({tuple(t) for t in a.tokens[:3]}) > 1  # the n samples of a prompt differ


@pytest.mark.parametrize("n", [1, 6])
def test_more_prompts_or_samples_than_slots_at_one_admission(tiny, n):
  """A shard admits up to slots + staged rows at once: with one sample per prompt
  (round 2's FAPs) that is more prompts than the largest row bucket, prefilled in
  several calls; with more samples than slots, a prompt's partial last page gets
  more private copies than a shard has slots. Both equal the static sampler."""
  params, cfg = tiny
  lengths = [7, 10, 3, 12, 9, 2, 6, 5, 4]  # 7, 10: a partial last page (4-token pages)
  prompts = random_prompts(lengths if n == 1 else lengths[:2], cfg.vocab_size, seed=4)
  stats = E.EngineStats()
  eng = E.sample(params, cfg, prompts, key=jax.random.key(3), n_per_prompt=n, engine_config=ECFG,
                 stats=stats, **GREEDY)
  static = sampling.sample(params, cfg, prompts, key=jax.random.key(3), n_per_prompt=n, **GREEDY)
  compare(static, eng, params, cfg, GREEDY, key=None, n=n)
  if n == 1:  # 8 prompts admitted at once on the one shard: 2 calls of 4 per chunk round
    assert stats.prefills > -(-max(map(len, prompts)) // ECFG.prefill_chunk)


def test_engine_equals_static_on_the_8_device_mesh(tiny):
  """data=2 x fsdp=2 x tensor=2: slots over the 4 batch shards (each with its own
  pages), kv heads over tensor; the rows equal the single-device static sampler's."""
  params, cfg = tiny
  mesh = sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  prompts = random_prompts([5, 9, 2, 7, 4], cfg.vocab_size, seed=3)
  key = jax.random.PRNGKey(4)
  ecfg = E.EngineConfig(slots=8, page_size=4, window=4, prefill_chunk=8, row_buckets=(2,),
                        page_buckets=(6,), prefill_buckets=(8,))
  for kw in (GREEDY, SAMPLED):
    static = sampling.sample(params, cfg, prompts, key=key, n_per_prompt=2, **kw)
    eng = E.sample(params, cfg, prompts, key=key, n_per_prompt=2, engine_config=ecfg, mesh=mesh,
                   rules=sh.DEFAULT_RULES, **kw)
    compare(static, eng, params, cfg, kw, key=key, n=2)


def test_the_decode_window_on_a_sharded_mesh_has_no_all_gather(tiny):
  """Each batch shard writes its rows' new k/v into its own part of the window's
  dense cache: no collective moves cache values or indices in the decode loop (a
  scatter over the sharded row axis was partitioned as two all-gathers per layer
  and k/v, every decode step), and the loop's stop test over the shards is one
  all-reduce."""
  params, cfg = tiny
  mesh = sh.make_mesh({"data": 8})
  ecfg = E.EngineConfig(slots=16, page_size=4, window=4, prefill_chunk=8, row_buckets=(2,),
                        page_buckets=(6,), prefill_buckets=(8,))
  eng = E.Engine(cfg, sampling.make_config(**SAMPLED), ecfg, mesh=mesh,
                 rules=sh.DEFAULT_RULES)
  shapes = [s for s in eng.program_shapes() if s[0] == "window"]
  assert shapes
  with jax.set_mesh(mesh):
    pool = eng.program("init")()
  for shape in shapes:
    fn, args = eng.program_args(shape, params, pool)
    with jax.set_mesh(mesh):
      hlo = fn.lower(*args).compile().as_text()
    assert hlo.count(" all-gather(") == 0, shape
    assert hlo.count(" all-reduce(") <= 1, shape


# ----------------------------------------------------------------------------- pages


def test_pages_are_all_free_after_a_run_and_after_an_error(tiny):
  params, cfg = tiny
  prompts = random_prompts(PROMPT_LENGTHS, cfg.vocab_size, seed=4)
  eng = E.Engine(cfg, sampling.make_config(**GREEDY), ECFG)
  ref = eng.sample(params, prompts, key=jax.random.PRNGKey(0), n_per_prompt=2)
  assert eng.pages.in_use() == 0 and eng.pages.peak > 0

  calls = []

  def boom(row):
    calls.append(row)
    if len(calls) == 3:
      raise RuntimeError("callback failed")

  reqs = [E.Request(p, n=2, sid_base=2 * i, tag=i) for i, p in enumerate(prompts)]
  with pytest.raises(RuntimeError, match="callback failed"):
    eng.run(params, E.ListFeed(reqs), boom)
  assert eng.pages.in_use() == 0  # the live rows' pages went back in the finally block
  again = eng.sample(params, prompts, key=jax.random.PRNGKey(0), n_per_prompt=2)
  np.testing.assert_array_equal(again.tokens, ref.tokens)

  class BadFeed(E.ListFeed):  # a request with a bad prompt arrives while rows are live
    def __init__(self):
      super().__init__(reqs[:2], closed=False)
      self.polls = 0

    def poll(self):
      self.polls += 1
      if self.polls == 3:
        return [E.Request([cfg.vocab_size + 1], tag="bad")]
      return super().poll()

  with pytest.raises(E.EngineError, match="request 'bad' has token ids outside"):
    eng.run(params, BadFeed(), lambda row: None)
  assert eng.pages.in_use() == 0


def test_allocator_shares_and_frees_pages():
  a = E.PageAllocator(shards=2, pages_per_shard=5)
  assert a.capacity == 8
  shared = a.alloc(1, 2, refs=3)
  assert 0 not in shared and a.in_use() == 2
  for _ in range(2):
    a.release(1, shared)
  assert a.in_use() == 2  # one reference left
  a.release(1, shared)
  assert a.in_use() == 0
  with pytest.raises(E.EngineError, match="released more often"):
    a.release(1, shared[:1])
  with pytest.raises(E.EngineError, match="out of KV pages: 5 wanted, 4 free"):
    a.alloc(0, 5)
  a.alloc(0, 1)
  with pytest.raises(E.EngineError, match="leaked"):
    a.check_all_free()


def test_a_pool_too_small_is_refused_with_the_numbers(tiny):
  _, cfg = tiny
  scfg = sampling.make_config(**GREEDY)  # prompts up to 12, 12 new tokens: 23 tokens, 6 pages
  with pytest.raises(E.EngineError) as e:
    E.Engine(cfg, scfg, E.EngineConfig(slots=4, page_size=4, window=4, num_pages=40))
  msg = str(e.value)  # 4 x 6 + 4 staged x ceil((12 + 4 - 1) / 4) + 1 = 41
  for part in ("engine.num_pages=40", "4 slots per shard", "6 pages per row",
               "4 staged rows per shard", "x 4 pages", "= 41", "engine.slots", "engine.staged"):
    assert part in msg, msg
  E.Engine(cfg, scfg, E.EngineConfig(slots=4, page_size=4, window=4, num_pages=41))  # enough
  with pytest.raises(E.EngineError, match="= 25"):  # without staging: 4 x 6 + 1
    E.Engine(cfg, scfg, E.EngineConfig(slots=4, page_size=4, staged=0, num_pages=24))
  with pytest.raises(E.EngineError, match="multiple of the mesh's 4 batch shards"):
    E.Engine(cfg, scfg, E.EngineConfig(slots=6), mesh=sh.make_mesh({"data": 4, "tensor": 2}))


# ----------------------------------------------------------------------------- the window


def test_window_returns_early_for_a_refill_and_to_shrink(tiny):
  """Called directly: slot rows with limits 2, 3, 9, 9. min_idle=1 ends the window
  after 2 steps; shrink_to=2 once at most 2 rows are live (3 steps); neither: all 8.
  With one staged row of limit 4, the slot that stops first takes it at once (its
  tokens come from source B + 0) and the window runs on."""
  params, cfg = tiny
  eng = E.Engine(cfg, sampling.make_config(**GREEDY),
                 E.EngineConfig(slots=4, page_size=4, window=8, staged=1, row_buckets=(4,),
                                page_buckets=(6,)))
  fn = eng.program("window")
  table = np.asarray([[1, 2, 3, 0, 0, 0], [4, 5, 6, 0, 0, 0], [7, 8, 9, 0, 0, 0],
                      [10, 11, 12, 0, 0, 0]], np.int32)
  i32 = lambda *x: np.asarray(x, np.int32)

  def call(min_idle, shrink_to, staged=0):
    pool = eng.program("init")()
    q = max(staged, 1)
    out = fn(params, pool, i32(3, 4, 5, 6), np.zeros(4, np.int32), np.zeros(4, np.int32),
             i32(2, 3, 9, 9), np.zeros((4, 2), np.uint32), np.arange(4, dtype=np.uint32),
             np.ones(4, bool), table, i32(7)[:q], i32(0)[:q], i32(0)[:q], i32(4)[:q],
             np.zeros((q, 2), np.uint32), np.arange(q, dtype=np.uint32),
             np.asarray([[13, 14, 0, 0, 0, 0]], np.int32)[:q], i32(staged),
             np.float32(1), np.float32(1), sampling.stop_id_array(()), np.int32(min_idle),
             np.int32(shrink_to))
    _, toks, _, srcs, final, nxt, steps = (np.asarray(x) for x in out)
    return int(steps), srcs, final.tolist(), int(nxt[0])

  steps, srcs, final, _ = call(1, -1)
  assert steps == 2 and final == [-1, 1, 2, 3]
  steps, srcs, final, _ = call(5, 2)
  assert steps == 3 and final == [-1, -1, 2, 3]
  steps, srcs, final, _ = call(5, -1)
  assert steps == 8 and final == [-1, -1, 2, 3]
  steps, srcs, final, taken = call(1, -1, staged=1)
  # slot 0 stops after 2 steps and takes the staged row (id B + 0 = 4) for its 4 tokens;
  # slot 1 stops after 3 with nothing left to take: the refill ends the window
  assert taken == 1 and steps == 3, (steps, srcs)
  assert srcs[0, :3].tolist() == [0, 0, 4] and final == [4, -1, 2, 3]


def test_row_buckets_above_the_slots_per_shard_are_cut_and_never_pad(tiny):
  """engine.row_buckets (4, 16) with 8 slots on one shard: the buckets are (4, 8), so
  8 rows that all run to max_new_tokens fill every slot-step of every window
  (slot_util 1.0; a 16-row bucket would count 8 idle slots per step: 0.5)."""
  params, cfg = tiny
  ecfg = E.EngineConfig(slots=8, page_size=4, window=4, prefill_chunk=4, row_buckets=(4, 16),
                        page_buckets=(6,), prefill_buckets=(4,))
  eng = E.Engine(cfg, sampling.make_config(**GREEDY), ecfg)
  assert eng.row_buckets == (4, 8)
  assert E.pool_layout(ecfg, sampling.make_config(**GREEDY), shards=2).row_buckets == (4,)
  stats = E.EngineStats()
  out = eng.sample(params, random_prompts([3, 5, 2, 7, 4, 6, 1, 8], cfg.vocab_size, seed=11),
                   key=jax.random.PRNGKey(0), stats=stats)
  assert (out.lengths == R).all()  # no stop token: every row runs its R steps
  assert stats.tokens == 8 * R and stats.slot_steps == 8 * R and stats.slot_util == 1.0


def test_min_fill_runs_a_window_at_a_bucket_its_rows_fill_and_defers_the_rest(tiny):
  """engine.min_fill=0.9, buckets (4, 8) on one shard of 8 slots: 5 rows fill 8 slots
  to 0.625 and 4 to 1.0, so each window runs 4 rows (slot_steps = 4 x steps) and the
  fifth waits for a later window; the rows equal those of min_fill=0 (every row in
  one 8-row window), whose first window counts 8 slots per step."""
  params, cfg = tiny
  prompts = random_prompts([3, 5, 2, 7, 4], cfg.vocab_size, seed=13)
  kw = dict(slots=8, page_size=4, window=4, prefill_chunk=4, row_buckets=(4, 8),
            page_buckets=(6,), prefill_buckets=(4,))
  out, stats = {}, {}
  for fill in (0.0, 0.9):
    rows, st = [], E.EngineStats()
    feed = E.ListFeed([E.Request(p, key=np.zeros(2, np.uint32), sid_base=i, tag=i,
                                 max_new_tokens=4 + 2 * i) for i, p in enumerate(prompts)])
    E.run(params, cfg, feed, rows.append, config=sampling.make_config(**SAMPLED),
          engine_config=E.EngineConfig(min_fill=fill, **kw), stats=st)
    out[fill], stats[fill] = {r.tag: r for r in rows}, st
  assert stats[0.9].slot_steps == 4 * stats[0.9].decode_steps
  assert stats[0.0].slot_steps > 4 * stats[0.0].decode_steps
  assert out[0.9][4].first_window > 0 and out[0.0][4].first_window == 0
  for i in range(len(prompts)):
    np.testing.assert_array_equal(out[0.9][i].tokens, out[0.0][i].tokens)
    np.testing.assert_allclose(out[0.9][i].logprobs, out[0.0][i].logprobs, atol=1e-5)
  with pytest.raises(E.EngineError, match="engine.min_fill=1.5"):
    E.EngineConfig(min_fill=1.5).validate()


def test_a_window_returns_for_a_refill_while_the_feed_is_open(tiny):
  """Two slots: A stops after 2 tokens, B runs 12, in windows of up to 8 steps.
  A's row goes to the callback, which submits C (2 tokens) and closes the feed.
  While the feed is open the window returns when A stops (its row may start new
  work), so C decodes beside B and stops a window before B; a closed feed's
  window would run on to B's 8th step and C would end with B."""
  params, cfg = tiny
  prompts = random_prompts([4, 6, 5], cfg.vocab_size, seed=12)
  ecfg = E.EngineConfig(slots=2, page_size=4, window=8, prefill_chunk=8, row_buckets=(2,),
                        page_buckets=(6,), prefill_buckets=(8,))
  feed = E.ListFeed([E.Request(prompts[0], tag="A", max_new_tokens=2),
                     E.Request(prompts[1], tag="B")], closed=False)
  rows = {}

  def on_row(row):
    rows[row.tag] = row
    if row.tag == "A":
      feed.submit(E.Request(prompts[2], tag="C", max_new_tokens=2))
      feed.close()

  E.run(params, cfg, feed, on_row, config=sampling.make_config(**GREEDY), engine_config=ecfg)
  a, b, c = rows["A"], rows["B"], rows["C"]
  assert a.last_window == 0 and c.first_window == 1 and b.tokens.size == R
  assert c.last_window < b.last_window, (c.last_window, b.last_window)


# ----------------------------------------------------------------------------- streaming


def test_streamed_second_round_joins_while_the_first_runs(tiny):
  """Round-1 rows (key1, stream ids i*n + j) stop; each prompt's first row submits a
  round-2 request on prompt + response (key2, stream ids i*m + j) from the row
  callback; it decodes beside the rest of round 1. Both rounds equal the static
  sampler's rows for their own prompts and keys."""
  params, cfg = tiny
  n, m = 2, 2
  prompts = random_prompts([5, 3, 8, 2], cfg.vocab_size, seed=6)
  key1, key2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
  free = sampling.sample(params, cfg, prompts, key=key1, n_per_prompt=n,
                         **dict(SAMPLED, prompt_buckets=(12, 24)))
  scfg = sampling.make_config(**dict(SAMPLED, prompt_buckets=(12, 24),
                                     stop_token_ids=(common_stop(free),)))  # ragged rows
  ecfg = E.EngineConfig(slots=4, page_size=4, window=4, prefill_chunk=8)
  feed = E.ListFeed([E.Request(p, n=n, key=key1, sid_base=i * n, tag=("r1", i))
                     for i, p in enumerate(prompts)], closed=False)
  got, r2_prompts = {}, {}

  def on_row(row):
    rnd, i = row.tag
    got[(rnd, i, row.j)] = row
    if rnd == "r1" and row.j == 0:
      fap = prompts[i] + row.tokens.tolist()
      r2_prompts[i] = fap
      feed.submit(E.Request(fap, n=m, key=key2, sid_base=i * m, tag=("r2", i)))
      if len(r2_prompts) == len(prompts):
        feed.close()

  stats = E.run(params, cfg, feed, on_row, config=scfg, engine_config=ecfg)
  assert len(got) == len(prompts) * (n + m) and stats.rows == len(got)
  # round 2 decoded beside round 1's tail: the first round-2 row started before the
  # last round-1 row's last window
  first_r2 = min(r.first_window for k, r in got.items() if k[0] == "r2")
  last_r1 = max(r.last_window for k, r in got.items() if k[0] == "r1")
  assert first_r2 < last_r1, (first_r2, last_r1)
  r1 = sampling.sample(params, cfg, prompts, key=key1, n_per_prompt=n, config=scfg)
  r2 = sampling.sample(params, cfg, [r2_prompts[i] for i in range(len(prompts))], key=key2,
                       n_per_prompt=m, config=scfg)
  for rnd, ref, k, key in (("r1", r1, n, key1), ("r2", r2, m, key2)):
    rows = [got[(rnd, i, j)] for i in range(len(prompts)) for j in range(k)]
    compare(ref, as_output(rows, ref, scfg.pad_id), params, cfg, {}, config=scfg, key=key, n=k)


def test_waiting_on_the_feed_is_timed(tiny):
  """A feed whose second request comes 0.2 s after the first row finished: the
  engine waits (nothing runnable) and counts it in verify_wait_s."""
  import time
  params, cfg = tiny
  prompts = random_prompts([4, 6], cfg.vocab_size, seed=7)

  class Late(E.ListFeed):
    def __init__(self):
      super().__init__([E.Request(prompts[0], tag=0)], closed=False)
      self.at = None

    def poll(self):
      if self.at is not None and time.perf_counter() >= self.at and not self._closed:
        self.submit(E.Request(prompts[1], tag=1))
        self.close()
      return super().poll()

  feed = Late()
  rows = []

  def on_row(row):
    rows.append(row.tag)
    if feed.at is None:
      feed.at = time.perf_counter() + 0.2

  stats = E.run(params, cfg, feed, on_row, config=sampling.make_config(**GREEDY),
                engine_config=ECFG)
  assert rows == [0, 1]
  assert 0.15 <= stats.verify_wait_s < 5, stats.verify_wait_s


# ----------------------------------------------------------------------------- compiles / input


def test_second_call_in_the_same_buckets_compiles_nothing(tiny):
  params, cfg = tiny
  kw = dict(engine_config=ECFG, n_per_prompt=2, **GREEDY)
  E.sample(params, cfg, random_prompts([3, 7, 5], cfg.vocab_size, seed=8),
           key=jax.random.PRNGKey(0), **kw)
  before = programs.compiled_programs()
  with count_compiles() as compiles:
    E.sample(params, cfg, random_prompts([6, 2, 8, 4], cfg.vocab_size, seed=9),
             key=jax.random.PRNGKey(1), **kw)
  assert compiles == [] and programs.compiled_programs() == before


def test_bad_input_raises_before_compiling(tiny):
  params, cfg = tiny
  key = jax.random.PRNGKey(0)
  with count_compiles() as compiles:
    with pytest.raises(sampling.SamplingError, match="largest prompt bucket"):
      E.sample(params, cfg, [list(range(1, 15))], key=key, engine_config=ECFG, **GREEDY)
    with pytest.raises(sampling.SamplingError, match="n_per_prompt"):
      E.sample(params, cfg, [[1, 2]], key=key, n_per_prompt=0, engine_config=ECFG, **GREEDY)
    with pytest.raises(E.EngineError, match="engine.refill_fraction"):
      E.EngineConfig(refill_fraction=0.0).validate()
    with pytest.raises(E.EngineError, match="engine.row_buckets"):
      E.Engine(cfg, sampling.make_config(**GREEDY), E.EngineConfig(slots=8, row_buckets=(4,)))
  assert compiles == []
  out = E.sample(params, cfg, [list(range(1, 15)), [5, 6]], key=key, truncate="left",
                 engine_config=ECFG, **GREEDY)
  assert out.prompt_truncated.tolist() == [True, False]


def test_logit_bias_is_added_in_both_samplers(tiny):
  """A per-prompt logit bias (the benchmark's length mix) gives the same rows in
  the static sampler and the engine; a large bias on a stop id ends the row."""
  params, cfg = tiny
  prompts = random_prompts([4, 7, 3], cfg.vocab_size, seed=10)
  bias = np.zeros((3, cfg.vocab_size), np.float32)
  bias[0, 11] = 50.0  # prompt 0: token 11 at once
  bias[2, 11] = 3.0
  kw = dict(SAMPLED, stop_token_ids=(11,))
  key = jax.random.PRNGKey(3)
  static = sampling.sample(params, cfg, prompts, key=key, n_per_prompt=2, logit_bias=bias, **kw)
  eng = E.sample(params, cfg, prompts, key=key, n_per_prompt=2, logit_bias=bias,
                 engine_config=ECFG, **kw)
  compare(static, eng, params, cfg, kw, key=key, n=2, logit_bias=bias)
  assert static.lengths[:2].tolist() == [1, 1] and static.stopped[:2].all()
  plain = sampling.sample(params, cfg, prompts, key=key, n_per_prompt=2, **kw)
  assert (plain.lengths[:2] > 1).any()


# ----------------------------------------------------------------------------- compiled plan


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="XLA's TPU compiler is missing: pip install libtpu==0.0.42.1")
def test_engine_programs_compile_for_a_tpu_topology():
  """The engine's window and prefill at their largest shapes, compiled for 4 v5p
  chips (fsdp 2 x tensor 2) with real head sizes in bf16: the window attends with
  the Pallas ragged kernel (a Mosaic custom call) and reads the pool in place (its
  temporaries are far below one pool)."""
  from jax.experimental import topologies
  from fbos_jax.planning import engine as eplan
  devs = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
  mesh = sh.make_mesh({"fsdp": 2, "tensor": 2}, devices=devs)
  cfg = qwen.ModelConfig(model_type="qwen3", vocab_size=1024, hidden_size=256,
                         intermediate_size=512, num_layers=2, num_heads=16, num_kv_heads=8,
                         head_dim=128, param_dtype="bfloat16", compute_dtype="bfloat16")
  # a pool of ~0.55 GiB per device (small ones are prefetched into fast memory whole)
  scfg = sampling.make_config(max_new_tokens=4096, prompt_buckets=(128,), stop_token_ids=(1,))
  ecfg = E.EngineConfig(slots=64, page_size=16, window=16, prefill_chunk=64)
  progs = eplan.abstract_programs(cfg, scfg, ecfg, mesh, sh.DEFAULT_RULES)
  eng = progs.pop("engine")
  assert eng.st.impl == "pallas" and eng.shards == 2
  desc = eplan.describe(eng)
  assert desc["pages_per_shard"] == 32 * 264 + 32 * 9 + 1  # slots x 264 + staged x 9 + null
  pool_dev = desc["pool_bytes_per_device"]
  assert pool_dev > 2 ** 29
  for name, (fn, args) in progs.items():
    with jax.set_mesh(mesh):
      compiled = fn.lower(*args).compile()
    ma = compiled.memory_analysis()
    assert ma.argument_size_in_bytes >= pool_dev, name
    assert ma.alias_size_in_bytes >= pool_dev, name  # the donated pool is updated in place
    assert ma.temp_size_in_bytes < pool_dev / 2, (name, ma.temp_size_in_bytes, pool_dev)
    if name == "engine_window":
      assert compiled.as_text().count("tpu_custom_call") >= 1
