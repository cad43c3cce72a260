"""The RL loop: round 1 -> verifier -> FAPs -> round 2 -> verifier -> one update.

Every algorithm (GRPO, Dr.GRPO, GFPO, GOLF, FBOS-RL, FCP, decoupled PPO) is this
loop with different ``config.rl`` fields; nothing here branches on an algorithm
name. The host does text, verification and batch assembly
(:mod:`fbos_jax.rl.assemble`); the device runs three kinds of compiled program:
sampling (one per shape bucket), log-probs (only when needed) and the update.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fbos_jax import checkpoint as ckpt_lib
from fbos_jax import distributed
from fbos_jax import metrics as metrics_lib
from fbos_jax import sharding as sh
from fbos_jax.model import qwen
from fbos_jax.rl import assemble
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import update as update_lib
from fbos_jax.rl.env import Environment


class NonFiniteStepError(FloatingPointError):
  pass


@dataclasses.dataclass
class Rollouts:
  """Host-side rollouts of one sampling round (N rows).

  prompts:   list of N token-id lists (the context each row was sampled under)
  tokens:    [N, R] int32 response ids (padded)
  mask:      [N, R] int32 1 on generated tokens (stop token included)
  logp:      [N, R] float32 sampler log-probs (temperature-scaled policy)
  lengths:   [N] int
  rewards:   [N] float32
  feedback:  list of N strings
  texts:     list of N decoded responses
  """
  prompts: list
  tokens: np.ndarray
  mask: np.ndarray
  logp: np.ndarray
  lengths: np.ndarray
  rewards: np.ndarray
  feedback: list
  texts: list


def validate_rl_config(config, num_batch_shards: int = 1):
  """Reject combinations that make no sense, naming the fields."""
  rl = config.rl
  errs = []
  if rl.objective not in ("policy_gradient", "fcp"):
    errs.append(f"rl.objective={rl.objective!r}: expected policy_gradient or fcp")
  if rl.objective == "policy_gradient" and rl.group_size < 2:
    errs.append(f"rl.group_size={rl.group_size}: group-normalised advantages need >= 2 "
                "rollouts per prompt (set --config.rl.group_size=8)")
  if rl.gfpo_k and not rl.gfpo_adaptive and not 0 < rl.gfpo_k < rl.group_size:
    errs.append(f"rl.gfpo_k={rl.gfpo_k} must be in [1, group_size-1={rl.group_size - 1}] "
                "(GFPO keeps k of G)")
  if rl.round2 and config.data.verifier in ("", "none"):
    errs.append(f"rl.round2=True (fap_mode={rl.fap_mode!r}) needs verifier feedback, but "
                f"data.verifier={config.data.verifier!r}")
  if rl.w_ecc > 0 and not rl.round2:
    errs.append(f"rl.w_ecc={rl.w_ecc} > 0 trains on FAPs, which needs rl.round2=True")
  if rl.advantage not in ("grpo", "drgrpo", "batch_std"):
    errs.append(f"rl.advantage={rl.advantage!r}: expected grpo | drgrpo | batch_std")
  if rl.offpolicy_ratio_denominator not in ("one", "behaviour"):
    errs.append(f"rl.offpolicy_ratio_denominator={rl.offpolicy_ratio_denominator!r}: "
                "expected one | behaviour")
  if rl.objective_schedule not in ("joint", "alternate"):
    errs.append(f"rl.objective_schedule={rl.objective_schedule!r}: expected joint | alternate")
  if rl.prompts_per_step % max(rl.mini_batches, 1):
    errs.append(f"rl.prompts_per_step={rl.prompts_per_step} is not divisible by "
                f"rl.mini_batches={rl.mini_batches}")
  if (rl.prompts_per_step * rl.group_size) % num_batch_shards:
    errs.append(f"rl.prompts_per_step*rl.group_size={rl.prompts_per_step * rl.group_size} "
                f"rollouts do not divide over the mesh's {num_batch_shards} batch shards "
                "(mesh.dcn*data*fsdp); change one of them")
  if rl.prompts_per_step % jax.process_count():
    errs.append(f"rl.prompts_per_step={rl.prompts_per_step} does not divide over "
                f"{jax.process_count()} processes (each host samples its own prompts)")
  if rl.round2 and config.templates.max_prompt_tokens > max(config.sampling.fap_prompt_buckets):
    errs.append(f"templates.max_prompt_tokens={config.templates.max_prompt_tokens} exceeds the "
                f"largest sampling.fap_prompt_buckets={max(config.sampling.fap_prompt_buckets)}")
  if rl.staleness < 0:
    errs.append(f"rl.staleness={rl.staleness} must be >= 0")
  if errs:
    raise ValueError("Invalid config:\n  - " + "\n  - ".join(errs))


class RLTrainer:
  """Owns the compiled programs, the environment (tokenizer, verifier, templates,
  data) and the checkpoint/metrics plumbing. ``state`` is a pure pytree."""

  def __init__(self, config, workdir: str, *, env: Optional[Environment] = None,
               mesh=None, init_params=None, log_metrics: bool = True):
    self.config = config
    self.workdir = workdir
    os.makedirs(workdir, exist_ok=True)
    self.mesh = mesh if mesh is not None else sh.make_mesh(config.mesh)
    distributed.check_mesh(self.mesh)  # multi-process: batch axes must split over hosts
    validate_rl_config(config, sh.batch_shard_count(self.mesh))
    self.env = env if env is not None else Environment.from_config(config, workdir)
    self.model_cfg = qwen.ModelConfig.from_dict(config.model)
    if self.env.vocab_size > self.model_cfg.vocab_size:
      raise ValueError(f"model.vocab_size={self.model_cfg.vocab_size} is smaller than the "
                       f"tokenizer's {self.env.vocab_size} tokens")
    self.rules = sh.rules_dict(config.mesh.rules)
    self.loss_cfg = update_lib.LossConfig.from_config(config)
    self.optimizer = update_lib.make_optimizer(config.optim, config.train.steps)
    abstract = qwen.abstract_params(self.model_cfg)
    self.param_specs = sh.tree_specs(qwen.param_logical_axes(self.model_cfg), self.rules,
                                     abstract, self.mesh)
    self.param_shardings = sh.tree_shardings(self.mesh, self.param_specs)
    self._init_params = init_params
    self.metrics = metrics_lib.MetricsWriter(workdir, enabled=log_metrics and jax.process_index() == 0)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      save_every=config.train.checkpoint_every,
                                      keep=config.train.keep_checkpoints)
    self._replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self.state_shardings = None  # set by init_state
    self._update = None
    self._logprob_fn = None
    self.ref_params = None
    self.param_history: list = []  # for rl.staleness > 0 (simulated stale rollouts)
    self.gfpo_state = None
    self.nonfinite_steps = 0

  # ------------------------------------------------------------------ state
  def init_state(self, params=None) -> update_lib.TrainState:
    cfg = self.config
    if params is None:
      params = self._init_params
    if params is None:
      params = jax.jit(lambda k: qwen.init_params(self.model_cfg, k),
                       out_shardings=self.param_shardings)(jax.random.key(cfg.seed))
    else:  # a copy: the update step donates the state, the caller keeps its params
      params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings)(params)
    opt_state = jax.jit(lambda p: update_lib.init_opt_state(self.optimizer, p, cfg.optim))(params)
    # the optimizer's scalars (step counts) onto the mesh too, as the update returns them
    named = jax.sharding.NamedSharding
    opt_state = jax.jit(lambda o: o, out_shardings=jax.tree.map(
        lambda a: a.sharding if isinstance(a.sharding, named) else self._replicated, opt_state))(opt_state)
    # step and PRNG replicated on the mesh: with the update's out_shardings equal to
    # these, step 2 sees the same input shardings as step 1 and compiles nothing
    step, rng = jax.jit(lambda: (jnp.zeros((), jnp.int32),
                                 jax.random.key_data(jax.random.key(cfg.seed + 1))),
                        out_shardings=self._replicated)()
    state = update_lib.TrainState(step=step, params=params, opt_state=opt_state, rng=rng)
    self.state_shardings = jax.tree.map(lambda a: a.sharding, state)
    if cfg.rl.kl_beta > 0:
      self.ref_params = jax.tree.map(jnp.copy, params)
    if cfg.rl.gfpo_adaptive:
      import fbos_kernels as K
      self.gfpo_state = K.adaptive_k_init(cfg.rl.gfpo_history)
    return state

  def _full_state(self, state):
    return {"train": state, "gfpo": self.gfpo_state}

  def save(self, state, force=False):
    meta = {"model": {k: v for k, v in self.config.model.to_dict().items()},
            "algo": self.config.algo, "nonfinite_steps": self.nonfinite_steps}
    self.ckpt.save(int(state.step), self._full_state(state),
                   distributed.per_process_state(self.env.data_state()), meta,
                   force=force)

  def restore_train_state(self, step=None) -> update_lib.TrainState:
    """The TrainState of checkpoint ``step`` (latest if None), resharded onto this
    trainer's mesh; for eval / export (data and GFPO state are not touched)."""
    if self.ckpt.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {self.ckpt.directory}")
    abstract = ckpt_lib.abstract_with_shardings(self._full_state(self.init_state()), self.mesh)
    full, _, _ = self.ckpt.restore(step, abstract, {"model": self.config.model.to_dict()})
    return full["train"]

  def maybe_restore(self, state):
    step = self.ckpt.latest_step()
    if step is None:
      return state, False
    abstract = ckpt_lib.abstract_with_shardings(self._full_state(state), self.mesh)
    expected = {"model": self.config.model.to_dict()}
    full, data_state, meta = self.ckpt.restore(step, abstract, expected)
    self.gfpo_state = full["gfpo"]
    self.env.set_data_state(distributed.select_process_state(data_state))
    self.nonfinite_steps = int(meta.get("nonfinite_steps", 0))
    logging.info("Resumed from %s at step %d", self.ckpt.directory, step)
    return full["train"], True

  # ------------------------------------------------------------------ compiled programs
  def _batch_sharding(self, rank):
    return jax.sharding.NamedSharding(self.mesh, sh.batch_spec(rank))

  def put_batch(self, b: batch_lib.PolicyBatch) -> batch_lib.PolicyBatch:
    return jax.tree.map(lambda a: sh.put_process_local(a, self.mesh), b)

  def update_fn(self):
    if self._update is None:
      fn = update_lib.make_update_step(self.model_cfg, self.optimizer, self.loss_cfg,
                                       skip_nonfinite=self.config.rl.skip_nonfinite)
      self._update = jax.jit(fn, donate_argnums=(0,),
                             out_shardings=(self.state_shardings, self._replicated))
    return self._update

  def logprob_fn(self):
    if self._logprob_fn is None:
      self._logprob_fn = jax.jit(update_lib.make_logprob_fn(self.model_cfg, self.loss_cfg))
    return self._logprob_fn

  # ------------------------------------------------------------------ rollouts
  def sample(self, params, prompts: list, n: int, key, *, temperature=None,
             buckets=None) -> Rollouts:
    """Sample n responses per prompt and return host rollouts (unscored)."""
    sc = self.config.sampling
    out = self.env.sample(params, self.model_cfg, prompts, n=n, key=key, mesh=self.mesh,
                          rules=self.rules,
                          temperature=sc.temperature if temperature is None else temperature,
                          prompt_buckets=buckets or tuple(sc.prompt_buckets))
    texts = self.env.decode(out.tokens, out.lengths)
    rows_prompts = [p for p in prompts for _ in range(n)]
    return Rollouts(prompts=rows_prompts, tokens=np.asarray(out.tokens, np.int32),
                    mask=np.asarray(out.response_mask, np.int32),
                    logp=np.asarray(out.logprobs, np.float32),
                    lengths=np.asarray(out.lengths), rewards=np.zeros(len(texts), np.float32),
                    feedback=[""] * len(texts), texts=texts)

  def score(self, ro: Rollouts, examples_per_row: list) -> dict:
    rewards, feedback, stats = self.env.verify(examples_per_row, ro.texts)
    ro.rewards = np.asarray(rewards, np.float32)
    ro.feedback = list(feedback)
    return stats

  def _rows(self, ro: Rollouts, idx, prompt_len: int, *, prompts=None):
    """Gather rows ``idx`` of ``ro`` with prompts left-padded to prompt_len."""
    idx = np.asarray(idx, np.int64)
    plist = [ro.prompts[i] for i in idx] if prompts is None else prompts
    pt, pm = batch_lib.left_pad(plist, prompt_len, self.env.pad_id)
    return pt, pm, ro.tokens[idx], ro.mask[idx], ro.logp[idx]

  def _num_rows(self, n: int, max_rows: int = 0) -> int:
    """Process-local row bucket, agreed over hosts (their shapes must match).

    Power-of-two buckets by default; with ``rl.fixed_row_buckets`` every batch
    of a kind uses its largest possible size (``max_rows``): one update program
    for the whole run, at the cost of computing padded rows (right for tiny
    models, where a compile costs more than the padding)."""
    local_shards = max(sh.batch_shard_count(self.mesh) // jax.process_count(), 1)
    mult = local_shards * self.config.rl.micro_batches * self.config.rl.mini_batches
    n, = distributed.agree_max(n)
    if self.config.rl.fixed_row_buckets and max_rows:
      n = max(n, max_rows)
    return batch_lib.bucket_rows(n, mult)

  def _max_rows(self, P: int):
    """Largest (EPA, ECC) row counts a step can produce for P local prompts."""
    rl = self.config.rl
    extra = rl.epa_max_per_prompt if (rl.round2 and rl.epa_mode == "append") else 0
    return P * (rl.group_size + extra), P * rl.round2_size

  def rollout_step(self, params, examples: list, step: int, key):
    """Phases 1-2 and batch assembly. Returns (epa, ecc, metrics) with host batches."""
    cfg, rl = self.config, self.config.rl
    n, thr = rl.group_size, self.config.verifier.success_threshold
    P = len(examples)
    k1, k2 = jax.random.split(key)
    host_rng = np.random.default_rng([cfg.seed, step])
    m: dict[str, Any] = {}
    t0 = time.perf_counter()

    if rl.objective == "fcp":  # feedback-conditional policy: condition on c+
      q_ids = [self.env.fcp_prompt(ex, rl.fcp_positive_feedback) for ex in examples]
    else:
      q_ids = [self.env.prompt_ids(ex) for ex in examples]
    ro1 = self.sample(params, q_ids, n, k1)
    m["time/sample1_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    ex_rows = [ex for ex in examples for _ in range(n)]
    vstats = self.score(ro1, ex_rows)
    m["time/verify_s"] = time.perf_counter() - t1
    r1 = ro1.rewards.reshape(P, n)
    m.update({"reward/round1": float(r1.mean()),
              "reward/round1_solved": float((r1 >= thr).mean()),
              "groups/all_equal_frac": assemble.all_zero_group_fraction(r1),
              "response/length": float(ro1.lengths.mean()),
              "verifier/errors": float(vstats.get("errors", 0))})
    gen_tokens = int(ro1.mask.sum())

    R = ro1.tokens.shape[1]
    qlen, = distributed.agree_max(max(len(q) for q in q_ids))
    qbucket = _bucket(qlen, tuple(cfg.sampling.prompt_buckets))

    if rl.objective == "fcp":
      ctx = [self.env.fcp_prompt(ex, rl.fcp_positive_feedback if r >= thr else fb)
             for ex, r, fb in zip(ex_rows, ro1.rewards, ro1.feedback)]
      plen = _bucket(distributed.agree_max(max(len(c) for c in ctx))[0],
                     tuple(cfg.sampling.fap_prompt_buckets))
      pt, pm, rt, rm, rl_ = self._rows(ro1, np.arange(P * n), plen, prompts=ctx)
      rows = self._num_rows(P * n)
      epa = batch_lib.make_policy_batch(pt, pm, rt, rm, np.ones(P * n, np.float32), rl_,
                                        np.zeros(P * n, bool), num_rows=rows,
                                        pad_id=self.env.pad_id)
      ecc = batch_lib.empty_policy_batch(8, R, self._num_rows(1))
      m["time/rollout_s"] = time.perf_counter() - t0
      m["tokens/generated"] = gen_tokens
      m["rollouts/generated"] = P * n
      return epa, ecc, m

    # ---- round 2: feedback-guided exploration
    r2_prompt = np.zeros((0,), np.int64)
    r2_source = np.zeros((0,), np.int64)
    ro2 = None
    if rl.round2:
      t2 = time.perf_counter()
      selected = assemble.select_fap_sources(r1, rl.fap_from, thr)
      r2_prompt, r2_source = assemble.round2_plan(selected, rl.round2_size, rl.fap_mode)
      any_r2 = bool(distributed.agree_max(int(r2_prompt.size > 0))[0])
      if any_r2 and not r2_prompt.size:
        # another host samples round 2: join the collective program with no prompts
        self.sample(params, [], 1 if rl.fap_mode == "single" else rl.round2_size, k2,
                    buckets=tuple(cfg.sampling.fap_prompt_buckets))
      if r2_prompt.size:
        if rl.fap_mode == "single":
          fap_ids = [self.env.fap_ids(examples[p], ro1.texts[p * n + s], ro1.feedback[p * n + s])
                     for p, s in zip(r2_prompt, r2_source)]
          ro2 = self.sample(params, fap_ids, 1, k2,
                            buckets=tuple(cfg.sampling.fap_prompt_buckets))
        else:
          uniq = list(dict.fromkeys(r2_prompt.tolist()))
          agg_ids = [self.env.aggregated_ids(
              examples[p], [ro1.texts[p * n + i] for i in range(n)],
              [ro1.feedback[p * n + i] for i in range(n)], r1[p]) for p in uniq]
          ro2 = self.sample(params, agg_ids, rl.round2_size, k2,
                            buckets=tuple(cfg.sampling.fap_prompt_buckets))
          r2_prompt = np.repeat(np.asarray(uniq, np.int64), rl.round2_size)
          r2_source = np.full(r2_prompt.shape, -1, np.int64)
        self.score(ro2, [examples[p] for p in r2_prompt])
        gen_tokens += int(ro2.mask.sum())
        fixed = ro2.rewards >= thr
        src_failed = np.where(r2_source >= 0, r1[r2_prompt, np.maximum(r2_source, 0)] < thr, True)
        m["reward/round2"] = float(ro2.rewards.mean())
        m["feedback/fix_rate"] = float(fixed[src_failed].mean()) if src_failed.any() else 0.0
        m["response/length_round2"] = float(ro2.lengths.mean())
      m["round2/rollouts"] = int(r2_prompt.size)
      m["time/round2_s"] = time.perf_counter() - t2
    r2 = ro2.rewards if ro2 is not None else np.zeros((0,), np.float32)

    # ---- EPA: merged groups on q
    tau = rl.epa_tau if rl.epa_tau >= 0 else 1.0 / n
    groups = assemble.epa_groups(
        r1, r2, r2_prompt, r2_source, select=rl.epa_select, mode=rl.epa_mode,
        trigger=rl.epa_trigger, tau=tau, max_per_prompt=rl.epa_max_per_prompt, threshold=thr,
        enabled=rl.round2 and rl.w_epa > 0 and ro2 is not None, rng=host_rng)
    m["epa/injected"] = groups.injected
    keep = None
    if rl.gfpo_k or rl.gfpo_adaptive:
      lengths = np.where(groups.offpolicy, ro2.lengths[np.maximum(groups.member, 0)]
                         if ro2 is not None else 0, ro1.lengths[np.maximum(groups.member, 0)]
                         if True else 0)
      lengths = np.where(groups.valid, lengths, 0)
      if rl.gfpo_adaptive:
        import fbos_kernels as K
        k_arr, self.gfpo_state = K.adaptive_k(
            self.gfpo_state, jnp.asarray(r1.mean(1), jnp.float32), group_size=n,
            k_map=tuple(rl.gfpo_k_map))
        k = np.asarray(k_arr)
      else:
        k = rl.gfpo_k
      keep = assemble.gfpo_keep(groups.rewards, lengths, groups.valid, k, rl.gfpo_metric)
      m["gfpo/kept_frac"] = float(keep[groups.valid].mean())
      m["response/length_kept"] = float(lengths[keep].mean()) if keep.any() else 0.0
    adv = assemble.advantages(groups.rewards, groups.valid, rl.advantage, rl.adv_eps, keep)
    vp, vg = np.nonzero(groups.valid)
    onp = ~groups.offpolicy[vp, vg]
    mem = groups.member[vp, vg]
    # gather rows: on-policy from round 1, off-policy from round 2 (re-scored on q)
    ro_on = self._rows(ro1, mem[onp], qbucket)
    parts = [ro_on]
    offp = np.zeros(len(mem), bool)
    order = np.concatenate([np.flatnonzero(onp), np.flatnonzero(~onp)])
    if (~onp).any():
      q_for_off = [q_ids[p] for p in vp[~onp]]
      parts.append(self._rows(ro2, mem[~onp], qbucket, prompts=q_for_off))
      offp[np.flatnonzero(~onp)] = True
    pt, pm, rt, rm, rlp = (np.concatenate([pp[i] for pp in parts]) for i in range(5))
    adv_rows = adv[vp, vg][order]
    loss_mask = rm.astype(np.float32)
    if keep is not None:
      loss_mask = loss_mask * keep[vp, vg][order][:, None]
    epa = batch_lib.make_policy_batch(pt, pm, rt, rm, adv_rows, rlp, offp[order],
                                      num_rows=self._num_rows(len(mem), self._max_rows(P)[0]),
                                      loss_mask=loss_mask,
                                      pad_id=self.env.pad_id)

    # ---- ECC: round-2 rollouts on their FAPs (on-policy)
    has_ecc = rl.round2 and rl.w_ecc > 0 and ro2 is not None and len(r2) > 0
    if rl.round2 and rl.w_ecc > 0:
      has_ecc = bool(distributed.agree_max(int(has_ecc))[0])
    if has_ecc and (ro2 is None or not len(r2)):  # another host has ECC rows; this one none
      ecc = batch_lib.empty_policy_batch(_bucket(distributed.agree_max(0)[0] or 1,
                                                 tuple(cfg.sampling.fap_prompt_buckets)), R,
                                         self._num_rows(0, self._max_rows(P)[1]))
    elif has_ecc:
      a2 = assemble.ecc_advantages(r1, r2, r2_prompt, r2_source, mode=rl.ecc_advantage,
                                   estimator=rl.advantage, eps=rl.adv_eps)
      fb = _bucket(distributed.agree_max(max(len(x) for x in ro2.prompts))[0],
                   tuple(cfg.sampling.fap_prompt_buckets))
      pt2, pm2, rt2, rm2, rlp2 = self._rows(ro2, np.arange(len(r2)), fb)
      ecc = batch_lib.make_policy_batch(pt2, pm2, rt2, rm2, a2, rlp2, np.zeros(len(r2), bool),
                                        num_rows=self._num_rows(len(r2), self._max_rows(P)[1]),
                                        pad_id=self.env.pad_id)
    else:
      ecc = batch_lib.empty_policy_batch(8, R, self._num_rows(1))
    m["time/rollout_s"] = time.perf_counter() - t0
    m["tokens/generated"] = gen_tokens
    m["rollouts/generated"] = P * n + int(r2_prompt.size)
    return epa, ecc, m

  # ------------------------------------------------------------------ update
  def objective_weights(self, step: int) -> np.ndarray:
    rl = self.config.rl
    w = np.asarray([rl.w_epa, rl.w_ecc], np.float32)
    if rl.objective == "fcp":
      return np.asarray([1.0, 0.0], np.float32)
    if rl.objective_schedule == "alternate" and rl.round2:
      w = w * (np.asarray([1, 0]) if step % 2 == 0 else np.asarray([0, 1]))
    return w

  def update(self, state, epa, ecc, step: int):
    rl = self.config.rl
    weights = jnp.asarray(self.objective_weights(step))
    mets = []
    for epoch in range(max(rl.ppo_epochs, 1)):
      if rl.mini_batches > 1:  # rows in a fresh order per epoch, so each mini-batch mixes
        # on- and off-policy rows and padding instead of taking them in assembly order
        perm_rng = np.random.default_rng([self.config.seed, step, epoch])
        epa, ecc = (batch_lib.take_rows(b, perm_rng.permutation(b.num_rows)) for b in (epa, ecc))
      for mb_epa, mb_ecc in zip(batch_lib.split_rows(epa, rl.mini_batches),
                                batch_lib.split_rows(ecc, rl.mini_batches)):
        d_epa, d_ecc = self.put_batch(mb_epa), self.put_batch(mb_ecc)
        prox = (None, None)
        if rl.decoupled:  # π_prox recomputed at the start of the step
          prox = (self.logprob_fn()(state.params, d_epa), self.logprob_fn()(state.params, d_ecc))
        state, met = self.update_fn()(state, d_epa, d_ecc, weights, self.ref_params, *prox)
        met = jax.device_get(met)
        if not met["finite"]:
          self.nonfinite_steps += 1
          if not rl.skip_nonfinite:
            raise NonFiniteStepError(
                f"non-finite loss or gradient at step {step} (rl.skip_nonfinite=False)")
        mets.append(met)
    out = {k: float(np.mean([mm[k] for mm in mets])) for k in mets[0]}
    return state, out

  # ------------------------------------------------------------------ evaluation
  def evaluate(self, params, examples: list, *, k: int = 1, step: int = 0) -> dict:
    """pass@1 (greedy) and, for k > 1, unbiased pass@k at temperature 1."""
    ids = [self.env.prompt_ids(ex) if self.config.rl.objective != "fcp"
           else self.env.fcp_prompt(ex, self.config.rl.fcp_positive_feedback) for ex in examples]
    key = jax.random.key(10_000 + step)
    thr = self.config.verifier.success_threshold
    ro = self.sample(params, ids, 1, key, temperature=self.config.sampling.eval_temperature)
    self.score(ro, examples)
    solved = ro.rewards >= thr
    out = {"eval/accuracy": float(solved.mean()),
           "eval/length": float(ro.lengths.mean())}
    # greedy accuracy per difficulty level (procedural tasks), e.g. eval/accuracy_d2
    levels = np.asarray([ex.get("difficulty", -1) for ex in examples])
    known = sorted(set(levels.tolist()) - {-1})
    for d in known if len(known) > 1 else ():
      out[f"eval/accuracy_d{d}"] = float(solved[levels == d].mean())
    out = distributed.mean_over_processes(out)
    if k > 1:
      rok = self.sample(params, ids, k, key, temperature=1.0)
      self.score(rok, [ex for ex in examples for _ in range(k)])
      c = (rok.rewards >= thr).reshape(len(examples), k).sum(1)
      out[f"eval/pass@{k}"] = float(np.mean([assemble.pass_at_k(k, int(ci), k) for ci in c]))
      out["eval/pass@1_sampled"] = float(np.mean([assemble.pass_at_k(k, int(ci), 1) for ci in c]))
    return out

  # ------------------------------------------------------------------ loop
  def sampling_params(self, state):
    """Params that sample this step: current, or η versions old (rl.staleness)."""
    eta = self.config.rl.staleness
    if eta <= 0:
      return state.params
    self.param_history.append(jax.tree.map(jnp.copy, state.params))
    self.param_history = self.param_history[-(eta + 1):]
    return self.param_history[0]

  def train_step(self, state, step: int):
    examples = self.env.next_train_batch()
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
    t0 = time.perf_counter()
    epa, ecc, m = self.rollout_step(self.sampling_params(state), examples, step, key)
    t1 = time.perf_counter()
    state, um = self.update(state, epa, ecc, step)
    t2 = time.perf_counter()
    m.update({f"loss/{k[:3]}" if k.endswith("_loss") else f"policy/{k}": v
              for k, v in um.items()})
    m["policy/entropy"] = um["epa_entropy"]
    m["policy/grad_norm"] = um["grad_norm"]
    m["policy/kl"] = um["epa_kl"]
    m["policy/clipfrac"] = um["epa_clipfrac"]
    m["time/update_s"] = t2 - t1
    m["time/step_s"] = t2 - t0
    m["tokens/per_s"] = m["tokens/generated"] / max(t1 - t0, 1e-9)
    m["nonfinite_steps"] = self.nonfinite_steps
    m = distributed.mean_over_processes(m, sum_keys=_SUM_METRICS)
    if um["finite"] < 1:
      ids = [str(ex.get("id", "")) for ex in examples]
      logging.warning("step %d skipped (non-finite loss/grad); batch ids: %s", step, ids)
      m["skipped_batch_ids"] = ids
    return state, m

  def train(self, state=None, *, steps: Optional[int] = None, eval_examples=None,
            on_step: Optional[Callable] = None, initial_eval: Optional[dict] = None):
    """Train to ``steps``. ``initial_eval``: the step-0 evaluate() result if the
    caller already has it (it is logged instead of evaluating again)."""
    cfg = self.config
    if state is None:
      state = self.init_state()
      state, resumed = self.maybe_restore(state)
      if resumed:
        metrics_lib.truncate_jsonl(self.metrics.path, int(state.step))
    steps = cfg.train.steps if steps is None else steps
    start = int(state.step)
    eval_examples = eval_examples if eval_examples is not None else self.env.eval_examples()
    history = []
    if start == 0 and cfg.train.eval_every > 0 and eval_examples:
      em = initial_eval or self.evaluate(state.params, eval_examples, k=cfg.train.eval_k, step=0)
      self.metrics.write(0, em)
      history.append(dict(em, step=0))
      logging.info("step 0 eval: %s", _fmt(em))
    bar = _progress(range(start, steps), cfg.train.progress, desc=f"{cfg.algo} RL")
    last_acc = history[0].get("eval/accuracy", float("nan")) if history else float("nan")
    for step in bar:
      state, m = self.train_step(state, step)
      s = step + 1
      if cfg.train.eval_every > 0 and eval_examples and (s % cfg.train.eval_every == 0 or s == steps):
        m.update(self.evaluate(state.params, eval_examples, k=cfg.train.eval_k, step=s))
      self.metrics.write(s, m)
      history.append(dict(m, step=s))
      if hasattr(bar, "set_postfix"):
        last_acc = m.get("eval/accuracy", last_acc)
        bar.set_postfix(r1=f"{m['reward/round1']:.2f}", acc=f"{last_acc:.2f}", refresh=False)
      if s % cfg.train.log_every == 0:
        logging.info("step %d: %s", s, _fmt(m))
      self.ckpt_maybe(state, s, steps)
      if on_step is not None:
        on_step(s, state, m)
    self.ckpt.wait()
    return state, history

  def ckpt_maybe(self, state, s, steps):
    if self.config.train.checkpoint_every > 0 and (s % self.config.train.checkpoint_every == 0 or s == steps):
      self.save(state, force=(s == steps))

  def close(self):
    self.ckpt.close()
    self.metrics.close()
    self.env.close()


# metrics summed (not averaged) over hosts: counts and throughput
_SUM_METRICS = ("tokens/generated", "rollouts/generated", "round2/rollouts", "epa/injected",
                "tokens/per_s")


def _bucket(n: int, buckets: tuple) -> int:
  for b in sorted(buckets):
    if n <= b:
      return b
  raise ValueError(f"a prompt of {n} tokens exceeds the largest bucket {max(buckets)}; "
                   "raise sampling.prompt_buckets / sampling.fap_prompt_buckets")


def _fmt(m: dict) -> str:
  keys = ("reward/round1", "reward/round2", "feedback/fix_rate", "epa/injected", "loss/epa",
          "loss/ecc", "policy/entropy", "policy/grad_norm", "eval/accuracy", "time/step_s")
  return " ".join(f"{k.split('/')[-1]}={m[k]:.4g}" for k in keys if k in m
                  and isinstance(m[k], (int, float)))


def _progress(it, enabled: bool, desc: str):
  if not enabled or jax.process_index() != 0:
    return it
  try:
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, dynamic_ncols=True)
  except ImportError:
    return it
