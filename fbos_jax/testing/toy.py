"""A toy model and hand-built policy batches for update-step tests (the losses,
the per-term gradients, micro-batching), shared by the test files that need them.

Batches are ``[prompt (left-padded to P_LEN) | response (R_LEN)]`` rows of
random ids; :func:`step` returns the jitted update, one program per distinct
(optimizer, weights, loss config, loop shape), cached so tests share compiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fbos_jax.model import qwen
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import batch_kinds
from fbos_jax.rl import config as C
from fbos_jax.rl import update as U
from fbos_jax.rl.state import TrainState

CFG = qwen.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
P_LEN, R_LEN = 5, 6
EPA, ECC = batch_kinds.EPA.name, batch_kinds.ECC.name


def params(seed=0):
  return qwen.init_params(CFG, jax.random.key(seed))


def batch(n, seed, *, adv=None, offpolicy=None, old_logp=None):
  """n random rows: prompts of 2..P_LEN tokens, responses of 1..R_LEN tokens."""
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(3, 40, size=rng.integers(2, P_LEN + 1))) for _ in range(n)]
  rt = rng.integers(3, 40, size=(n, R_LEN)).astype(np.int32)
  lens = rng.integers(1, R_LEN + 1, size=n)
  rm = (np.arange(R_LEN)[None] < lens[:, None]).astype(np.int32)
  adv = rng.normal(size=n).astype(np.float32) if adv is None else adv
  old = ((rng.normal(size=(n, R_LEN)) * 0.1 - 2.0).astype(np.float32) if old_logp is None
         else old_logp)
  off = np.zeros(n, bool) if offpolicy is None else offpolicy
  return batch_lib.make_policy_batch(prompts, rt, rm, adv, old, off, prompt_len=P_LEN,
                                     num_rows=n)


def empty(rows):
  """A batch whose rows are all padding (fully masked): its term is exactly 0."""
  z = np.zeros((0, R_LEN), np.int32)
  return batch_lib.make_policy_batch([], z, z, np.zeros(0, np.float32), z.astype(np.float32),
                                     np.zeros(0, bool), prompt_len=P_LEN, num_rows=rows)


def ucfg(w=(1.0, 1.0), lc=C.LossConfig(), **kw) -> C.UpdateConfig:
  """An EPA and an ECC term, both policy_gradient, with weights ``w``."""
  return C.UpdateConfig(terms=(C.Term(EPA, "policy_gradient", w[0]),
                               C.Term(ECC, "policy_gradient", w[1])), loss=lc, **kw)


@functools.lru_cache(maxsize=None)
def optimizer(kind: str = "adamw", lr: float = 1e-2):
  """adamw (no weight decay) or sgd: one object per (kind, lr)."""
  return optax.sgd(lr) if kind == "sgd" else optax.adamw(lr, weight_decay=0.0)


@functools.lru_cache(maxsize=None)
def _jitted(opt_key: tuple, u: C.UpdateConfig):
  return jax.jit(U.make_update_fn(CFG, optimizer(*opt_key), u))


def step(opt_key=("adamw", 1e-2), w=(1.0, 1.0), lc=C.LossConfig(), **kw):
  """The jitted update with an EPA and an ECC term: (state, epa, ecc) -> (state, metrics)."""
  fn = _jitted(tuple(opt_key), ucfg(tuple(w), lc, **kw))
  return lambda state, epa, ecc: fn(state, {EPA: epa, ECC: ecc})


def state(p, opt_key=("adamw", 1e-2)):
  return TrainState(step=jnp.zeros((), jnp.int32), params=p,
                    opt_state=optimizer(*opt_key).init(p),
                    rng=jax.random.key_data(jax.random.key(0)),
                    nonfinite_steps=jnp.zeros((), jnp.int32))


@functools.lru_cache(maxsize=None)
def _grad_fn(lc: C.LossConfig):
  from fbos_jax.rl import objectives as O
  u = ucfg((1.0, 1.0), lc)

  @jax.jit
  def g(p, epa, ecc, w):
    batches = {EPA: epa, ECC: ecc}
    denoms = {k: O.denominators(b, lc) for k, b in batches.items()}

    def loss(p):
      return sum(O.term_objective(p, CFG, batches[t.batch], t, lc, w[i], denoms[t.batch])[0]
                 for i, t in enumerate(u.terms))
    return jax.grad(loss)(p)
  return g


def grads(p, epa, ecc, w, lc=C.LossConfig()):
  """The gradient of w[0] * EPA + w[1] * ECC (each over its own denominator)."""
  return _grad_fn(lc)(p, epa, ecc, jnp.asarray(w, jnp.float32))
