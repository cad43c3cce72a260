"""Issue 16: what FBOS's evidence rests on. The alternate schedule, the two-term
loss by hand, the EPA rows' provenance, per-term gradients and on-policy entropy,
the per-bucket fix rate, and the FAP budget (the longest FAP fits; nothing is
cut on real steps; a too-small budget warns or raises)."""

import logging
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fbos_jax import metrics as metrics_lib
from fbos_jax import tasks
from fbos_jax import templates
from fbos_jax import tokenizer as tk
from fbos_jax.model import qwen
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import config as C
from fbos_jax.rl import fap_budget
from fbos_jax.rl import rollout as R
from fbos_jax.rl import rounds
from fbos_jax.rl.trainer import RLTrainer
from fbos_jax.testing import toy
from fbos_jax.verifiers import procedural
from configs import load

CFG, P_LEN, R_LEN = toy.CFG, toy.P_LEN, toy.R_LEN
_batch, _params = toy.batch, toy.params
PARITY = "fbos_jax.testing.small:parity_reward"


@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
  return tk.load_tokenizer(tk.build_char_tokenizer(tmp_path_factory.mktemp("tok")))


def _two_terms(w=(1.0, 1.0), schedule="joint", lc=C.LossConfig()):
  return C.UpdateConfig(terms=(C.Term("epa", "policy_gradient", w[0]),
                               C.Term("ecc", "policy_gradient", w[1])),
                        loss=lc, schedule=schedule)


def _run(ucfg, params, epa, ecc, step, lr=0.5):
  """One SGD update step of ``ucfg``'s two terms at loop step ``step`` (shared programs)."""
  opt = ("sgd", lr)
  state = toy.state(params, opt).replace(step=jnp.asarray(step, jnp.int32))
  fn = toy.step(opt, tuple(t.weight for t in ucfg.terms), ucfg.loss, schedule=ucfg.schedule)
  new, m = fn(state, epa, ecc)
  return jax.device_get(new.params), jax.device_get(m)


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- the schedule


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_alternate_schedule_trains_epa_on_even_steps_and_ecc_on_odd():
  """state.step decides: step 0 moves the params exactly as an EPA-only update,
  step 1 exactly as an ECC-only one (and the other term's gradient is 0)."""
  params = _params()
  epa, ecc = _batch(8, 41), _batch(4, 42)
  alt = _two_terms(schedule="alternate")
  for step, only, off in ((0, (1.0, 0.0), "ecc"), (1, (0.0, 1.0), "epa"),
                          (2, (1.0, 0.0), "ecc")):
    got, m = _run(alt, params, epa, ecc, step)
    want, _ = _run(_two_terms(only), params, epa, ecc, step)
    _assert_same(got, want)
    assert float(m.terms[off].grad_norm) == 0.0
    on = "epa" if off == "ecc" else "ecc"
    assert float(m.terms[on].grad_norm) > 0
    assert float(m.grad_norm) == pytest.approx(float(m.terms[on].grad_norm), rel=1e-6)
  # joint: both terms move the params, so it differs from either alone
  joint, _ = _run(_two_terms(), params, epa, ecc, 0)
  epa_alone, _ = _run(_two_terms((1.0, 0.0)), params, epa, ecc, 0)
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(joint), jax.tree.leaves(epa_alone)))


# ----------------------------------------------------------------------------- the loss by hand


def _hand_logp(params, b):
  """log pi(o_t | ...) from full logits and log_softmax (not objectives.py)."""
  logits = qwen.apply(params, jnp.asarray(b.tokens), jnp.asarray(b.attn_mask), CFG)
  lp = jax.nn.log_softmax(logits[:, P_LEN - 1:P_LEN - 1 + R_LEN].astype(jnp.float32), -1)
  return np.asarray(jnp.take_along_axis(lp, jnp.asarray(b.tokens)[:, P_LEN:, None], -1)[..., 0],
                    np.float64)


