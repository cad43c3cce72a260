"""Supervised warm start (and FCP's offline stage) through the same update step.

Demonstrations are the examples' reference solutions (``data.solution_field``
of a file record, e.g. a worked solution ending in ``#### 42``; else the
procedural task's answer), each checked by the verifier before use. With ``sft.conditional`` (FCP offline), half of the
demonstrations are corrupted responses paired with their own verifier feedback
c, and the context is ``<EF>c</EF>q``: the model learns p(o | q, c).

Correction demonstrations (``sft.fap_fraction`` of a batch) teach the FAP
format: FAP(q, o_wrong, F) -> the verified solution. ``sft.corrections`` says
where o_wrong comes from:

* ``corrupt``: one changed, dropped or added character of the solution (a task
  family may generate its own model-like failures instead, ``tasks.corrupt``:
  ``chain`` puts a small error in one step and carries it on). Real
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

**Stages** (``sft.stages``, issue 24): a recipe of stages run in order, each a
dict of ``sft.*`` fields over the flat ones (its own ``steps``,
``learning_rate``, ``fap_fraction``, ``corrections``, ...; an optional
``name``), each starting from the previous stage's params with a fresh
optimizer. E.g. demonstrations first, then a corrections-heavy stage whose
wrong attempts are the model's own failures, so the model learns to read the
feedback. Stage ``i > 0`` draws its problems with ``data.generation_seed`` (and
the order seed) moved by ``1009 * i``, so it sees problems the stages before it
did not. Every stage is cached on its own (``stages/<i>/`` under the cache
directory; the last stage is the cache itself), so a stopped warm start resumes
at the first stage that is not done, and gives the same params as a run that
was never stopped. ``sft.stages=()`` is one stage made of the flat fields.

**The cache** is valid only with its fingerprint (``sft_config.json``: the config
fields that decide the result, :func:`_fingerprint`). The fingerprint is written
(atomically) before the params, and orbax writes the params to a temporary
directory renamed when complete, so params without a fingerprint are never left
by a stopped save: a cache whose fingerprint is missing is not trusted, its
params are moved aside (``params.unverified-<time>``, nothing is deleted) and
the stage is retrained, with a warning that says so; a fingerprint that differs
from the config's refuses to start, naming each differing field. The ``corrupt``
recipe without stages leaves the newer fields out of its fingerprint, so caches
trained before they existed stay valid.

A config with ``data.require_hidden_answer=True`` has already run
:func:`fbos_jax.verifiers.procedural.check_config_answer_hidden` when its
context was built (``RolloutContext.build``): a task whose feedback contains the
final answer is refused before anything trains, with an example record.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Optional

import jax
import ml_collections as mlc
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from fbos_jax import buckets
from fbos_jax import checkpoint as ckpt_lib
from fbos_jax import data as data_lib
from fbos_jax import distributed
from fbos_jax import metrics as metrics_lib
from fbos_jax import sharding as sh
from fbos_jax import tasks as tasks_lib
from fbos_jax import templates
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import context as context_lib
from fbos_jax.rl import packing
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
      if own is None and not field:  # a task's own model-like failure (chain), if it has one
        own = tasks_lib.corrupt(examples[i], rng)
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
      try:
        fap = ctx.prompts.fap(ex["prompt"], wrong[i], w[1])
      except templates.PromptTooLongError as e:  # templates.truncation=error, or no room
        raise buckets.BucketError(
            f"SFT: the correction prompt of {data_lib.locate(ex)}: {e} "
            f"(templates.max_prompt_tokens); {context_lib.OVER_LONG_HINT}") from None
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
      temperature=1.0, vocab_limit=ctx.parts.update.loss.vocab_limit),
      micro_batch_tokens=ctx.parts.update.micro_batch_tokens)  # packed as RL's, if it is
  optim_cfg = config_lib.optim_config(config.optim, steps, learning_rate=sft.learning_rate,
                                      warmup_steps=sft.warmup_steps, schedule=sft.schedule,
                                      warmup_from_zero=True)
  shards = sh.batch_shard_count(ctx.mesh, ctx.rules)
  rows = (buckets.bucket_rows(max(sft.batch_size - n_corr, 1), shards),
          buckets.bucket_rows(max(n_corr, 1), shards))
  return optim_cfg, ucfg, n_corr, rows


def train_sft(config, ctx, params, rng, *, steps: Optional[int] = None, progress: bool = True,
              stage: int = 0, desc: str = "SFT warm start"):
  """Run ``sft.steps`` MLE steps from ``params`` on ``ctx``'s mesh; returns
  (params, metrics list). ``rng``: the run's ``TrainState.rng``; the warm start
  draws from its ``sft`` stream (data order, corruptions, own samples), each
  stage from its own sub-stream. ``config`` holds one stage's fields
  (:func:`stage_configs`); a later ``stage`` also draws new problems
  (``data.generation_seed`` moved by ``STAGE_SEED_STRIDE * stage``)."""
  steps = config.sft.steps if steps is None else steps
  optim_cfg, ucfg, n_corr, rows = _sft_setup(config, ctx, steps)
  mesh = ctx.mesh
  step_fn = update_lib.compiled_update(ctx.parts, mesh, ctx.rules, ucfg=ucfg, optim_cfg=optim_cfg)
  state = state_lib.init_state(ctx.parts, mesh, ctx.rules, params, optim_cfg=optim_cfg,
                               rng=jax.random.key_data(state_lib.stream_key(rng, "sft", stage)))
  data_cfg = config.data
  if stage:  # new problems for a later stage (procedural content, file order)
    data_cfg = mlc.ConfigDict(config.data.to_dict())
    data_cfg.generation_seed = int(data_cfg.generation_seed) + STAGE_SEED_STRIDE * stage
  it = data_lib.make_prompt_iterator(data_cfg, batch_size=config.sft.batch_size,
                                     process_index=distributed.process_index(),
                                     process_count=distributed.process_count(),
                                     seed=state_lib.host_seed(rng, "sft", stage, 0),
                                     tokenizer=ctx.tokenizer, templates_config=config.templates)
  builder = _BatchBuilder(config, ctx, n_corr, rows,
                          random.Random(state_lib.host_seed(rng, "sft", stage, 1)))
  sample_key = state_lib.stream_key(rng, "sft", stage, 2)
  history = []
  bar = metrics_lib.progress(range(steps), progress and jax.process_index() == 0, desc)
  prev = None
  self_from = _self_corrections_start(config, steps) if n_corr else steps
  if self_from < steps:
    builder.start_at_common_fap_bucket()
  for s in bar:
    examples = next(it)
    check_prompt_lengths(ctx, examples, builder.p_buckets[-1], conditional=config.sft.conditional,
                         positive_feedback=ctx.spec.fcp_positive_feedback)
    failures = None
    if s >= self_from:
      failures = own_failures(config, ctx, state_lib.compute_params(state.params, ctx.model_cfg),
                              examples[:n_corr],
                              key=jax.random.fold_in(sample_key, s))
    batches, stats = builder(s, examples, failures)
    batches, packed_m = packing.device_batches(batches, ucfg, mesh, ctx.rules)
    stats = dict(stats, **packed_m)
    with jax.set_mesh(mesh):  # attention picks its kernel from the mesh's devices
      state, m = step_fn(state, batches)
    # wait for the previous step only, so the bar shows real progress while the
    # host still builds the next batch during this one (async dispatch)
    if prev is not None:
      jax.block_until_ready(prev[1])
      if prev[0] % 20 == 0:
        _record(history, bar, ucfg, *prev)
    prev = (s, m, stats)
  if prev is not None:
    _record(history, bar, ucfg, *prev)
  for h in history:
    h["stage"] = stage
  return state.params, history


def check_prompt_lengths(ctx, examples, longest: int, *, conditional: bool = False,
                         positive_feedback: str = "correct"):
  """Raise a BucketError naming the record (``file:line`` and id, as the RL
  rollout's ``prompt_ids`` does) when an example's prompt does not fit the
  template budget or the largest prompt bucket ``longest``."""
  for ex in examples:
    ctx.checked_prompt_ids(ex, longest, conditional=conditional,
                           positive_feedback=positive_feedback, who="SFT: ",
                           buckets_field="sampling.prompt_buckets / sampling.fap_prompt_buckets")


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
                  "corrections_prompt_len": stats.get("prompt_len", 0),
                  "real_token_frac": stats["update/real_token_frac"]})
  if hasattr(bar, "set_postfix"):
    bar.set_postfix(nll=f"{nll:.3f}", refresh=False)


# sft fields that the ``corrupt`` recipe ignores: left out of its fingerprint, so a
# cache trained before they existed (the same recipe) is still recognised
_SELF_ONLY_FIELDS = ("corrections", "self_corrections_from", "self_samples")
# fields that do not change the warm start's result
_DATA_IGNORED = ("read_threads", "require_hidden_answer")
STAGE_SEED_STRIDE = 1009  # stage i draws its problems with seeds moved by i x this


def stage_configs(config) -> list:
  """The warm start's stages as [(name, config)]: each config is ``config`` with
  the stage's ``sft.*`` fields set (and ``sft.stages`` emptied). No stages: one,
  named "sft", the config itself. A bad recipe raises, naming every field
  (``sft.stages[i].field``; :func:`fbos_jax.rl.config.sft_errors`, which
  ``validate`` runs before anything is built)."""
  errs = config_lib.sft_errors(config)
  if errs:
    raise ValueError("Invalid warm start recipe:\n  - " + "\n  - ".join(errs))
  stages = tuple(config.sft.get("stages", ()) or ())
  if not stages:
    return [("sft", config)]
  out = []
  for i, st in enumerate(stages):
    st = dict(st)
    name = config_lib.stage_name(i, st)
    st.pop("name", None)
    c = config.copy_and_resolve_references()
    with c.unlocked():
      for k, v in st.items():
        c.sft[k] = v
      c.sft.stages = ()
    out.append((name, c))
  return out


def set_total_steps(config, total: int):
  """Set the warm start to ``total`` steps: ``sft.steps``, and with stages each
  stage's steps in the recipe's proportions (largest remainders, at least 1
  each), so that they sum to ``total`` (``launch/compare.py --quick``)."""
  stages = [dict(st) for st in (config.sft.get("stages", ()) or ())]
  total = max(int(total), len(stages))
  with config.unlocked():
    config.sft.steps = total
    if stages:
      own = [int(st.get("steps", 1)) for st in stages]
      exact = [total * n / sum(own) for n in own]
      steps = [max(int(x), 1) for x in exact]
      for i in sorted(range(len(own)), key=lambda i: steps[i] - exact[i])[:total - sum(steps)]:
        steps[i] += 1
      config.sft.stages = tuple(dict(st, steps=n) for st, n in zip(stages, steps))
  return config


def describe_steps(config) -> str:
  """The warm start's steps as the console reports them: ``"800 steps (demos 700 +
  own_failures 100)"``, or ``"30 steps"`` without stages."""
  stages = stage_configs(config)
  total = sum(int(c.sft.steps) for _, c in stages)
  if len(stages) == 1:
    return f"{total} steps"
  return f"{total} steps ({' + '.join(f'{n} {c.sft.steps}' for n, c in stages)})"


