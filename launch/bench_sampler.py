"""Benchmark the jitted sampler against transformers ``generate`` on the same machine.

    python launch/bench_sampler.py            # the issue's setup, ~2-4 minutes on 2 cores

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
line is JSON with ``ours_tok_s``, ``hf_tok_s``, ``ratio`` (greedy float32) and
``cost_growth_512_vs_128``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fbos_jax import sampling  # noqa: E402
from fbos_jax.model import qwen  # noqa: E402

MODEL = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, intermediate_size=768)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--long_new_tokens", type=int, default=512,
                  help="second length for the cost-per-token growth figure")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--threads", type=int, default=2, help="torch threads for transformers")
  ap.add_argument("--layer_loop", default="auto", choices=sampling.LAYER_LOOPS)
  ap.add_argument("--scan_row", action=argparse.BooleanOptionalAction, default=True,
                  help="also time layer_loop='scan' (greedy)")
  ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                  help="also time a bfloat16 model (greedy)")
  ap.add_argument("--skip_hf", action="store_true")
  ap.add_argument("--seed", type=int, default=0)
  return ap.parse_args(argv)


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


def decode_bytes(batch: int, prompt_len: int, new_tokens: int,
                 phases: int = sampling.SamplingConfig.decode_phases) -> float:
  """Bytes the float32 decode steps stream, summed over the steps: all weights plus
  the KV cache of the step's decode phase (its length from
  ``sampling.decode_phase_lengths``; the whole preallocated cache with phases=1)."""
  d, f, v, l = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"], \
      MODEL["num_hidden_layers"]
  h, k, dh = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], MODEL["head_dim"]
  weights = l * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f) + d * v
  lens = sampling.decode_phase_lengths(prompt_len, new_tokens, phases)
  total = 0.0
  for i in range(1, new_tokens):  # step i writes slot prompt_len + i - 1
    slots = next(n for n in lens if prompt_len + i - 1 < n)
    total += weights + 2 * l * batch * k * dh * slots
  return 4.0 * total


def decode_flops(batch: int, prompt_len: int, new_tokens: int) -> float:
  """FLOPs of generating new_tokens per row with a KV cache (weights + attention over the
  filled cache; the first token comes from the prefill and is not counted)."""
  d, f, v, l = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"], \
      MODEL["num_hidden_layers"]
  h, k, dh = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], MODEL["head_dim"]
  weights = l * (d * (h + 2 * k) * dh + h * dh * d + 3 * d * f) + d * v
  total = 0.0
  for t in range(1, new_tokens):
    ctx = prompt_len + t
    total += 2 * weights + 4 * l * h * dh * ctx
  return batch * total


def main(argv=None):
  args = parse_args(argv)
  import torch
  import transformers
  from fbos_jax.model.hf import load_hf_params

  torch.set_num_threads(args.threads)
  torch.manual_seed(args.seed)
  hf_cfg = transformers.Qwen3Config(**MODEL, tie_word_embeddings=True, max_position_embeddings=4096,
                                    attn_implementation="sdpa")
  model = transformers.Qwen3ForCausalLM(hf_cfg).float().eval()
  with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)
    params, cfg = load_hf_params(tmp)
  params = jax.device_put(params)

  rng = np.random.default_rng(args.seed)
  b, p, r = args.batch, args.prompt_len, args.new_tokens
  prompt = rng.integers(0, MODEL["vocab_size"], (b, p)).astype(np.int64)
  key = jax.random.PRNGKey(args.seed)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} devices), "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"transformers {transformers.__version__}")
  print(f"model: {MODEL}; batch {b}, prompt {p}, new tokens {r}, EOS disabled, "
        f"median of {args.repeats} runs after a warm-up")

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

  t_long, _ = median_time(ours(args.long_new_tokens), max(3, args.repeats // 2))
  t_short = tok / rows["ours_greedy"]
  growth = (t_long / args.long_new_tokens) / (t_short / r)
  print(f"ours  greedy  cost per token at {args.long_new_tokens} vs {r} new tokens: "
        f"{growth:.2f}x ({t_long / args.long_new_tokens / b * 1e6:.1f} vs "
        f"{t_short / r / b * 1e6:.1f} us per row-token)")

  peak = matmul_peak_gflops(args.repeats)
  achieved = decode_flops(b, p, r) / t_short / 1e9
  print(f"ours  greedy  achieved {achieved:.1f} GFLOP/s of decode FLOPs; float32 matmul peak "
        f"measured now: {peak['2048^3']:.1f} GFLOP/s (2048^3), "
        f"{peak['16x256x1536']:.1f} GFLOP/s at the decode shape 16x256x1536")
  bw = read_bandwidth_gbs(args.repeats)
  lens = sampling.decode_phase_lengths(p, r, sampling.SamplingConfig.decode_phases)
  print(f"ours  greedy  streams {decode_bytes(b, p, r) / t_short / 1e9:.1f} GB/s of weights + "
        f"KV cache (decode phases over cache lengths {lens}); read bandwidth measured now: "
        f"{bw:.1f} GB/s")

  if args.bf16:
    cfg16 = dataclasses.replace(cfg, param_dtype="bfloat16", compute_dtype="bfloat16")
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    t, _ = median_time(ours(r, prm=p16, c=cfg16), args.repeats)
    print(f"ours  greedy  bfloat16: {tok / t:9.0f} new tok/s")

  ours_tok = rows["ours_greedy"]
  hf_tok = rows.get("HF_greedy")  # None with --skip_hf
  print(json.dumps({"ours_tok_s": round(ours_tok, 1),
                    "hf_tok_s": None if hf_tok is None else round(hf_tok, 1),
                    "ratio": None if hf_tok is None else round(ours_tok / hf_tok, 3),
                    "cost_growth_512_vs_128": round(growth, 3)}))


if __name__ == "__main__":
  main()