def _hand_term(params, b, agg, eps=(0.2, 0.28), lam=0.1):
  """(L, D) of one term in numpy: PPO clip on on-policy rows, -A u/(u+lam) with
  u = pi on off-policy rows; L and D by the aggregation's definition."""
  logp = _hand_logp(params, b)
  mask = np.asarray(b.loss_mask, np.float64)
  adv = np.asarray(b.advantages, np.float64)[:, None]
  off = np.asarray(b.is_offpolicy)[:, None]
  ratio = np.exp(logp - np.asarray(b.old_logp, np.float64))
  ppo = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps[0], 1 + eps[1]))
  u = np.exp(logp)
  tok = np.where(off, -adv * u / (u + lam), ppo) * mask
  rows = mask.sum(1) > 0
  if agg == "token-mean":
    return tok.sum(), mask.sum()
  if agg == "seq-mean-token-mean":
    return (tok.sum(1)[rows] / mask.sum(1)[rows]).sum(), rows.sum()
  return tok.sum() / mask.shape[1], rows.sum()  # seq-mean-token-sum-norm, L = R


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_two_term_loss_is_w1_L1_over_D1_plus_w2_L2_over_D2(agg):
  params = _params(3)
  rng = np.random.default_rng(5)
  probe = _batch(6, 51)
  near = _hand_logp(params, probe) + rng.normal(scale=0.3, size=(6, R_LEN))  # some clipped
  epa = _batch(6, 51, adv=np.asarray([1.2, -0.8, 0.5, -1.5, 0.9, 0.3], np.float32),
               offpolicy=np.asarray([False, False, False, False, True, True]),
               old_logp=near.astype(np.float32))
  ecc = _batch(4, 52)
  w = (0.7, 0.3)
  _, m = _run(_two_terms(w, lc=C.LossConfig(loss_agg=agg)), params, epa, ecc, 0)
  l1, d1 = _hand_term(params, epa, agg)
  l2, d2 = _hand_term(params, ecc, agg)
  want = w[0] * l1 / d1 + w[1] * l2 / d2
  assert float(m.loss) == pytest.approx(want, rel=2e-5, abs=1e-7)
  assert float(m.terms["epa"].stats.loss) == pytest.approx(l1 / d1, rel=2e-5, abs=1e-7)
  assert float(m.terms["ecc"].stats.loss) == pytest.approx(l2 / d2, rel=2e-5, abs=1e-7)


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_per_term_gradients_sum_to_the_step_gradient_and_onpolicy_entropy():
  """grad_norm_<term> is the norm of that term's weighted gradient alone; the
  step's gradient is their sum; entropy_onpolicy leaves the off-policy rows out."""
  params = _params(4)
  epa = _batch(6, 61, offpolicy=np.asarray([False, False, False, True, True, True]))
  ecc = _batch(4, 62)
  w = (1.0, 0.5)
  ucfg = _two_terms(w)
  _, m = _run(ucfg, params, epa, ecc, 0)
  lc = ucfg.loss

  def term_grad(i, b):
    from fbos_jax.rl import objectives as O
    d = O.denominators(b, lc)
    return jax.grad(lambda p: O.term_objective(p, CFG, b, ucfg.terms[i], lc, w[i], d)[0])(params)

  g1, g2 = term_grad(0, epa), term_grad(1, ecc)
  assert float(m.terms["epa"].grad_norm) == pytest.approx(float(optax.tree.norm(g1)), rel=1e-5)
  assert float(m.terms["ecc"].grad_norm) == pytest.approx(float(optax.tree.norm(g2)), rel=1e-5)
  total = jax.tree.map(jnp.add, g1, g2)
  assert float(m.grad_norm) == pytest.approx(float(optax.tree.norm(total)), rel=1e-5)
  # the entropy of the on-policy rows, by hand from full logits
  logits = qwen.apply(params, jnp.asarray(epa.tokens), jnp.asarray(epa.attn_mask), CFG)
  z = logits[:, P_LEN - 1:P_LEN - 1 + R_LEN].astype(jnp.float32)
  ent = np.asarray(jax.scipy.special.logsumexp(z, -1) - jnp.sum(jax.nn.softmax(z, -1) * z, -1))
  mask = np.asarray(epa.loss_mask)
  on = ~np.asarray(epa.is_offpolicy)
  want_on = (ent * mask)[on].sum() / mask[on].sum()
  want_all = (ent * mask).sum() / mask.sum()
  assert abs(want_on - want_all) > 4e-5 * want_all  # the two differ beyond the tolerance
  assert float(m.terms["epa"].stats.entropy_onpolicy) == pytest.approx(want_on, rel=1e-5)
  assert float(m.terms["epa"].stats.entropy) == pytest.approx(want_all, rel=1e-5)