def _fingerprint(config, parts, stages: Optional[int] = None) -> dict:
  """The config fields that decide the warm start's result (model, data, SFT
  recipe); ``stages``: of the first that many stages only (a stage's cache)."""
  data = {k: v for k, v in config.data.to_dict().items() if k not in _DATA_IGNORED}
  sft = config.sft.to_dict()
  recipe = list(sft.pop("stages", ()) or ())
  if recipe:
    sft["stages"] = [dict(st) for st in recipe[:stages if stages is not None else len(recipe)]]
  if not recipe and sft.get("corrections", "corrupt") == "corrupt":
    sft = {k: v for k, v in sft.items() if k not in _SELF_ONLY_FIELDS}
  out = {"seed": config.seed, "model": config.model.to_dict(), "data": data,
         "sft": sft, "max_new_tokens": parts.sampling.round1.max_new_tokens,
         "templates": config.templates.to_dict()}
  uses_self = [sft.get("corrections")] + [st.get("corrections") for st in sft.get("stages", [])]
  if "self" in uses_self:  # the own samples depend on these too
    out["sampling"] = {k: getattr(parts.sampling.round1, k)
                       for k in ("temperature", "top_k", "top_p")}
  return json.loads(json.dumps(out, default=list))


def _diff(a, b, prefix="") -> list:
  if isinstance(a, dict) and isinstance(b, dict):
    return [d for k in sorted(set(a) | set(b))
            for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
  return [] if a == b else [f"{prefix[:-1]}: cached {a!r}, now {b!r}"]


class _Cache:
  """One cached set of params with its fingerprint: ``DIR/params`` (orbax) and
  ``DIR/sft_config.json``."""

  def __init__(self, directory: str, what: str):
    self.dir, self.what = directory, what
    self.params = os.path.abspath(os.path.join(directory, "params"))
    self.meta = os.path.join(directory, "sft_config.json")

  def load(self, want: dict, abstract, ckptr):
    """The cached params if the cache is valid for ``want``, else None (nothing
    there, or params without a fingerprint: moved aside, to retrain). A
    fingerprint that differs raises, naming the fields."""
    if not os.path.exists(self.params):
      if os.path.exists(self.meta):
        logging.info("Warm start: %s in %s has a fingerprint but no params (a stopped "
                     "save); training it", self.what, self.dir)
      return None
    if not os.path.exists(self.meta):
      aside = f"{self.params}.unverified-{time.strftime('%Y%m%d-%H%M%S')}"
      msg = (f"Warm start: the cached {self.what} in {self.dir} has no fingerprint "
             f"({os.path.basename(self.meta)}), so what trained it is unknown: RETRAINING "
             f"it (the old params are kept at {aside})")
      logging.warning("%s", msg)
      print(msg, flush=True)
      if jax.process_index() == 0:
        os.replace(self.params, aside)
      return None
    with open(self.meta) as f:
      diffs = _diff(json.load(f), want)
    if diffs:
      raise ValueError(
          f"The cached {self.what} in {self.dir} was trained with a different config:\n  "
          + "\n  ".join(diffs) + f"\nUse a new --workdir, or delete {self.dir} to retrain "
          "it (the RL checkpoints in the workdir are kept either way).")
    return ckptr.restore(self.params, abstract)

  def save(self, params, want: dict, ckptr):
    """The fingerprint first (written to a temporary file, then renamed), then the
    params (orbax renames its temporary directory when the save is complete)."""
    os.makedirs(self.dir, exist_ok=True)
    if jax.process_index() == 0:
      tmp = f"{self.meta}.tmp-{os.getpid()}"
      with open(tmp, "w") as f:
        json.dump(want, f, indent=1)
      os.replace(tmp, self.meta)
    ckptr.save(self.params, ckpt_lib.savable(params))
    ckptr.wait_until_finished()


def warm_start(config, ctx, state, *, cache_dir: str):
  """Train the SFT recipe (its stages in order) from ``state``'s params (its
  ``sft`` PRNG stream) once and cache it in ``cache_dir``; returns (params, cached).

  Later runs reuse the cache when its fingerprint matches the config, refuse
  when it differs (naming the fields), and retrain, saying so, when it has no
  fingerprint. A stopped run resumes after the last stage it cached
  (``cache_dir/stages/<i>``); the last stage is cached in ``cache_dir`` itself.
  ``cached`` is True only when no stage was trained."""
  ckptr = ocp.StandardCheckpointer(multiprocessing_options=ckpt_lib.multiprocessing_options(
      distributed.side().processes, prefix="fbos_sft"))
  params = state.params
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          params)
  stages = stage_configs(config)
  k = len(stages)
  caches = [_Cache(os.path.join(cache_dir, "stages", str(i)), f"warm start stage {i + 1} of {k}")
            for i in range(k - 1)] + [_Cache(cache_dir, "warm start")]
  wants = ([_fingerprint(config, ctx.parts, i + 1) for i in range(k - 1)]
           + [_fingerprint(config, ctx.parts)])
  start = 0
  for i in reversed(range(k)):
    got = caches[i].load(wants[i], abstract, ckptr)
    if got is not None:
      if i == k - 1:
        logging.info("Warm start: reusing cached SFT params at %s", caches[i].params)
        return got, True
      params, start = got, i + 1
      msg = (f"Warm start: stage {i + 1} of {k} ({stages[i][0]}) is cached in {caches[i].dir}; "
             f"resuming at stage {i + 2} ({stages[i + 1][0]})")
      logging.info("%s", msg)
      print(msg, flush=True)
      break
  for i in range(start, k):
    name, sc = stages[i]
    if k > 1:
      logging.info("Warm start: stage %d of %d (%s): %d steps at lr %g, fap_fraction %g, "
                   "corrections %s", i + 1, k, name, sc.sft.steps, sc.sft.learning_rate,
                   sc.sft.fap_fraction, sc.sft.get("corrections", "corrupt"))
    params, _ = train_sft(sc, ctx, params, state.rng, progress=config.train.progress,
                          stage=i, desc=f"SFT {name}" if k > 1 else "SFT warm start")
    caches[i].save(params, wants[i], ckptr)
  return params, False
