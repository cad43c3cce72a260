"""Supervised warm start (and FCP's offline stage) through the same update step.

Demonstrations are the examples' reference solutions (``data.solution_field``
of a file record, e.g. a worked solution ending in ``#### 42``; else the
procedural task's answer), each checked by the verifier before use. With ``sft.conditional`` (FCP offline), half of the
demonstrations are corrupted responses paired with their own verifier feedback
c, and the context is ``<EF>c</EF>q``: the model learns p(o | q, c).

Correction demonstrations (``sft.fap_fraction`` of a batch) teach the FAP
format: FAP(q, o_wrong, F) -> the verified solution. ``sft.corrections`` says
where o_wrong comes from:

* ``corrupt``: one changed, dropped or added character of the solution. Real
  failures look different: on the tiny sorting task the warm-started model's
  failures carry 1-11 located errors (a third of them 3 or more, and runaway
  repeats up to the token limit), so round 2 met feedback it had never seen.
* ``self`` (the tiny configs): the model's own failures. From step
  ``sft.self_corrections_from * sft.steps`` on (before it, the model cannot
  sort yet and its samples are noise, so one-character corruptions stand in),
  each correction example is sampled ``sft.self_samples`` times at
  ``sampling.temperature`` from the current params, and its first failed sample
  with the verifier's feedback builds the FAP (a correction example whose
  samples all pass falls back to a corruption). The corrections then follow
  the distribution of failures RL's round 2 starts from.

The cache fingerprint holds the whole ``sft`` section, so a changed recipe never
reuses an old warm start (the ``corrupt`` recipe leaves its new fields out, so
caches trained before they existed stay valid).
"""

from __future__ import annotations

import json
import os
import random
from typing import Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from fbos_jax import buckets
from fbos_jax import data as data_lib
from fbos_jax import sharding as sh
from fbos_jax import tasks as tasks_lib
from fbos_jax import templates
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import state as state_lib
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


def demonstration_rows(ctx, examples, *, conditional: bool, rng: random.Random,
                       positive_feedback: str = "correct", num_corrections: int = 0,
                       failures: Optional[list] = None, stats: Optional[dict] = None,
                       solution_field: str = ""):
  """Verifier-checked demonstrations: (plain, corrections), each a pair of lists
  (context ids, response ids); responses end with EOS.

  The first ``num_corrections`` examples become corrections: the context is
  FAP(q, o_wrong, F) for a wrong attempt o_wrong and its real verifier
  feedback F, and the target is the verified solution (the warm start then
  knows the FAP format, as an instruction-tuned base model would). o_wrong is
  ``failures[i]`` (the model's own failed sample, :func:`own_failures`) when
  given and not None, else a one-character corruption of the solution. A fixed
  count keeps the batch shapes fixed. The rest are plain ``q -> o``
  demonstrations (FCP offline with ``conditional``: ``<EF>c</EF>q -> o``).

  Every check runs through the context's verifier pool (timeouts, fault
  isolation, reward range) in one batch; an error verdict drops its demonstration.
  ``stats`` (a dict, if given) receives ``own`` (corrections from ``failures``)
  and ``truncated`` (correction FAPs cut to fit ``templates.max_prompt_tokens``).
  """
  thr = ctx.threshold
  field = solution_field
  eos = int(ctx.tokenizer.eos_token_id)
  solutions = [str(ex[field]) if field and ex.get(field) else tasks_lib.solve(ex)
               for ex in examples]
  wrong, texts = {}, []
  for i, text in enumerate(solutions):  # the same draws, in the same order, as one by one
    if not conditional and i < num_corrections:
      own = failures[i] if failures is not None and i < len(failures) else None
      wrong[i] = own if own is not None else _corrupt(text, rng)
    if conditional and rng.random() < 0.5:
      text = _corrupt(text, rng)
    texts.append(text)
  order = [(i, wrong[i]) for i in sorted(wrong)] + list(enumerate(texts))
  rewards, feedback, errors, _ = ctx.verify([examples[i] for i, _ in order], [t for _, t in order])
  verdict = {}  # (i, text) -> (reward, feedback) of a real verdict
  for (i, t), r, f, e in zip(order, rewards, feedback, errors):
    if not e:
      verdict[(i, t)] = (float(r), f)
  plain, corr = ([], []), ([], [])
  n_own = n_cut = 0
  for i, ex in enumerate(examples):
    w, ok = verdict.get((i, wrong.get(i))), verdict.get((i, solutions[i]))
    if i in wrong and w and ok and w[0] < thr and ok[0] >= thr:
      fap = ctx.prompts.fap(ex["prompt"], wrong[i], w[1])
      corr[0].append(fap.token_ids)
      corr[1].append(templates.encode_plain(ctx.tokenizer, solutions[i]) + [eos])
      n_own += int(failures is not None and i < len(failures) and failures[i] is not None)
      n_cut += int(fap.truncated)
      continue
    v = verdict.get((i, texts[i]))
    if v is None or (not conditional and v[0] < thr):
      continue  # only verified demonstrations
    plain[1].append(templates.encode_plain(ctx.tokenizer, texts[i]) + [eos])
    if conditional:
      plain[0].append(ctx.prompts.fcp(ex["prompt"],
                                      positive_feedback if v[0] >= thr else v[1]).token_ids)
    else:
      plain[0].append(ctx.prompts.plain(ex["prompt"]).token_ids)
  if stats is not None:
    stats.update(own=n_own, truncated=n_cut)
  return plain, corr