# ----------------------------------------------------------------------------- EPA provenance


def test_epa_offpolicy_rows_carry_q_round2_tokens_and_round2_logps(tmp_path, small,
                                                                  one_device_mesh):
  c = small("configs/fbos.py:tiny", **{"data.verifier": PARITY})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh, log_metrics=False)
  ctx, params = tr.ctx, tr.init_state().params
  examples = next(tr.train_iter)
  k1, k2 = jax.random.split(jax.random.key(3))
  r1 = rounds.round1(ctx, params, examples, k1)
  rounds.verify(ctx, r1, examples)
  r2 = rounds.round2(ctx, params, examples, r1, k2)
  rounds.verify(ctx, r2, examples)
  rows, m = R.epa_rows(ctx, examples, r1, r2)
  q = [ctx.prompt_ids(ex) for ex in examples]
  off = np.flatnonzero(rows.offpolicy)
  assert m["epa/injected"] == len(off) > 0
  n, mm = r1.shape[1], r2.shape[1]
  for k in range(len(rows.prompts)):
    # every EPA row sits on a plain prompt q, never on a FAP
    src = r2 if rows.offpolicy[k] else r1
    match = [(p, j) for p in range(len(q)) if q[p] == rows.prompts[k]
             for j in range(src.shape[1])
             if src.valid[p, j] and np.array_equal(src.tokens[p, j], rows.tokens[k])]
    assert match, f"row {k} is not a {'round-2' if rows.offpolicy[k] else 'round-1'} row of its q"
    p, j = match[0]
    np.testing.assert_array_equal(rows.logp[k], src.logp[p, j])  # the logp it was sampled with
    np.testing.assert_array_equal(rows.mask[k], src.mask[p, j])
    if rows.offpolicy[k]:
      assert r2.rewards[p, j] >= ctx.threshold  # epa_select=correct
      fap = r2.contexts[p][j]
      assert fap != q[p] and len(fap) > len(q[p])  # it was sampled under its FAP ...
  assert mm == c.rl.round2_size and n == c.rl.group_size
  # ... and the padded batch keeps all of it: [left-padded q | round-2 tokens], round-2 logp
  batch = R.pad_batches(ctx, {"epa": rows})[0]["epa"]
  plen = batch.prompt_len
  for k in off:
    toks = np.asarray(batch.tokens[k])
    attn = np.asarray(batch.attn_mask[k])
    assert list(toks[:plen][attn[:plen] > 0]) == rows.prompts[k]
    resp = rows.mask[k] > 0
    np.testing.assert_array_equal(toks[plen:][resp], rows.tokens[k][resp])
    np.testing.assert_array_equal(np.asarray(batch.old_logp[k]), rows.logp[k])
    assert bool(batch.is_offpolicy[k])
  assert not np.asarray(batch.is_offpolicy)[np.flatnonzero(~rows.offpolicy)].any()
  tr.close()


# ----------------------------------------------------------------------------- fix rate buckets


def _rollouts(rewards, source=None, truncated=None):
  rewards = np.asarray(rewards, np.float32)
  p, n = rewards.shape
  z = np.zeros((p, n, 2), np.int32)
  return rounds.Rollouts(contexts=[[[]] * n] * p, tokens=z, mask=z, logp=z.astype(np.float32),
                    versions=z.astype(np.int64), lengths=np.ones((p, n), np.int32), valid=np.ones((p, n), bool),
                    source=np.full((p, n), -1) if source is None else np.asarray(source),
                    texts=[[""] * n] * p, rewards=rewards, feedback=[[""] * n] * p,
                    is_error=np.zeros((p, n), bool),
                    truncated=None if truncated is None else np.asarray(truncated))


