"""Benchmark the jitted sampler against transformers ``generate`` on the same machine.

    python launch/bench_sampler.py            # the issue's setup, ~2-4 minutes on 2 cores
    python launch/bench_sampler.py --real_vocab --repeats=3 --no-scan_row --no-bf16 \
        --long_new_tokens=0
    python launch/bench_sampler.py --model=/ckpt/Qwen3-0.6B   # any local HF Qwen2/Qwen3 dir

``--real_vocab`` builds a random Qwen3 of real shape in a temp dir (vocabulary
151,936, head_dim 128, 16 / 8 heads, hidden 256, 2 layers, ``fbos_jax.testing.
qwen_fixture``; needs the test dependencies), ``--model=DIR`` loads a checkpoint
directory; both run in float32 and also report the LM-head check: the largest
vocabulary-sized buffer of the compiled sampler (other than the [D, V] weight)
must hold at most [rows, V] logits, i.e. no [rows, T, V] tensor per step.

Setup (issue 8): a random tiny Qwen3 (vocab 2048, hidden 256, 4 layers, 4 heads,
2 KV heads, head_dim 64, intermediate 768), batch 16, prompt 32, 128 new tokens,
EOS disabled, float32. Both implementations get the same weights (the HF model
is saved and imported with ``load_hf_params``). transformers runs on torch CPU
with ``torch.set_num_threads(--threads)``. Every figure is the median of
``--repeats`` timed runs after one warm-up run (ours: end-to-end ``sample()``
calls, host input/output included; the program is compiled during warm-up).
Ours and transformers are timed in alternation (A B A B ...) so that both see
the same background load.

Reported: new tokens/s (greedy and sampling at temperature 1, top_k 0), the
cost per token at 512 vs 128 new tokens, the sampler's achieved GFLOP/s (decode
FLOPs: weight matmuls + attention over the filled cache) next to the float32
matmul peak measured in the same run (and the bytes streamed per second next to
the measured read bandwidth), and
optionally a bfloat16 row. The last
line is JSON with ``ours_tok_s``, ``hf_tok_s``, ``ratio`` (greedy float32),
``cost_growth_512_vs_128`` (None with ``--long_new_tokens=0``), ``model`` and, for
``--model`` / ``--real_vocab``, ``vocab_size`` and ``max_logits_rows`` (the
largest vocabulary-sized buffer's rows; the check passes when it is <= the batch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fbos_jax import sampling  # noqa: E402
from fbos_jax.model import qwen  # noqa: E402

MODEL = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, intermediate_size=768)


_F = flags.FLAGS
flags.DEFINE_integer("batch", 16, "prompts per call")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens")
flags.DEFINE_integer("new_tokens", 128, "new tokens per row")
flags.DEFINE_integer("long_new_tokens", 512, "second length for the cost-per-token growth figure")
flags.DEFINE_integer("repeats", 5, "timed runs (the median is reported)")
flags.DEFINE_integer("threads", 2, "torch threads for transformers")
flags.DEFINE_enum("layer_loop", "auto", list(sampling.LAYER_LOOPS), "sampling.layer_loop")
flags.DEFINE_bool("scan_row", True, "also time layer_loop='scan' (greedy)")
flags.DEFINE_bool("bf16", True, "also time a bfloat16 model (greedy)")
flags.DEFINE_bool("skip_hf", False, "do not time transformers' generate")
flags.DEFINE_integer("seed", 0, "model and prompts")
flags.DEFINE_string("model", "", "a local HF Qwen2/Qwen3 checkpoint directory (float32); "
                    "default: the tiny random model above")
flags.DEFINE_bool("real_vocab", False,
                  "build a random real-shape Qwen3 (vocab 151,936) in a temp dir and use it")
flags.register_multi_flags_validator(
    ["model", "real_vocab"], lambda f: not (f["model"] and f["real_vocab"]),
    message="--model and --real_vocab are exclusive")


def median_time(fn, repeats: int) -> tuple[float, list]:
  fn()  # warm-up (compiles)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def alternating_median(fns: dict, repeats: int) -> dict:
  """Warm each up, then time them in turns (A B A B ...) so that both see the same
  machine load; returns {name: (median seconds, all runs)}."""
  for f in fns.values():
    f()
  runs = {k: [] for k in fns}
  for _ in range(repeats):
    for k, f in fns.items():
      t0 = time.perf_counter()
      f()
      runs[k].append(time.perf_counter() - t0)
  return {k: (statistics.median(v), v) for k, v in runs.items()}


def matmul_peak_gflops(repeats: int) -> dict:
  """float32 matmul throughput of this machine, measured now."""
  out = {}
  for name, (m, k, n) in {"2048^3": (2048, 2048, 2048), "16x256x1536": (16, 256, 1536)}.items():
    a = jnp.ones((m, k), jnp.float32)
    b = jnp.ones((k, n), jnp.float32)
    iters = 1 if m > 16 else 200
    if iters == 1:
      f = jax.jit(lambda a, b: a @ b)
    else:
      f = jax.jit(lambda a, b: jax.lax.fori_loop(
          0, iters, lambda i, x: x.at[:, :k].add((x @ b)[:, :k] * 1e-6), a))
    t, _ = median_time(lambda: jax.block_until_ready(f(a, b)), max(repeats, 5))
    out[name] = 2 * m * k * n * iters / t / 1e9
  return out


def read_bandwidth_gbs(repeats: int) -> float:
  """Streaming read bandwidth (GB/s) over 64 MiB, measured now. Decode at batch 16 reads
  every weight once per step (~8 FLOP/byte), but on this CPU it streams well below
  this figure: the bound we measured is the one-thread speed of its small-M matmuls
  (XLA runs the decode loop on one thread), not memory bandwidth."""
  x = jnp.ones((16 * 1024 * 1024 // 256, 256), jnp.float32)
  f = jax.jit(lambda x: jax.lax.fori_loop(0, 10, lambda i, c: c + jnp.sum(x + c), 0.0))
  t, _ = median_time(lambda: jax.block_until_ready(f(x)), max(repeats, 5))
  return 10 * x.size * 4 / t / 1e9


def dims_of(cfg) -> dict:
  """The sizes the FLOP / byte counts need, from a ModelConfig (names as in MODEL)."""
  return dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              vocab_size=cfg.vocab_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              head_dim=cfg.head_dim)


def decode_bytes(batch: int, prompt_len: int, new_tokens: int,
                 phases: int = sampling.SamplingConfig.decode_phases, dims: dict = MODEL) -> float:
  """Bytes the float32 decode steps stream, summed over the steps: all weights plus
  the KV cache of the step's decode phase (its length from
  ``sampling.decode_phase_lengths``; the whole preallocated cache with phases=1)."""
  d, f, v, l = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"], \
      dims["num_hidden_layers"]
  h, k, dh = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
  weights = l * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f) + d * v
  lens = sampling.decode_phase_lengths(prompt_len, new_tokens, phases)
  total = 0.0
  for i in range(1, new_tokens):  # step i writes slot prompt_len + i - 1
    slots = next(n for n in lens if prompt_len + i - 1 < n)
    total += weights + 2 * l * batch * k * dh * slots
  return 4.0 * total


def decode_flops(batch: int, prompt_len: int, new_tokens: int, dims: dict = MODEL) -> float:
  """FLOPs of generating new_tokens per row with a KV cache (weights + attention over the
  filled cache; the first token comes from the prefill and is not counted)."""
  d, f, v, l = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"], \
      dims["num_hidden_layers"]
  h, k, dh = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
  weights = l * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f) + d * v
  total = 0.0
  for t in range(1, new_tokens):
    ctx = prompt_len + t
    total += 2 * weights + 4 * l * h * dh * ctx
  return batch * total


_HLO_SHAPE = re.compile(r"\b(?:f64|f32|bf16|f16|s64|s32|u32|s8|u8|pred)\[([0-9,]*)\]")


def vocab_buffers(hlo_text: str, vocab: int, hidden: int) -> dict:
  """Every distinct array shape with a vocabulary-sized axis in compiled HLO text, except
  the [V, D] / [D, V] weights: {shape: rows}, rows = elements / V."""
  out = {}
  for m in _HLO_SHAPE.finditer(hlo_text):
    shape = tuple(int(x) for x in m.group(1).split(",") if x)
    if vocab in shape and sorted(shape) != sorted((vocab, hidden)):
      out[shape] = int(np.prod(shape)) // vocab
  return out


def logits_check(params, cfg, prompt, rows: int, new_tokens: int) -> dict:
  """Compiles the greedy sampler for this batch and reports its vocabulary-sized
  buffers: with the LM head applied to the last position only, none holds more than
  [rows, V] (no [rows, T, V] logits in the prefill or per decode step)."""
  b, p = prompt.shape
  scfg = sampling.make_config(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=(),
                              prompt_buckets=(p,), batch_buckets=(b,))
  fn = sampling.get_generate_fn(cfg, scfg, batch=b, prompt_len=p)
  compiled = fn.lower(params, jnp.asarray(prompt, jnp.int32), jnp.ones((b, p), jnp.int32),
                      jax.random.PRNGKey(0), np.float32(1.0), np.float32(1.0),
                      sampling.stop_id_array(()), jnp.arange(b, dtype=jnp.int32)).compile()
  bufs = vocab_buffers(compiled.as_text(), cfg.vocab_size, cfg.hidden_size)
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  return {"shapes": sorted(bufs), "max_rows": max(bufs.values(), default=0), "rows": rows,
          "ok": max(bufs.values(), default=0) <= rows, "temp_bytes": temp}


def load_model(args, tmp: str):
  """(HF torch model float32, our params, our cfg, description) for the chosen model."""
  import torch
  import transformers
  from fbos_jax.model.hf import load_hf_params
  if args.real_vocab or args.model:
    path = args.model
    if args.real_vocab:
      from fbos_jax.testing.qwen_fixture import build_qwen3_checkpoint
      path = build_qwen3_checkpoint(os.path.join(tmp, "qwen3_real_vocab"), seed=args.seed,
                                    dtype="float32", with_tokenizer=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()
    params, cfg = load_hf_params(path)
    name = "real_vocab (random Qwen3 fixture)" if args.real_vocab else path
    return model, params, cfg, name
  torch.manual_seed(args.seed)
  hf_cfg = transformers.Qwen3Config(**MODEL, tie_word_embeddings=True, max_position_embeddings=4096,
                                    attn_implementation="sdpa")
  model = transformers.Qwen3ForCausalLM(hf_cfg).float().eval()
  model.save_pretrained(tmp)
  params, cfg = load_hf_params(tmp)
  return model, params, cfg, "tiny"


def main(argv):
  del argv
  args = _F
  import torch
  import transformers

  torch.set_num_threads(args.threads)
  with tempfile.TemporaryDirectory() as tmp:
    model, params, cfg, model_name = load_model(args, tmp)
  params = jax.device_put(params)
  dims = dims_of(cfg)

  rng = np.random.default_rng(args.seed)
  b, p, r = args.batch, args.prompt_len, args.new_tokens
  # token ids of the BPE vocabulary (below the added tokens on a real Qwen vocabulary)
  prompt = rng.integers(0, min(cfg.vocab_size, 151_643), (b, p)).astype(np.int64)
  key = jax.random.PRNGKey(args.seed)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} devices), "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"transformers {transformers.__version__}")
  print(f"model {model_name}: {dims}; batch {b}, prompt {p}, new tokens {r}, EOS disabled, "
        f"median of {args.repeats} runs after a warm-up")
  check = None
  if model_name != "tiny":
    check = logits_check(params, cfg, prompt, b, r)
    print(f"ours  LM head: vocabulary-sized buffers of the compiled greedy sampler (weights "
          f"excluded): {check['shapes']}; largest holds {check['max_rows']} rows of "
          f"V={cfg.vocab_size} for {b} rows -> {'OK' if check['ok'] else 'MORE THAN [rows, V]'}"
          f" (temp buffers {check['temp_bytes'] / 2**20:.1f} MiB, [rows, V] float32 logits "
          f"{b * cfg.vocab_size * 4 / 2**20:.1f} MiB)")

  def ours(n_new, greedy=True, prm=params, c=cfg, layer_loop=args.layer_loop):
    def run():
      out = sampling.sample(prm, c, prompt, key=key, max_new_tokens=n_new,
                            temperature=0.0 if greedy else 1.0, top_k=0, top_p=1.0,
                            stop_token_ids=(), prompt_buckets=(p,), batch_buckets=(b,),
                            layer_loop=layer_loop)
      assert out.lengths.min() == n_new, "EOS must be disabled"
      return out
    return run

  def hf(greedy=True):
    ids = torch.tensor(prompt)
    att = torch.ones_like(ids)
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0,
                                                     top_p=1.0)

    def run():
      with torch.no_grad():
        out = model.generate(ids, attention_mask=att, max_new_tokens=r, min_new_tokens=r,
                             eos_token_id=None, pad_token_id=0, **kw)
      assert out.shape[1] == p + r
      return out
    return run

  rows = {}
  tok = b * r
  for mode in ("greedy", "sample"):
    fns = {"ours": ours(r, greedy=mode == "greedy")}
    if not args.skip_hf:
      fns["HF"] = hf(greedy=mode == "greedy")
    times = alternating_median(fns, args.repeats)
    for name, (t, ts) in times.items():
      rows[f"{name}_{mode}"] = tok / t
      print(f"{name:5s} {mode:7s} float32: {tok / t:9.0f} new tok/s  ({t * 1e3:.1f} ms per call; "
            f"runs {', '.join(f'{x * 1e3:.0f}' for x in ts)} ms)")
    if not args.skip_hf:
      print(f"      {mode:7s} ratio ours/HF: {rows[f'ours_{mode}'] / rows[f'HF_{mode}']:.2f}")

  if args.scan_row:
    t, _ = median_time(ours(r, layer_loop="scan"), args.repeats)
    print(f"ours  greedy  float32 layer_loop=scan: {tok / t:9.0f} new tok/s")

  t_short = tok / rows["ours_greedy"]
  growth = None
  if args.long_new_tokens:
    t_long, _ = median_time(ours(args.long_new_tokens), max(3, args.repeats // 2))
    growth = (t_long / args.long_new_tokens) / (t_short / r)
    print(f"ours  greedy  cost per token at {args.long_new_tokens} vs {r} new tokens: "
          f"{growth:.2f}x ({t_long / args.long_new_tokens / b * 1e6:.1f} vs "
          f"{t_short / r / b * 1e6:.1f} us per row-token)")

  peak = matmul_peak_gflops(args.repeats)
  achieved = decode_flops(b, p, r, dims) / t_short / 1e9
  print(f"ours  greedy  achieved {achieved:.1f} GFLOP/s of decode FLOPs; float32 matmul peak "
        f"measured now: {peak['2048^3']:.1f} GFLOP/s (2048^3), "
        f"{peak['16x256x1536']:.1f} GFLOP/s at the decode shape 16x256x1536")
  bw = read_bandwidth_gbs(args.repeats)
  lens = sampling.decode_phase_lengths(p, r, sampling.SamplingConfig.decode_phases)
  streamed = decode_bytes(b, p, r, dims=dims) / t_short / 1e9
  print(f"ours  greedy  streams {streamed:.1f} GB/s of weights + "
        f"KV cache (decode phases over cache lengths {lens}); read bandwidth measured now: "
        f"{bw:.1f} GB/s")

  if args.bf16:
    cfg16 = dataclasses.replace(cfg, param_dtype="bfloat16", compute_dtype="bfloat16")
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    t, _ = median_time(ours(r, prm=p16, c=cfg16), args.repeats)
    print(f"ours  greedy  bfloat16: {tok / t:9.0f} new tok/s")

  ours_tok = rows["ours_greedy"]
  hf_tok = rows.get("HF_greedy")  # None with --skip_hf
  line = {"ours_tok_s": round(ours_tok, 1),
          "hf_tok_s": None if hf_tok is None else round(hf_tok, 1),
          "ratio": None if hf_tok is None else round(ours_tok / hf_tok, 3),
          "cost_growth_512_vs_128": None if growth is None else round(growth, 3),
          "model": model_name}
  if check is not None:
    line.update(vocab_size=cfg.vocab_size, max_logits_rows=check["max_rows"], batch=b)
  print(json.dumps(line))


if __name__ == "__main__":
  app.run(main)