def own_failures(config, ctx, params, examples, *, key) -> list:
  """One failed sample of the model per example, or None where its
  ``sft.self_samples`` samples (at ``sampling.temperature``: the round-1
  sampler) all pass or none got a real verdict: the o_wrong of
  ``sft.corrections=self``."""
  if not examples:
    return []
  k = max(int(config.sft.self_samples), 1)
  texts = ctx.sample(params, [ctx.prompts.plain(ex["prompt"]).token_ids for ex in examples], k,
                     key, ctx.parts.sampling.round1).texts
  rewards, _, errors, _ = ctx.verify([ex for ex in examples for _ in range(k)], texts)
  thr = ctx.threshold
  found = []
  for i in range(len(examples)):
    rows = [j for j in range(i * k, (i + 1) * k) if not errors[j] and rewards[j] < thr]
    found.append(texts[rows[0]] if rows else None)
  return found


def sft_batch(pad_id: int, prompts, responses, prompt_len: int, response_len: int,
              num_rows: int) -> batch_lib.PolicyBatch:
  """Demonstrations as an MLE batch: prompts left-padded, responses (EOS included)
  right-padded to ``response_len``; advantages 1, nothing off-policy."""
  n = len(prompts)
  rt = np.full((n, response_len), pad_id, np.int32)
  rm = np.zeros((n, response_len), np.int32)
  for i, r in enumerate(responses):
    r = r[:response_len]
    rt[i, :len(r)] = r
    rm[i, :len(r)] = 1
  return batch_lib.make_policy_batch(
      prompts, rt, rm, np.ones(n, np.float32), np.zeros((n, response_len), np.float32),
      np.zeros(n, bool), prompt_len=prompt_len, num_rows=num_rows, pad_id=pad_id,
      field="sampling.fap_prompt_buckets / templates.max_prompt_tokens")


def _sft_setup(config, ctx, steps: int):
  """The update (one MLE term per demonstration kind, weighted by its share of the
  batch), the optimizer config and the row buckets of the SFT warm start."""
  sft = config.sft
  n_corr = 0 if sft.conditional else int(round(sft.fap_fraction * sft.batch_size))
  share = n_corr / sft.batch_size
  terms = (config_lib.Term("demos", "mle", 1.0 - share),)
  if n_corr:  # corrections (long FAP contexts) get their own batch and prompt bucket
    terms += (config_lib.Term("corrections", "mle", share),)
  ucfg = config_lib.UpdateConfig(terms=terms, loss=config_lib.LossConfig(
      temperature=1.0, vocab_limit=ctx.parts.update.loss.vocab_limit))
  optim_cfg = config_lib.optim_config(config.optim, steps, learning_rate=sft.learning_rate,
                                      warmup_steps=sft.warmup_steps, schedule=sft.schedule)
  shards = sh.batch_shard_count(ctx.mesh, ctx.rules)
  rows = (buckets.bucket_rows(max(sft.batch_size - n_corr, 1), shards),
          buckets.bucket_rows(max(n_corr, 1), shards))
  return optim_cfg, ucfg, n_corr, rows


