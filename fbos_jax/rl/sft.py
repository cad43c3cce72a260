"""Supervised warm start (and FCP's offline stage) through the same update step.

Demonstrations are the procedural tasks' reference solutions, each checked by
the verifier before use. With ``sft.conditional`` (FCP offline), half of the
demonstrations are corrupted responses paired with their own verifier feedback
c, and the context is ``<EF>c</EF>q``: the model learns p(o | q, c).
"""

from __future__ import annotations

import json
import os
import random
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from fbos_jax import data as data_lib
from fbos_jax import tasks as tasks_lib
from fbos_jax.model import qwen
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import update as update_lib


def _corrupt(text: str, rng: random.Random) -> str:
  """A plausible wrong response: change, drop or add one character."""
  if not text:
    return "0"
  i = rng.randrange(len(text))
  op = rng.choice(("change", "drop", "add"))
  if op == "drop" and len(text) > 1:
    return text[:i] + text[i + 1:]
  if op == "add":
    return text[:i] + rng.choice("0123456789") + text[i:]
  alt = rng.choice([c for c in "0123456789" if c != text[i]] or ["x"])
  return text[:i] + alt + text[i + 1:]


def demonstration_rows(env, examples, *, conditional: bool, rng: random.Random,
                       positive_feedback: str = "correct", num_corrections: int = 0):
  """Verifier-checked demonstrations: (plain, corrections), each a pair of lists
  (context ids, response ids); responses end with EOS.

  The first ``num_corrections`` examples become corrections: the context is
  FAP(q, o_wrong, F) for a corrupted attempt o_wrong and its real verifier
  feedback F, and the target is the verified solution (the warm start then
  knows the FAP format, as an instruction-tuned base model would). A fixed count
  keeps the batch shapes fixed. The rest are plain ``q -> o`` demonstrations
  (FCP offline with ``conditional``: ``<EF>c</EF>q -> o``).
  """
  thr = env.config.verifier.success_threshold
  plain, corr = ([], []), ([], [])
  for i, ex in enumerate(examples):
    text = tasks_lib.solve(ex)
    if not conditional and i < num_corrections:
      wrong = _corrupt(text, rng)
      v_wrong = env.verifier(ex, wrong)
      if v_wrong.reward < thr and env.verifier(ex, text).reward >= thr:
        corr[0].append(env.fap_ids(ex, wrong, v_wrong.feedback))
        corr[1].append(env.tokenizer.encode(text, add_special_tokens=False) + [env.eos_id])
        continue
    if conditional and rng.random() < 0.5:
      text = _corrupt(text, rng)
    v = env.verifier(ex, text)
    if not conditional and v.reward < thr:
      continue  # only verified demonstrations
    resp = env.tokenizer.encode(text, add_special_tokens=False) + [env.eos_id]
    if conditional:
      c = positive_feedback if v.reward >= thr else v.feedback
      plain[0].append(env.fcp_prompt(ex, c))
    else:
      plain[0].append(env.prompt_ids(ex))
    plain[1].append(resp)
  return plain, corr


def sft_batch(env, prompts, responses, prompt_len: int, response_len: int,
              num_rows: int) -> batch_lib.PolicyBatch:
  n = len(prompts)
  pt, pm = batch_lib.left_pad(prompts, prompt_len, env.pad_id)
  rt = np.full((n, response_len), env.pad_id, np.int32)
  rm = np.zeros((n, response_len), np.int32)
  for i, r in enumerate(responses):
    r = r[:response_len]
    rt[i, :len(r)] = r
    rm[i, :len(r)] = 1
  return batch_lib.make_policy_batch(pt, pm, rt, rm, np.ones(n, np.float32),
                                     np.zeros((n, response_len), np.float32), np.zeros(n, bool),
                                     num_rows=num_rows, pad_id=env.pad_id)