def test_fix_rate_per_round1_success_bucket():
  # n = 8: prompt 0 has no success, prompt 1 two, prompt 2 five
  r1 = _rollouts([[0] * 8, [1, 1] + [0] * 6, [1] * 5 + [0] * 3])
  src = np.asarray([[0, 1, 2, 3], [2, 3, 4, 5], [5, 6, 7, 5]])
  r2 = _rollouts([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]], source=src,
                 truncated=[[True, False, False, False]] + [[False] * 4] * 2)
  m = rounds.round2_metrics(r1, r2, 1.0)
  assert [b[0] for b in rounds.success_buckets(8)] == ["0", "1to3", "4plus"]
  assert m["feedback/fix_rate_r1succ_0"] == 0.25
  assert m["feedback/fix_rate_r1succ_1to3"] == 0.5
  assert m["feedback/fix_rate_r1succ_4plus"] == 0.75
  assert m["feedback/fix_rows_r1succ_0"] == m["feedback/fix_rows_r1succ_4plus"] == 4
  assert m["feedback/fix_rate"] == 6 / 12 and m["feedback/fix_rows"] == 12
  assert m["feedback/resample_rate"] == pytest.approx((0 + 4 * 2 / 8 + 4 * 5 / 8) / 12)
  assert m["fap/truncated_frac"] == 1 / 12
  assert rounds.round1_metrics(r1, 1.0)["groups/all_fail_frac"] == 1 / 3


# ----------------------------------------------------------------------------- the FAP budget


def _worst_responses(tok, length, rng):
  """Responses of ``length`` tokens that make long feedback: every token the
  longest one, runs of one digit, descending digits, random tokens."""
  longest = max(range(len(tok)), key=lambda i: len(tok.decode([i], skip_special_tokens=True)))
  out = [tok.decode([longest] * length, skip_special_tokens=True), "0" * length,
         "9876543210" * 3, "".join(reversed("0123456789" * 3))[:length]]
  for _ in range(300):
    ids = [rng.randrange(len(tok)) for _ in range(length)]
    out.append(tok.decode(ids, skip_special_tokens=True))
    out.append("".join(rng.choice("0123456789+-*() x") for _ in range(length)))
  return out


@pytest.mark.parametrize("task,lo,hi", [("sort", 4, 10), ("sort", 9, 14), ("arithmetic", 1, 3),
                                        ("countdown", 2, 4), ("chain", 2, 8)])
@pytest.mark.parametrize("style", ["prose", "compact"])
def test_feedback_bound_holds_for_adversarial_responses(char_tok, task, lo, hi, style):
  rng = random.Random(0)
  r = 12
  chars = r * fap_budget.longest_token_chars(char_tok)
  bound = tasks.longest_feedback_chars(task, hi, chars, style=style)
  longest = 0
  for i in range(40):
    ex = tasks.make_example(task, i, difficulty=lo, max_difficulty=hi)
    for resp in _worst_responses(char_tok, r, rng):
      fb = procedural.ProceduralVerifier(feedback_style=style)(ex, resp).feedback
      longest = max(longest, len(fb))
  assert longest <= bound
  assert len(tasks.check({"task": task, **tasks.make_example(task, 0, difficulty=hi)},
                         "", style).errors[0]) <= bound