def train_sft(config, ctx, params, rng, *, steps: Optional[int] = None, progress: bool = True):
  """Run ``sft.steps`` MLE steps from ``params`` on ``ctx``'s mesh; returns
  (params, metrics list). ``rng``: the run's ``TrainState.rng``; the warm start
  draws from its ``sft`` stream (data order, corruptions, own samples)."""
  steps = config.sft.steps if steps is None else steps
  optim_cfg, ucfg, n_corr, rows = _sft_setup(config, ctx, steps)
  mesh = ctx.mesh
  step_fn = update_lib.compiled_update(ctx.parts, mesh, ctx.rules, ucfg=ucfg, optim_cfg=optim_cfg)
  sft_key = state_lib.stream_key(rng, "sft")
  state = state_lib.init_state(ctx.parts, mesh, ctx.rules, params, optim_cfg=optim_cfg,
                               rng=jax.random.key_data(sft_key))
  it = data_lib.make_prompt_iterator(config.data, batch_size=config.sft.batch_size,
                                     process_index=jax.process_index(),
                                     process_count=jax.process_count(),
                                     seed=state_lib.host_seed(rng, "sft", 0),
                                     tokenizer=ctx.tokenizer, templates_config=config.templates)
  builder = _BatchBuilder(config, ctx, n_corr, rows,
                          random.Random(state_lib.host_seed(rng, "sft", 1)))
  sample_key = state_lib.stream_key(rng, "sft", 2)
  put = lambda b: jax.tree.map(lambda a: sh.put_process_local(a, mesh, ctx.rules), b)
  history = []
  bar = range(steps)
  if progress and jax.process_index() == 0:
    from tqdm.auto import tqdm
    bar = tqdm(bar, desc="SFT warm start", dynamic_ncols=True)
  prev = None
  self_from = _self_corrections_start(config, steps) if n_corr else steps
  if self_from < steps:
    builder.start_at_common_fap_bucket()
  for s in bar:
    examples = next(it)
    failures = None
    if s >= self_from:
      failures = own_failures(config, ctx, state.params, examples[:n_corr],
                              key=jax.random.fold_in(sample_key, s))
    batches, stats = builder(s, examples, failures)
    with jax.set_mesh(mesh):  # attention picks its kernel from the mesh's devices
      state, m = step_fn(state, put(batches))
    # wait for the previous step only, so the bar shows real progress while the
    # host still builds the next batch during this one (async dispatch)
    if prev is not None:
      jax.block_until_ready(prev[1])
      if prev[0] % 20 == 0:
        _record(history, bar, ucfg, *prev)
    prev = (s, m, stats)
  if prev is not None:
    _record(history, bar, ucfg, *prev)
  return state.params, history


class _BatchBuilder:
  """One SFT step's host batches: verified demonstrations at the smallest prompt
  bucket that holds them, corrections (FAP contexts) at a FAP bucket that grows,
  never shrinks (a program per bucket at most, and the rare long FAP, which the
  budget holds whole, does not pad every step)."""

  def __init__(self, config, ctx, n_corr: int, rows: tuple, rng: random.Random):
    self.config, self.ctx, self.n_corr, self.rng = config, ctx, n_corr, rng
    self.plain_rows, self.corr_rows = rows
    sp = ctx.parts.sampling
    fap_buckets = sp.round2.prompt_buckets
    self.r_len = sp.round1.max_new_tokens
    self.p_buckets = sorted(set(sp.round1.prompt_buckets) | set(fap_buckets))
    self.f_buckets = sorted(b for b in fap_buckets
                            if b <= max(config.templates.max_prompt_tokens, 1)) or \
        sorted(fap_buckets)[:1]
    self.corr_len = 0

  def start_at_common_fap_bucket(self):
    """Own failures (``sft.corrections=self``) start at the bucket of the longest
    FAP of one-character tokens: one program for the run, unless a rarer longer
    FAP comes."""
    from fbos_jax.rl import fap_budget
    common = fap_budget.longest_fap_tokens(self.config, self.ctx.parts, self.ctx.tokenizer,
                                           chars_per_token=1)
    if common is not None and common["fap"] <= self.f_buckets[-1]:
      self.corr_len = buckets.pick_bucket(common["fap"], self.f_buckets)

  def __call__(self, step: int, examples: list, failures) -> tuple:
    """({"demos": PolicyBatch[, "corrections": PolicyBatch]}, stats) on the host."""
    stats = {}
    (pp, pr), (cp, cr) = demonstration_rows(
        self.ctx, examples, conditional=self.config.sft.conditional, rng=self.rng,
        positive_feedback=self.ctx.spec.fcp_positive_feedback, num_corrections=self.n_corr,
        failures=failures, stats=stats, solution_field=self.config.data.solution_field)
    if not pp:
      raise ValueError(
          f"SFT step {step}: none of the {len(examples)} demonstrations passed the verifier "
          f"({data_lib.locate(examples[0])} and the rest); check data.verifier and the "
          "verifier's error log")
    plen = buckets.pick_bucket(max(map(len, pp)), self.p_buckets, what="demonstration prompt",
                               field="sampling.prompt_buckets")
    batches = {"demos": sft_batch(self.ctx.pad_id, pp, pr, plen, self.r_len, self.plain_rows)}
    if self.n_corr:
      self.corr_len = max(self.corr_len, buckets.pick_bucket(
          max(map(len, cp), default=1), self.f_buckets, what="correction prompt",
          field="sampling.fap_prompt_buckets / templates.max_prompt_tokens"))
      batches["corrections"] = sft_batch(self.ctx.pad_id, cp, cr, self.corr_len, self.r_len,
                                         self.corr_rows)
    return batches, dict(stats, corrections=len(cp), prompt_len=self.corr_len)


