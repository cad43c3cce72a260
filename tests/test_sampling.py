"""The jitted sampling engine (fbos_jax.sampling): parity with transformers,
sampler == teacher-forced log-probs, sharding, compile-once buckets, stop tokens,
determinism and input errors. Tiny random models; no downloads."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from fbos_jax import buckets
from fbos_jax import sampling
from fbos_jax.program_cache import count_compiles
from fbos_jax import sharding as sh
from fbos_jax.model import load_hf_params, qwen

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
PROMPT_LENGTHS = [7, 2, 5, 4]


def build_hf_model(model_type: str, seed: int = 0):
  """Random tiny Qwen3/Qwen2 (float32), weights perturbed so logits are peaked enough
  for greedy decoding to be far from ties."""
  torch.manual_seed(seed)
  if model_type == "qwen3":
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **TINY, head_dim=32, tie_word_embeddings=True, rope_theta=5000.0, rms_norm_eps=1e-5,
        attn_implementation="eager"))
  else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **TINY, tie_word_embeddings=False, rope_theta=20000.0, rms_norm_eps=1e-6,
        attn_implementation="eager"))
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        p.copy_(1.0 + 0.3 * noise)
      elif name.endswith("bias"):
        p.copy_(0.2 * noise)
      else:
        p.copy_(0.15 * noise)
  return model.float().eval()


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def hf_case(request, tmp_path_factory):
  model = build_hf_model(request.param)
  path = tmp_path_factory.mktemp(f"sampling_{request.param}")
  model.save_pretrained(path)
  params, cfg = load_hf_params(path)
  return model, params, cfg


@pytest.fixture(scope="module")
def tiny():
  cfg = qwen.ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64,
                         intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, rope_theta=10000.0)
  # numpy init (fast, no per-shape compiles); weights larger than the 0.02 default so
  # the next-token distributions are peaked and varied
  rng = np.random.default_rng(0)
  params = jax.tree.map(
      lambda s: jnp.asarray(1.0 + 0.2 * rng.standard_normal(s[0]) if len(s[0]) < 3 and
                            s[1][-1] == "norm" else 0.12 * rng.standard_normal(s[0]), jnp.float32),
      qwen.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple))
  return params, cfg


# Most tests share these compiled programs: prompt bucket 8, batch bucket 4, 8 new tokens.
GREEDY = dict(temperature=0.0, max_new_tokens=8, prompt_buckets=(8,), batch_buckets=(4,))
SAMPLED = dict(temperature=0.7, top_k=4, top_p=0.7, max_new_tokens=8, prompt_buckets=(8,),
               batch_buckets=(4,))


def random_prompts(lengths, vocab, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, n).tolist() for n in lengths]




# ----------------------------------------------------------------------------- 1. HF parity


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_greedy_matches_transformers_generate(hf_case, layer_loop):
  """Greedy tokens == transformers generate(do_sample=False) on a left-padded batch."""
  model, params, cfg = hf_case
  if cfg.model_type == "qwen2" and layer_loop == "scan":
    pytest.skip("the scan loop is covered on qwen3")
  new = 10
  prompts = random_prompts(PROMPT_LENGTHS, cfg.vocab_size, seed=3)
  t = max(PROMPT_LENGTHS)
  ids = np.zeros((len(prompts), t), np.int64)
  att = np.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, t - len(p):] = p
    att[i, t - len(p):] = 1
  with torch.no_grad():
    ref = model.generate(torch.tensor(ids), attention_mask=torch.tensor(att), do_sample=False,
                         max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                         pad_token_id=0)[:, t:].numpy()
  out = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0), temperature=0.0,
                        max_new_tokens=new, prompt_buckets=(8, 16), batch_buckets=(4,),
                        layer_loop=layer_loop)
  assert out.tokens.shape == (4, new)
  np.testing.assert_array_equal(out.tokens, ref)
  assert (out.lengths == new).all() and (out.response_mask == 1).all()
  # the returned prompts are the left-padded inputs
  np.testing.assert_array_equal(out.prompt_mask[:, -t:], att)
  np.testing.assert_array_equal(np.where(out.prompt_mask[:, -t:] == 1, out.prompt_tokens[:, -t:], 0),
                                ids)


# ----------------------------------------------------------------------------- 2. log-probs


def test_sampled_logprobs_equal_teacher_forced_forward(tiny):
  """Sampler log-probs == log_softmax(apply(prompt + response) / T)[token] within 1e-4,
  with temperature != 1, top-k and top-p on; sampled tokens obey top-k / top-p."""
  params, cfg = tiny
  temp, top_k, top_p, n, r = SAMPLED["temperature"], SAMPLED["top_k"], SAMPLED["top_p"], 2, 8
  prompts = random_prompts([5, 8, 3], cfg.vocab_size, seed=1)
  out = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(7), n_per_prompt=n,
                        stop_token_ids=(5,), **SAMPLED)
  assert out.tokens.shape == (6, r) and out.prompt_tokens.shape == (6, 8)
  # rows are prompt-major: row i*n+j was sampled under prompt i
  for i, p in enumerate(prompts):
    for j in range(n):
      assert out.prompt_tokens[i * n + j, -len(p):].tolist() == p
  ref = jax.jit(sampling.teacher_forced_logprobs, static_argnums=1,
                static_argnames="temperature")(
      params, cfg, out.prompt_tokens, out.prompt_mask, out.tokens, out.response_mask,
      temperature=temp)
  m = out.response_mask.astype(bool)
  assert m.sum() > 15
  err = np.abs(np.asarray(ref) - out.logprobs)[m].max()
  assert err < 1e-4, f"sampler vs teacher-forced log-prob max error {err}"
  assert (out.logprobs[~m] == 0).all() and (out.tokens[~m] == 0).all()
  assert len({tuple(out.tokens[j]) for j in range(n)}) > 1, "the n samples of a group differ"

  # every sampled token lies inside the top-k / top-p set of its step
  seq = np.concatenate([out.prompt_tokens, out.tokens], 1)
  smask = np.concatenate([out.prompt_mask, out.response_mask], 1)
  logits = np.asarray(jax.jit(qwen.apply, static_argnums=3)(params, seq, smask, cfg))
  z = logits[:, 7:7 + r] / temp
  for r, t in zip(*np.nonzero(m)):
    order = np.argsort(-z[r, t])
    rank = int(np.nonzero(order == out.tokens[r, t])[0][0])
    assert rank < top_k
    top = z[r, t][order[:top_k]]  # top-p acts on the top-k distribution, renormalised
    probs = np.exp(top - top.max())
    probs /= probs.sum()
    assert probs[:rank].sum() < top_p + 1e-5


def test_greedy_logprobs_are_temperature_one(tiny):
  params, cfg = tiny
  prompts = random_prompts([4, 6, 2], cfg.vocab_size, seed=2)
  out = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0), **GREEDY)
  ref = jax.jit(sampling.teacher_forced_logprobs, static_argnums=1)(
      params, cfg, out.prompt_tokens, out.prompt_mask, out.tokens, out.response_mask)
  np.testing.assert_allclose(out.logprobs, np.asarray(ref), atol=1e-4)


def test_decode_phases_match_one_loop_and_teacher_forcing(tiny):
  """Decoding in phases over a growing cache (attention over the filled part only)
  gives the single-loop result; sampled log-probs still equal teacher forcing; stop
  tokens end rows across phase boundaries."""
  params, cfg = tiny
  r = 40
  assert sampling.decode_phase_lengths(8, r, 4) == (24, 40, 47)
  assert sampling.decode_phase_lengths(8, r, 1) == (47,)
  prompts = random_prompts([3, 8, 5], cfg.vocab_size, seed=12)
  base = dict(max_new_tokens=r, prompt_buckets=(8,), batch_buckets=(4,))
  for layer_loop in ("unroll", "scan"):
    kw = dict(base, temperature=0.0, layer_loop=layer_loop)
    one = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0), decode_phases=1, **kw)
    ph = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0), decode_phases=4, **kw)
    np.testing.assert_array_equal(ph.tokens, one.tokens)
    np.testing.assert_allclose(ph.logprobs, one.logprobs, atol=1e-5)
  kw = dict(base, temperature=0.8, top_k=0, n_per_prompt=2)
  out = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(3), decode_phases=4, **kw)
  ref = jax.jit(sampling.teacher_forced_logprobs, static_argnums=1,
                static_argnames="temperature")(
      params, cfg, out.prompt_tokens, out.prompt_mask, out.tokens, out.response_mask,
      temperature=0.8)
  assert out.response_mask.all()
  err = np.abs(np.asarray(ref) - out.logprobs).max()
  assert err < 1e-4, f"sampler vs teacher-forced log-prob max error {err}"
  # stop on a token that row 0 emits in the second phase
  stop = int(out.tokens[0, 20])
  first = int(np.nonzero(out.tokens[0] == stop)[0][0])
  stopped = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(3), decode_phases=4,
                            stop_token_ids=(stop,), **kw)
  assert stopped.lengths[0] == first + 1
  np.testing.assert_array_equal(stopped.tokens[0, :first + 1], out.tokens[0, :first + 1])
  assert (stopped.tokens[0, first + 1:] == 0).all()


# ----------------------------------------------------------------------------- 3. sharding


def test_sharded_equals_single_device_and_second_call_compiles_nothing(tiny):
  params, cfg = tiny
  mesh = sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  prompts = random_prompts([3, 7, 5, 2], cfg.vocab_size, seed=4)
  kw = dict(GREEDY, n_per_prompt=2)
  single = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(1), **kw)
  sharded = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(1), mesh=mesh,
                            rules=sh.DEFAULT_RULES, **kw)
  np.testing.assert_array_equal(sharded.tokens, single.tokens)
  np.testing.assert_allclose(sharded.logprobs, single.logprobs, atol=1e-5)
  np.testing.assert_array_equal(sharded.lengths, single.lengths)

  fn = sampling.get_generate_fn(cfg, sampling.make_config(**{k: v for k, v in kw.items()
                                                              if k != "n_per_prompt"}),
                                batch=4, prompt_len=8, n_per_prompt=2, mesh=mesh,
                                rules=sh.DEFAULT_RULES)
  assert fn._cache_size() == 1
  programs = sampling.compiled_programs()
  other = random_prompts([8, 1, 4], cfg.vocab_size, seed=5)  # same buckets: P=8, B=4
  with count_compiles() as compiles:
    again = sampling.sample(params, cfg, other, key=jax.random.PRNGKey(2), mesh=mesh,
                            rules=sh.DEFAULT_RULES, **kw)
  assert compiles == [], f"{len(compiles)} compilation(s) on a second call in the same bucket"
  assert fn._cache_size() == 1 and sampling.compiled_programs() == programs
  assert again.tokens.shape == (6, 8)


def test_compiled_decode_loop_updates_cache_in_place(tiny):
  """No cache-sized copy inside the compiled loops (only the initial one)."""
  params, cfg = tiny
  for layer_loop, over in (("unroll", {}), ("scan", {}),
                           ("unroll", dict(max_new_tokens=40, decode_phases=4))):
    scfg = sampling.make_config(layer_loop=layer_loop, **{**GREEDY, **over})
    fn = sampling.get_generate_fn(cfg, scfg, batch=4, prompt_len=8)
    toks, mask = buckets.left_pad([np.array([1, 2, 3])], 8, 0, rows=4)
    hlo = fn.lower(params, jnp.asarray(toks), jnp.asarray(mask), jax.random.PRNGKey(0),
                   np.float32(1), np.float32(1),
                   sampling.stop_id_array(())).compile().as_text()
    lens = sampling.decode_phase_lengths(8, scfg.max_new_tokens, scfg.decode_phases)
    cache_shapes = [x for s in lens for x in (f"[4,2,16,{s}]", f"[4,2,{s},16]",
                                               f"[2,4,2,16,{s}]", f"[2,4,2,{s},16]")]
    comps = re.split(r"\n(?=\S)", hlo)  # one chunk per computation
    bad = [line.strip()[:120] for c in comps if not c.startswith("ENTRY")
           for line in c.splitlines() if " copy(" in line and any(x in line for x in cache_shapes)]
    assert not bad, f"{layer_loop}: cache copies inside a loop: {bad}"


# ----------------------------------------------------------------------------- 4. semantics


def test_same_key_same_output_different_key_different_output(tiny):
  params, cfg = tiny
  prompts = random_prompts([4, 6, 2], cfg.vocab_size, seed=6)
  kw = dict(SAMPLED, n_per_prompt=2, temperature=1.0)
  a = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(11), **kw)
  b = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(11), **kw)
  c = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(12), **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert (a.tokens != c.tokens).mean() > 0.3
  # typed keys work too
  d = sampling.sample(params, cfg, prompts, key=jax.random.key(11), **kw)
  assert d.tokens.shape == a.tokens.shape


def test_stop_tokens_end_rows_and_mask(tiny):
  params, cfg = tiny
  prompts = random_prompts([3, 5, 4, 6], cfg.vocab_size, seed=8)
  kw = dict(GREEDY, pad_id=0)
  r = kw["max_new_tokens"]
  free = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0),
                         stop_token_ids=(cfg.vocab_size - 1,), **kw)  # (a never-emitted id)
  assert not free.stopped.any() and (free.lengths == r).all()
  # stop on the token row 0 emits at step 3 (and on an id nobody emits)
  stop = int(free.tokens[0, 3])
  assert cfg.vocab_size - 1 not in free.tokens
  unused = next(t for t in range(1, cfg.vocab_size) if t not in free.tokens)
  out = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0),
                        stop_token_ids=(unused, stop), **kw)  # same program: ids are runtime
  for row in range(4):
    hits = np.nonzero(free.tokens[row] == stop)[0]
    n = int(hits[0]) + 1 if hits.size else r
    assert out.lengths[row] == n and bool(out.stopped[row]) == bool(hits.size)
    np.testing.assert_array_equal(out.tokens[row, :n], free.tokens[row, :n])
    assert (out.tokens[row, n:] == 0).all() and (out.logprobs[row, n:] == 0).all()
    assert out.response_mask[row].tolist() == [1] * n + [0] * (r - n)
    np.testing.assert_allclose(out.logprobs[row, :n], free.logprobs[row, :n], atol=1e-6)
  assert out.lengths[0] == 4
  # every row stops at once: the loop exits early and the rest is padding
  first = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0),
                          stop_token_ids=tuple(int(t) for t in free.tokens[:, 0]), **kw)
  assert (first.lengths == 1).all() and (first.tokens[:, 1:] == 0).all()


def test_group_rows_and_batch_buckets(tiny):
  """n samples per prompt come prompt-major; dummy rows are dropped; more prompts than
  the largest batch bucket run in chunks with identical greedy results."""
  params, cfg = tiny
  prompts = random_prompts([3, 5, 4, 6, 2], cfg.vocab_size, seed=9)
  kw = dict(GREEDY, n_per_prompt=2)
  whole = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0),
                          **dict(kw, batch_buckets=(8,)))
  chunked = sampling.sample(params, cfg, prompts, key=jax.random.PRNGKey(0), **kw)  # 4 + 1
  assert whole.tokens.shape == chunked.tokens.shape == (10, 8)
  np.testing.assert_array_equal(whole.tokens, chunked.tokens)
  np.testing.assert_array_equal(whole.tokens[0::2], whole.tokens[1::2])  # greedy: equal pairs
  single = sampling.sample(params, cfg, prompts[3:4], key=jax.random.PRNGKey(0), **kw)
  assert single.tokens.shape == (2, 8)
  np.testing.assert_array_equal(single.tokens[0], whole.tokens[6])


def test_bad_input_raises_before_compiling(tiny):
  params, cfg = tiny
  ok = random_prompts([3, 4], cfg.vocab_size)
  key = jax.random.PRNGKey(0)
  base = dict(GREEDY)
  cases = [
      (dict(prompts=[list(range(1, 10))]), "largest prompt bucket"),
      (dict(max_new_tokens=0), "max_new_tokens"),
      (dict(max_new_tokens=-3), "max_new_tokens"),
      (dict(top_p=0.0), "top_p"),
      (dict(top_p=1.5), "top_p"),
      (dict(prompts=[]), "empty batch"),
      (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
      (dict(prompts=[[1, cfg.vocab_size]]), "outside"),
      (dict(temperature=-1.0), "temperature"),
      (dict(truncate="middle"), "truncate"),
      (dict(n_per_prompt=0), "n_per_prompt"),
  ]
  with count_compiles() as compiles:
    for over, msg in cases:
      kw = {**base, **over}
      prompts = kw.pop("prompts", ok)
      with pytest.raises(sampling.SamplingError, match=msg):
        sampling.sample(params, cfg, prompts, key=key, **kw)
  assert compiles == []
  # the explicit alternative to raising: keep the last tokens of a too-long prompt
  long = list(range(1, 12))
  out = sampling.sample(params, cfg, [long, [5, 6]], key=key, truncate="left", **base)
  assert out.prompt_truncated.tolist() == [True, False]
  assert out.prompt_tokens[0].tolist() == long[-8:] and out.prompt_mask[0].all()
  short = sampling.sample(params, cfg, [long[-8:], [5, 6]], key=key, **base)
  np.testing.assert_array_equal(out.tokens, short.tokens)


def test_padded_array_input_with_mask(tiny):
  """A right-padded [B, T] array + mask gives the same rows as the list form."""
  params, cfg = tiny
  prompts = random_prompts([3, 6], cfg.vocab_size, seed=10)
  arr = np.zeros((2, 6), np.int32)
  mask = np.zeros((2, 6), np.int32)
  for i, p in enumerate(prompts):
    arr[i, :len(p)] = p
    mask[i, :len(p)] = 1
  kw = dict(GREEDY, key=jax.random.PRNGKey(3))
  a = sampling.sample(params, cfg, arr, prompt_mask=mask, **kw)
  b = sampling.sample(params, cfg, prompts, **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