@pytest.mark.parametrize("variant", ["tiny", "tiny_hard"])
def test_the_longest_fap_of_the_tiny_tasks_fits_uncut(char_tok, variant):
  c = load(f"configs/fbos.py:{variant}")
  need = fap_budget.longest_fap_tokens(c, C.build_parts(c), char_tok)
  budget = c.templates.max_prompt_tokens
  assert need["fap"] <= budget <= max(c.sampling.fap_prompt_buckets)
  assert need["aggregated"] <= budget and need["fcp"] <= budget
  # the worst FAP, built: the longest problem, R tokens of the longest token
  # (</EF>), and the verifier's real feedback on that response
  hi = c.data.max_difficulty
  ex = {"task": "sort", "prompt": f"sort {'9' * hi}=", "answer": "9" * hi, "items": "9" * hi}
  longest = max(range(len(char_tok)),
                key=lambda i: len(char_tok.decode([i], skip_special_tokens=True)))
  resp = char_tok.decode([longest] * c.sampling.max_new_tokens, skip_special_tokens=True)
  fb = procedural.CompactProceduralVerifier()(ex, resp).feedback
  p = templates.PromptBuilder(char_tok, c.templates).fap(ex["prompt"], resp, fb)
  assert not p.truncated and len(p.token_ids) <= budget
  # the bound is tight enough to mean something: that built FAP reaches 80% of it
  # (524 of 650 tokens on tiny). It cannot reach all of it: "</EF>" in the response
  # re-encodes as one token, not five, and not-in-input entries and order breaks
  # cannot both sit at every position
  assert len(p.token_ids) >= 0.75 * need["fap"]
  # the old tiny budget cut this FAP
  old = c.templates.copy_and_resolve_references()
  old.max_prompt_tokens = 128
  assert templates.PromptBuilder(char_tok, old).fap(ex["prompt"], resp, fb).truncated


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_nothing_is_cut_on_real_steps_with_the_tiny_budget(tmp_path, small, one_device_mesh):
  """A random model's FAPs (garbage answers: the longest feedback there is) on
  the tiny task and budget: fap/truncated_frac is 0 on every step; the same
  steps with the old 64-token budget do cut (so the metric can see it)."""
  d = load("configs/fbos.py:tiny")
  for budget, cut in ((None, False), (64, True)):
    over = {"train.checkpoint_every": 0}
    if budget:
      over.update({"templates.max_prompt_tokens": budget, "sampling.fap_prompt_buckets": (64,)})
    c = small("configs/fbos.py:tiny", **over)
    c.data = d.data
    c.sampling.max_new_tokens = d.sampling.max_new_tokens
    if not budget:
      assert c.templates.max_prompt_tokens == d.templates.max_prompt_tokens
    wd = tmp_path / f"b{budget}"
    tr = RLTrainer(c, str(wd), mesh=one_device_mesh)
    tr.train()
    tr.close()
    rows = metrics_lib.read_jsonl(os.path.join(wd, "metrics.jsonl"))
    assert len(rows) == 2
    fracs = [r["fap/truncated_frac"] for r in rows]
    assert all(r["round2/rollouts"] > 0 for r in rows)
    assert (max(fracs) > 0) if cut else (fracs == [0.0, 0.0]), fracs


def test_too_small_budget_warns_or_raises(tmp_path, caplog, char_tok, small, one_device_mesh):
  c = load("configs/fbos.py:tiny")
  c.templates.max_prompt_tokens = 100
  parts = C.build_parts(c)
  need = fap_budget.longest_fap_tokens(c, parts, char_tok)["fap"]
  with caplog.at_level(logging.WARNING):
    fap_budget.check_fap_budget(c, parts, char_tok)
  text = caplog.text
  assert "templates.max_prompt_tokens=100" in text and f"{need} tokens" in text, text
  c.templates.truncation = "error"
  with pytest.raises(ValueError, match=rf"templates.max_prompt_tokens=100 .*{need} tokens"):
    fap_budget.check_fap_budget(c, parts, char_tok)
  # the budget that holds it: silent
  caplog.clear()
  c.templates.max_prompt_tokens = need
  with caplog.at_level(logging.WARNING):
    fap_budget.check_fap_budget(c, parts, char_tok)
  assert "max_prompt_tokens" not in caplog.text
  # trainer init runs the check (the rollout context): error before any step
  s = small("configs/fbos.py:tiny", **{"templates.max_prompt_tokens": 100,
                                       "templates.truncation": "error"})
  s.data = load("configs/fbos.py:tiny").data
  with pytest.raises(ValueError, match="templates.max_prompt_tokens=100"):
    RLTrainer(s, str(tmp_path), mesh=one_device_mesh)
  # a task without a known feedback bound is not checked
  s.data.verifier = PARITY
  assert fap_budget.check_fap_budget(s, C.build_parts(s), char_tok) is None


def test_compact_sort_feedback_names_the_same_errors():
  ex = {"task": "sort", "prompt": "sort 744385=", "answer": "344578", "items": "744385"}
  cases = {"33445445578": "extra: 2(3) 6(4) 7(4) 8(5) 9(5); order breaks at 6",
           "9521": "not in input: 1(9) 3(2) 4(1); missing 5; order breaks at 2 3 4",
           "34457": "missing 1", "": "the response is empty"}
  for resp, want in cases.items():
    compact = procedural.CompactProceduralVerifier()(ex, resp)
    prose = procedural.ProceduralVerifier()(ex, resp)
    assert compact.feedback == want
    assert compact.reward == prose.reward == 0.0
    assert len(compact.feedback) <= len(prose.feedback)
  assert procedural.CompactProceduralVerifier()(ex, "344578").reward == 1.0
  assert procedural.feedback_style_of(procedural.COMPACT_PATH) == "compact"
  assert procedural.feedback_style_of("auto") == "prose"
  assert procedural.feedback_style_of("math") is None