def _self_corrections_start(config, steps: int) -> int:
  """The first SFT step whose corrections are the model's own failures
  (``sft.corrections=self``), or ``steps`` (never) for ``corrupt``."""
  sft = config.sft
  how = sft.get("corrections", "corrupt")
  if how == "corrupt" or sft.conditional:
    return steps
  if how != "self":
    raise ValueError(f"sft.corrections={how!r}: expected corrupt | self")
  return int(round(float(sft.get("self_corrections_from", 0.5)) * steps))


def _record(history, bar, ucfg, s, m, stats):
  m = jax.device_get(m)
  loss = {name: float(t.stats.loss) for name, t in m.terms.items()}
  nll = sum(t.weight * loss[t.batch] for t in ucfg.terms)
  history.append({"step": s, "nll": nll, "nll_plain": loss["demos"],
                  "nll_corrections": loss.get("corrections", np.nan),
                  "corrections": stats.get("corrections", 0),
                  "corrections_own": stats.get("own", 0),
                  "corrections_truncated": stats.get("truncated", 0),
                  "corrections_prompt_len": stats.get("prompt_len", 0)})
  if hasattr(bar, "set_postfix"):
    bar.set_postfix(nll=f"{nll:.3f}", refresh=False)


# sft fields that the ``corrupt`` recipe ignores: left out of its fingerprint, so a
# cache trained before they existed (the same recipe) is still recognised
_SELF_ONLY_FIELDS = ("corrections", "self_corrections_from", "self_samples")


def _fingerprint(config, parts) -> dict:
  """The config fields that decide the warm start's result (model, data, SFT recipe)."""
  data = {k: v for k, v in config.data.to_dict().items() if k != "read_threads"}
  sft = config.sft.to_dict()
  if sft.get("corrections", "corrupt") == "corrupt":
    sft = {k: v for k, v in sft.items() if k not in _SELF_ONLY_FIELDS}
  out = {"seed": config.seed, "model": config.model.to_dict(), "data": data,
         "sft": sft, "max_new_tokens": parts.sampling.round1.max_new_tokens,
         "templates": config.templates.to_dict()}
  if sft.get("corrections") == "self":  # the own samples depend on these too
    out["sampling"] = {k: getattr(parts.sampling.round1, k)
                       for k in ("temperature", "top_k", "top_p")}
  return out


def _diff(a, b, prefix="") -> list:
  if isinstance(a, dict) and isinstance(b, dict):
    return [d for k in sorted(set(a) | set(b))
            for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
  return [] if a == b else [f"{prefix[:-1]}: cached {a!r}, now {b!r}"]


def warm_start(config, ctx, state, *, cache_dir: str):
  """Train SFT from ``state``'s params (its ``sft`` PRNG stream) once and cache it
  in ``cache_dir`` (reused on later runs). Returns (params, cached).

  The cache records the config fields it was trained with (``sft_config.json``);
  reusing it under different ones (e.g. another ``--config.sft.steps``) raises
  instead of silently starting RL from the wrong warm start."""
  ckptr = ocp.StandardCheckpointer()
  path = os.path.abspath(os.path.join(cache_dir, "params"))
  meta = os.path.join(cache_dir, "sft_config.json")
  want = json.loads(json.dumps(_fingerprint(config, ctx.parts), default=list))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          state.params)
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
  params, hist = train_sft(config, ctx, state.params, state.rng, progress=config.train.progress)
  os.makedirs(cache_dir, exist_ok=True)
  ckptr.save(path, params)
  ckptr.wait_until_finished()
  if jax.process_index() == 0:
    with open(meta, "w") as f:
      json.dump(want, f, indent=1)
  return params, False
