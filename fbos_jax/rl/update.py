"""The one jitted update step of every algorithm: a pure function of the state and batches.

``update(state, batches) -> (state, metrics)``

* ``state``: the :class:`~fbos_jax.rl.state.TrainState` (donated).
* ``batches``: ``{term.batch: PolicyBatch}`` for the config's terms, e.g.
  ``epa`` (rows on q: round-1 rollouts with PPO clip, plus feedback-guided ones
  flagged ``is_offpolicy`` with f(u)=u/(u+lambda)) and ``ecc`` (round-2 rollouts
  on their FAPs). Rows [N] must divide by ``mini_batches * micro_batches``. A
  batch may be packed (:class:`~fbos_jax.rl.batch.PackedBatch`, ``rl.micro_batch_tokens``:
  sequences end to end in rows of the token budget); it then carries its own
  micro-batch count.

Inside one program, purejaxrl-style (no host round trip):

1. pi_prox log-probs of every row under the current params, when a term uses
   the decoupled loss (AReaL: recomputed at the start of the step),
   micro-batched like the update;
2. ``epochs x mini_batches`` optimizer steps as one ``lax.scan``; every epoch
   visits the rows in a fresh order drawn from the state's PRNG (no reorder
   when there is one mini-batch);
3. inside each, each term's gradient-accumulation steps (``lax.scan`` over its
   micro-batches: ``micro_batches``, or a packed batch's own count; one without a
   loss token is skipped, ``lax.cond``), the term
   normalised by its whole-mini-batch denominator (:mod:`fbos_jax.rl.objectives`),
   so accumulation is exact. Each term's gradient is taken on its own (the
   terms train on different batches, so this costs no extra compute) and added
   into the step's gradient; ``grad_norm_<term>`` is the norm of a term's
   weighted contribution, ``grad_norm`` that of the sum (see :func:`_grads` for
   the memory);
4. an optimizer step that is skipped (params and optimizer state kept) when
   the loss or gradient is not finite and ``skip_nonfinite``; each step counts
   the elements of the params whose stored value it changed
   (``update/param_change_frac``: a master in a dtype too coarse for the
   learning rate keeps most of them, ``fbos_jax/rl/guards.py:ParamChangeWatch``).

``state.step`` counts loop steps (skipped ones too): the loop, the checkpoints
and the metrics share it. The mini-batch order comes from the state's
``shuffle`` stream (``fbos_jax.rl.state.stream_key``), never from the key the
rollout sampled with.

:func:`compiled_update` is the jitted program for a (model, optimizer, update,
state layout, mesh): built once per process and shared by every trainer (and
test) with the same configs, so a program is compiled once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fbos_jax import optim as optim_lib
from fbos_jax import program_cache
from fbos_jax.model import qwen
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import objectives
from fbos_jax.rl import state as state_lib
from fbos_jax.rl.config import UpdateConfig
from fbos_jax.rl.state import TrainState


def _split(tree, parts: int, i):
  """Part ``i`` of ``parts`` equal row blocks of every leaf ([N, ...] -> [N/parts, ...])."""
  return jax.tree.map(lambda a: a.reshape((parts, a.shape[0] // parts) + a.shape[1:])[i], tree)


def _parts(b, ucfg: UpdateConfig) -> int:
  """Row blocks of batch ``b`` in one update: mini-batches x its micro-batches."""
  return ucfg.mini_batches * batch_lib.micro_batches(b, ucfg.micro_batches)


def _unless_empty(micro_batch, compute, skip, operand):
  """``compute(operand)``, or ``skip(operand)`` when ``micro_batch`` has no loss
  token (``lax.cond``: its forward and backward are not run). Such a micro-batch
  adds exactly nothing to any sum or gradient (every term is masked), and a
  packed batch with ``rl.fixed_row_buckets`` has one whenever its real tokens
  need fewer micro-batches than its fixed shape holds (the rows fill in order)."""
  return jax.lax.cond(jnp.any(micro_batch.loss_mask != 0), compute, skip, operand)


def _check_rows(batches: dict, ucfg: UpdateConfig):
  for name, b in batches.items():
    if b.num_rows % _parts(b, ucfg):
      raise ValueError(f"batch {name!r} has {b.num_rows} rows, which do not split into "
                       f"mini_batches x micro_batches = {_parts(b, ucfg)} equal parts")


def prox_logprobs(params, cfg: qwen.ModelConfig, batches: dict, ucfg: UpdateConfig) -> dict:
  """pi_prox log-probs [N, R] ([N, L] packed) of the batches the decoupled terms
  train on, a micro-batch of rows at a time (``lax.map``)."""
  lc = ucfg.loss
  out = {}
  for term in ucfg.terms:
    if term.loss != "decoupled":
      continue
    b = batches[term.batch]
    parts = _parts(b, ucfg)

    def one(i, b=b):
      mb = _split(b, parts, i)

      def logprobs(mb):
        logp, _ = objectives.sequence_logprobs(params, cfg, mb, temperature=lc.temperature,
                                               time_chunk=lc.time_chunk,
                                               vocab_chunk=lc.vocab_chunk, compute_entropy=False,
                                               vocab_limit=lc.vocab_limit)
        return logp

      return _unless_empty(mb, logprobs, lambda mb: jnp.zeros(mb.old_logp.shape, jnp.float32), mb)

    out[term.batch] = jax.lax.map(one, jnp.arange(parts)).reshape(b.old_logp.shape)
  return out


def _grads(params, cfg, batches, ucfg, weights, ref_params, prox):
  """The step's gradient, the loss and each term's metrics of one mini-batch:
  (grads, loss, {term.batch: TermMetrics}).

  Each term is differentiated on its own (the terms train on different batches,
  so this is the compute of one joint gradient), accumulated over its own
  micro-batches (``micro_batches``, or a packed batch's count), its norm taken,
  and added to the step's gradient in the config's term order: one float32
  accumulator besides the step's gradient, whatever the number of terms (none
  for one term)."""
  grad_fn = jax.value_and_grad(objectives.term_objective, has_aux=True)
  zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grads, loss, terms = None, jnp.zeros(()), {}
  for k, term in enumerate(ucfg.terms):
    b, p = batches[term.batch], prox.get(term.batch)
    denom = objectives.denominators(b, ucfg.loss)
    m = batch_lib.micro_batches(b, ucfg.micro_batches)

    def micro_step(carry, i, b=b, p=p, denom=denom, m=m, k=k, term=term):
      mb = _split(b, m, i)

      def add(carry):
        g_acc, l_acc, stats = carry
        (l, ts), g = grad_fn(params, cfg, mb, term, ucfg.loss, weights[k], denom,
                             ref_params, None if p is None else _split(p, m, i))
        return jax.tree.map(jnp.add, g_acc, g), l_acc + l, jax.tree.map(jnp.add, stats, ts)

      return _unless_empty(mb, add, lambda carry: carry, carry), None

    init = (zeros(), jnp.zeros(()), objectives.TermStats.zeros())
    (g, l, stats), _ = jax.lax.scan(micro_step, init, jnp.arange(m))
    terms[term.batch] = objectives.TermMetrics(stats=stats, grad_norm=optax.tree.norm(g),
                                               tokens=denom[1])
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    loss = loss + l
  return (zeros() if grads is None else grads), loss, terms


def param_change_frac(old, new) -> jax.Array:
  """[] float32: the fraction of the elements of ``old`` whose stored value differs
  in ``new`` (same pytree). Each leaf's count fuses into the update's elementwise
  pass, so it holds no second copy of the params."""
  changed = sum(_count_changed(a, b) for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)))
  total = float(max(sum(a.size for a in jax.tree.leaves(old)), 1))  # 8.2e9 > int32
  return changed / total


def _count_changed(a, b) -> jax.Array:
  """[] float32: elements where ``a != b``, counted exactly in int32 (per leading
  slice when the leaf has 2^31 elements or more; float32 adds 1.0 exactly only up to
  2^24)."""
  ne = a != b
  if ne.size < 2 ** 31:
    return jnp.sum(ne, dtype=jnp.int32).astype(jnp.float32)
  return jnp.sum(jnp.sum(ne, axis=tuple(range(1, ne.ndim)), dtype=jnp.int32).astype(jnp.float32))


def make_update_fn(cfg: qwen.ModelConfig, optimizer: optax.GradientTransformation,
                   ucfg: UpdateConfig):
  """Build ``update(state, batches) -> (state, UpdateMetrics)`` (jit it with the
  state's shardings as out_shardings and ``donate_argnums=0``; or take the shared
  program from :func:`compiled_update`)."""
  mini = ucfg.mini_batches
  steps = ucfg.epochs * mini

  def update(state: TrainState, batches: dict) -> tuple[TrainState, Any]:
    _check_rows(batches, ucfg)
    weights = objectives.term_weights(ucfg, state.step)
    prox = prox_logprobs(state.params, cfg, batches, ucfg) if ucfg.needs_prox else {}
    key = state_lib.stream_key(state.rng, "shuffle", state.step)

    def opt_step(carry, j):
      params, opt_state, n_bad = carry
      epoch, i = j // mini, j % mini
      data = (batches, prox)
      if mini > 1:  # a fresh row order per epoch, so each mini-batch mixes row kinds
        k = jax.random.fold_in(key, epoch)
        perm = {n: jax.random.permutation(jax.random.fold_in(k, h), b.num_rows)
                for h, (n, b) in enumerate(sorted(batches.items()))}
        data = ({n: jax.tree.map(lambda a, p=perm[n]: a[p], b) for n, b in batches.items()},
                {n: a[perm[n]] for n, a in prox.items()})
      mb, mp = _split(data, mini, i)
      grads, loss, terms = _grads(params, cfg, mb, ucfg, weights, state.ref_params, mp)
      grad_norm = optax.tree.norm(grads)
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      updates, new_opt = optimizer.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      if ucfg.skip_nonfinite:
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_params, new_opt = keep(new_params, params), keep(new_opt, opt_state)
      met = objectives.UpdateMetrics(terms=terms, loss=loss, grad_norm=grad_norm,
                                     finite=finite.astype(jnp.float32),
                                     param_change_frac=param_change_frac(params, new_params))
      return (new_params, new_opt, n_bad + (~finite).astype(jnp.int32)), met

    (params, opt_state, n_bad), mets = jax.lax.scan(
        opt_step, (state.params, state.opt_state, jnp.zeros((), jnp.int32)), jnp.arange(steps))
    metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), mets)
    metrics = metrics.replace(finite=jnp.min(mets.finite))  # 0 when any step was skipped
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              nonfinite_steps=state.nonfinite_steps + jnp.minimum(n_bad, 1))
    return new_state, metrics

  return update


@functools.lru_cache(maxsize=None)
def _compiled(model_cfg, ucfg: UpdateConfig, layout: state_lib.StateLayout, mesh,
              rules_key: tuple):
  shardings = state_lib.state_shardings(state_lib.abstract_state(layout, mesh, dict(rules_key)))
  fn = make_update_fn(model_cfg, optim_lib.make_optimizer(layout.optim), ucfg)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return program_cache.tracked(
      jax.jit(fn, donate_argnums=(0,),
              out_shardings=(shardings, jax.tree.map(lambda _: rep, _metrics_shape(ucfg)))),
      "update")


def _metrics_shape(ucfg: UpdateConfig):
  z = jnp.zeros(())
  terms = {t.batch: objectives.TermMetrics(stats=objectives.TermStats(z, z, z, z, z),
                                           grad_norm=z, tokens=z) for t in ucfg.terms}
  return objectives.UpdateMetrics(terms=terms, loss=z, grad_norm=z, finite=z,
                                  param_change_frac=z)


def compiled_update(parts, mesh, rules, ucfg: UpdateConfig = None, optim_cfg=None):
  """The jitted ``update(state, batches) -> (state, UpdateMetrics)`` of ``parts``
  on ``mesh`` (state donated; its output keeps the state's shardings, so a run
  compiles it once per batch-shape bucket). ``ucfg`` / ``optim_cfg`` replace the
  run's (SFT's own terms and optimizer). Shared: the same configs, state layout
  and mesh give the same program object in this process."""
  return _compiled(parts.model, ucfg or parts.update, state_lib.StateLayout.of(parts, optim_cfg),
                   mesh, state_lib.rules_key(rules))


def place_batches(batches: dict, mesh, rules) -> dict:
  """{name: PolicyBatch or PackedBatch} of host numpy onto ``mesh`` (each process
  its own rows), as the update takes them (``fbos_jax/rl/packing.py:device_batches``
  packs them first when the run packs)."""
  from fbos_jax import sharding as sh
  return {k: jax.tree.map(lambda a: sh.put_process_local(a, mesh, rules), b)
          for k, b in batches.items()}


def gradients(params, cfg: qwen.ModelConfig, batches: dict, ucfg: UpdateConfig, *, step=0,
              ref_params=None):
  """(grads, loss, {term.batch: TermMetrics}) of one optimizer step on all of
  ``batches`` (one mini-batch, micro-batched as the update does, pi_prox from
  ``params``): what the update applies, for benches and tests that compare
  layouts (``launch/bench_update.py``)."""
  ucfg = dataclasses.replace(ucfg, mini_batches=1)
  _check_rows(batches, ucfg)
  prox = prox_logprobs(params, cfg, batches, ucfg) if ucfg.needs_prox else {}
  return _grads(params, cfg, batches, ucfg, objectives.term_weights(ucfg, step), ref_params, prox)
