"""Supervised warm start (and FCP's offline stage) through the same update step.

Demonstrations are the procedural tasks' reference solutions, each checked by
the verifier before use. With ``sft.conditional`` (FCP offline), half of the
demonstrations are corrupted responses paired with their own verifier feedback
c, and the context is ``<EF>c</EF>q``: the model learns p(o | q, c).
"""

from __future__ import annotations

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
                       positive_feedback: str = "correct", fap_fraction: float = 0.0):
  """Verifier-checked (context ids, response ids) pairs. Response ends with EOS.

  With ``fap_fraction`` > 0, that share of the demonstrations are corrections:
  the context is FAP(q, o_wrong, F) for a corrupted attempt o_wrong and its real
  verifier feedback F, and the target is the verified solution (the warm start
  then knows the FAP format, as an instruction-tuned base model would).
  """
  prompts, responses = [], []
  for ex in examples:
    text = tasks_lib.solve(ex)
    if not conditional and fap_fraction > 0 and rng.random() < fap_fraction:
      wrong = _corrupt(text, rng)
      v_wrong = env.verifier(ex, wrong)
      if v_wrong.reward < env.config.verifier.success_threshold and env.verifier(ex, text).reward \
          >= env.config.verifier.success_threshold:
        prompts.append(env.fap_ids(ex, wrong, v_wrong.feedback))
        responses.append(env.tokenizer.encode(text, add_special_tokens=False) + [env.eos_id])
        continue
    if conditional and rng.random() < 0.5:
      text = _corrupt(text, rng)
    v = env.verifier(ex, text)
    if not conditional and v.reward < env.config.verifier.success_threshold:
      continue  # only verified demonstrations
    resp = env.tokenizer.encode(text, add_special_tokens=False) + [env.eos_id]
    if conditional:
      c = positive_feedback if v.reward >= env.config.verifier.success_threshold else v.feedback
      prompts.append(env.fcp_prompt(ex, c))
    else:
      prompts.append(env.prompt_ids(ex))
    responses.append(resp)
  return prompts, responses


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
  """Run ``sft.steps`` MLE steps from ``params``; returns (params, metrics list)."""
  from fbos_jax import sharding as sh
  model_cfg = qwen.ModelConfig.from_dict(config.model)
  steps = config.sft.steps if steps is None else steps
  optim = mlc.ConfigDict(config.optim.to_dict())
  optim.learning_rate = config.sft.learning_rate
  optim.warmup_steps = config.sft.warmup_steps
  optim.schedule = "cosine"
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
  buckets = sorted(set(config.sampling.prompt_buckets) | set(config.sampling.fap_prompt_buckets))
  rows = batch_lib.bucket_rows(config.sft.batch_size, sh.batch_shard_count(mesh))
  ecc = batch_lib.empty_policy_batch(8, r_len, batch_lib.bucket_rows(1, sh.batch_shard_count(mesh)))
  put = lambda b: jax.tree.map(lambda a: sh.put_process_local(a, mesh), b)
  ecc = put(ecc)
  weights = jnp.asarray([1.0, 0.0])
  history = []
  rng_iter = range(steps)
  if progress and jax.process_index() == 0:
    from tqdm.auto import tqdm
    rng_iter = tqdm(rng_iter, desc="SFT warm start", dynamic_ncols=True)
  for s in rng_iter:
    prompts, responses = demonstration_rows(env, next(it), conditional=config.sft.conditional,
                                            rng=rng,
                                            positive_feedback=config.rl.fcp_positive_feedback,
                                            fap_fraction=config.sft.fap_fraction)
    p_len = next((b for b in buckets if b >= max(len(p) for p in prompts)), buckets[-1])
    b = put(sft_batch(env, prompts, responses, p_len, r_len, rows))
    state, m = step_fn(state, b, ecc, weights)
    if s % 20 == 0 or s == steps - 1:
      m = jax.device_get(m)
      history.append({"step": s, "nll": float(m["epa_loss"])})
      if hasattr(rng_iter, "set_postfix"):
        rng_iter.set_postfix(nll=f"{float(m['epa_loss']):.3f}", refresh=False)
  return state.params, history


def warm_start(config, env, params, *, mesh, cache_dir: str):
  """Train SFT once and cache it in ``cache_dir`` (reused on later runs)."""
  ckptr = ocp.StandardCheckpointer()
  path = os.path.abspath(os.path.join(cache_dir, "params"))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          params)
  if os.path.exists(path):
    logging.info("Warm start: reusing cached SFT params at %s", path)
    return ckptr.restore(path, abstract), True
  params, hist = train_sft(config, env, params, mesh=mesh, progress=config.train.progress)
  os.makedirs(cache_dir, exist_ok=True)
  ckptr.save(path, params)
  ckptr.wait_until_finished()
  return params, False