def train_sft(config, env, params, *, mesh, steps: Optional[int] = None, progress: bool = True):
  """Run ``sft.steps`` MLE steps from ``params``; returns (params, metrics list).

  ``params`` is donated to the first step (no second copy of a large model), so
  the caller must not use it afterwards; pass a copy to keep it."""
  from fbos_jax import sharding as sh
  model_cfg = qwen.ModelConfig.from_dict(config.model)
  steps = config.sft.steps if steps is None else steps
  optim = mlc.ConfigDict(config.optim.to_dict())
  optim.learning_rate = config.sft.learning_rate
  optim.warmup_steps = config.sft.warmup_steps
  optim.schedule = config.sft.schedule
  opt = update_lib.make_optimizer(optim, steps)
  lc = update_lib.LossConfig(objective="mle", temperature=1.0)
  step_fn = jax.jit(update_lib.make_update_step(model_cfg, opt, lc), donate_argnums=(0,))
  state = update_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                opt_state=jax.jit(opt.init)(params),
                                rng=jax.random.key_data(jax.random.key(0)))
  it = data_lib.make_prompt_iterator(config.data, batch_size=config.sft.batch_size,
                                     process_index=jax.process_index(),
                                     process_count=jax.process_count(),
                                     seed=config.seed + 7919)
  rng = random.Random(config.seed)
  r_len = config.sampling.max_new_tokens
  shards = sh.batch_shard_count(mesh)
  # Corrections (long FAP contexts) go in the update's second slot with their own
  # prompt bucket, so the short plain demonstrations are not padded to FAP length.
  n_corr = 0 if config.sft.conditional else int(round(config.sft.fap_fraction * config.sft.batch_size))
  plain_rows = batch_lib.bucket_rows(max(config.sft.batch_size - n_corr, 1), shards)
  corr_rows = batch_lib.bucket_rows(max(n_corr, 1), shards)
  p_buckets = sorted(set(config.sampling.prompt_buckets) | set(config.sampling.fap_prompt_buckets))
  f_buckets = sorted(b for b in config.sampling.fap_prompt_buckets
                     if b <= max(config.templates.max_prompt_tokens, 1)) or \
      sorted(config.sampling.fap_prompt_buckets)[:1]
  pick = lambda seqs, bs: next((b for b in bs if b >= max(map(len, seqs), default=1)), bs[-1])
  put = lambda b: jax.tree.map(lambda a: sh.put_process_local(a, mesh), b)
  empty = put(batch_lib.empty_policy_batch(8, r_len, corr_rows))
  # each term is a token mean; weigh them by their share of the demonstrations
  weights = jnp.asarray([1.0 - n_corr / config.sft.batch_size, n_corr / config.sft.batch_size])
  history = []
  rng_iter = range(steps)
  if progress and jax.process_index() == 0:
    from tqdm.auto import tqdm
    rng_iter = tqdm(rng_iter, desc="SFT warm start", dynamic_ncols=True)
  prev = None
  for s in rng_iter:
    (pp, pr), (cp, cr) = demonstration_rows(
        env, next(it), conditional=config.sft.conditional, rng=rng,
        positive_feedback=config.rl.fcp_positive_feedback, num_corrections=n_corr)
    b = put(sft_batch(env, pp, pr, pick(pp, p_buckets), r_len, plain_rows))
    # corrections always take the largest FAP bucket: one program for the whole run
    # (their lengths straddle the smaller buckets, and a compile costs more here)
    c = put(sft_batch(env, cp, cr, f_buckets[-1], r_len, corr_rows)) if cp else empty
    state, m = step_fn(state, b, c, weights)
    # wait for the previous step only, so the bar shows real progress while the
    # host still builds the next batch during this one (async dispatch)
    if prev is not None:
      jax.block_until_ready(prev[1])
      if prev[0] % 20 == 0:
        _record(history, rng_iter, weights, *prev)
    prev = (s, m)
  if prev is not None:
    _record(history, rng_iter, weights, *prev)
  return state.params, history


def _record(history, bar, weights, s, m):
  m = jax.device_get(m)
  nll = float(weights[0] * m["epa_loss"] + weights[1] * m["ecc_loss"])
  history.append({"step": s, "nll": nll, "nll_plain": float(m["epa_loss"]),
                  "nll_corrections": float(m["ecc_loss"])})
  if hasattr(bar, "set_postfix"):
    bar.set_postfix(nll=f"{nll:.3f}", refresh=False)


def _fingerprint(config) -> dict:
  """The config fields that decide the warm start's result (model, data, SFT recipe)."""
  data = {k: v for k, v in config.data.to_dict().items() if k != "read_threads"}
  return {"seed": config.seed, "model": config.model.to_dict(), "data": data,
          "sft": config.sft.to_dict(), "max_new_tokens": config.sampling.max_new_tokens,
          "templates": config.templates.to_dict()}


def _diff(a, b, prefix="") -> list:
  if isinstance(a, dict) and isinstance(b, dict):
    return [d for k in sorted(set(a) | set(b))
            for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
  return [] if a == b else [f"{prefix[:-1]}: cached {a!r}, now {b!r}"]


def warm_start(config, env, params, *, mesh, cache_dir: str):
  """Train SFT once and cache it in ``cache_dir`` (reused on later runs).

  The cache records the config fields it was trained with (``sft_config.json``);
  reusing it under different ones (e.g. another ``--config.sft.steps``) raises
  instead of silently starting RL from the wrong warm start."""
  ckptr = ocp.StandardCheckpointer()
  path = os.path.abspath(os.path.join(cache_dir, "params"))
  meta = os.path.join(cache_dir, "sft_config.json")
  want = json.loads(json.dumps(_fingerprint(config), default=list))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          params)
  if os.path.exists(path):
    if os.path.exists(meta):
      with open(meta) as f:
        diffs = _diff(json.load(f), want)
      if diffs:
        raise ValueError(
            f"The cached warm start in {cache_dir} was trained with a different config:\n  "
            + "\n  ".join(diffs) + f"\nUse a new --workdir, or delete {cache_dir} to retrain "
            "it (the RL checkpoints in the workdir are kept either way).")
    logging.info("Warm start: reusing cached SFT params at %s", path)
    return ckptr.restore(path, abstract), True
  params, hist = train_sft(config, env, params, mesh=mesh, progress=config.train.progress)
  os.makedirs(cache_dir, exist_ok=True)
  ckptr.save(path, params)
  ckptr.wait_until_finished()
  if jax.process_index() == 0:
    with open(meta, "w") as f:
      json.dump(want, f, indent=1)
  return params, False
