"""The trainer's view of the outside world: tokenizer, data, prompt templates,
the verifier pool and the sampler, behind one small object. The host-side text
work of a step (render prompts, decode, verify, build FAPs) lives here."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np
from absl import logging

from fbos_jax import data as data_lib
from fbos_jax import templates
from fbos_jax import tokenizer as tok_lib
from fbos_jax.verifiers.base import VerifierPool, make_verifier


class Environment:
  """Host-side helpers bound to one config (see ``from_config``)."""

  def __init__(self, config, tokenizer, verifier, *, train_iter=None, eval_examples=None):
    self.config = config
    self.tokenizer = tokenizer
    self.verifier = verifier
    vc = config.verifier
    self.pool = VerifierPool(verifier, num_workers=vc.workers, timeout_s=vc.timeout_s,
                             backend=vc.backend, reward_range=tuple(vc.reward_range),
                             max_abandoned_threads=vc.max_abandoned_threads)
    self.train_iter = train_iter
    self._eval_examples = eval_examples
    self.prompts = templates.PromptBuilder(tokenizer, config.templates)
    self.pad_id = int(tokenizer.pad_token_id)
    self.eos_id = int(tokenizer.eos_token_id)
    self.vocab_size = len(tokenizer)
    stops = list(config.sampling.get("stop_token_ids", ()) or ())
    self.stop_ids = tuple(dict.fromkeys([self.eos_id] + [int(s) for s in stops]))

  @classmethod
  def from_config(cls, config, workdir: str, *, process_index: Optional[int] = None,
                  process_count: Optional[int] = None) -> "Environment":
    import jax
    tok_path = tok_lib.resolve_tokenizer_path(config, workdir)  # tiny: the char tokenizer
    tokenizer = tok_lib.load_tokenizer(tok_path)
    tok_lib.check_tokenizer_compat(tokenizer, vocab_size=config.model.vocab_size,
                                   template_style=config.templates.style, tokenizer_path=tok_path)
    verifier = make_verifier(config.data)
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    local_batch = config.rl.prompts_per_step // pc
    train_iter = data_lib.make_prompt_iterator(config.data, batch_size=local_batch,
                                               process_index=pi, process_count=pc,
                                               seed=config.data.shuffle_seed + config.seed,
                                               tokenizer=tokenizer)
    eval_examples = held_out_examples(config, process_index=pi, process_count=pc)
    return cls(config, tokenizer, verifier, train_iter=train_iter, eval_examples=eval_examples)

  # ----------------------------------------------------------------- data
  def next_train_batch(self) -> list:
    return next(self.train_iter)

  def eval_examples(self) -> list:
    return list(self._eval_examples or [])

  def data_state(self):
    return self.train_iter.get_state() if hasattr(self.train_iter, "get_state") else {}

  def set_data_state(self, state):
    if state and hasattr(self.train_iter, "set_state"):
      self.train_iter.set_state(state)

  # ----------------------------------------------------------------- text
  def prompt_ids(self, example) -> list[int]:
    return self.prompts.plain(example["prompt"]).token_ids

  def fap(self, example, response: str, feedback: str) -> templates.Prompt:
    """FAP(q, o, F) of one rollout, with its ``truncated`` flag (the response or
    the feedback was cut to fit ``templates.max_prompt_tokens``)."""
    return self.prompts.fap(example["prompt"], response, feedback)

  def fap_ids(self, example, response: str, feedback: str) -> list[int]:
    """FAP(q, o, F): the feedback-augmented prompt of one rollout."""
    return self.fap(example, response, feedback).token_ids

  def aggregated(self, example, responses: Sequence[str], feedbacks: Sequence[str],
                 rewards) -> templates.Prompt:
    """GOLF's aggregated refinement prompt over q's failed attempts (``truncated``:
    no attempt fitted whole, so the shortest one was cut)."""
    thr = self.config.verifier.success_threshold
    attempts = [templates.Attempt(r, f, float(s))
                for r, f, s in zip(responses, feedbacks, rewards) if s < thr]
    return self.prompts.aggregated(example["prompt"], attempts)

  def aggregated_ids(self, example, responses: Sequence[str], feedbacks: Sequence[str],
                     rewards) -> list[int]:
    """GOLF's aggregated refinement prompt over q's failed attempts."""
    return self.aggregated(example, responses, feedbacks, rewards).token_ids

  def fcp_prompt(self, example, feedback: str) -> list[int]:
    """FCP's feedback-conditioned prompt <EF>c</EF>q."""
    return self.prompts.fcp(example["prompt"], feedback).token_ids

  def decode(self, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    out = []
    for row, n in zip(np.asarray(tokens), np.asarray(lengths)):
      ids = [int(t) for t in row[:int(n)] if int(t) not in self.stop_ids]
      out.append(self.tokenizer.decode(ids, skip_special_tokens=True))
    return out

  def verify(self, examples: Sequence, texts: Sequence[str]):
    """Verdicts of the pool (timeouts, fault isolation, reward range) as
    (rewards [N] float32, feedback [N] str, is_error [N] bool, pool stats).
    An error verdict's reward is a placeholder and its feedback is empty."""
    if not len(texts):
      return np.zeros(0, np.float32), [], np.zeros(0, bool), {}
    verdicts, stats = self.pool.run(list(examples), list(texts))
    rewards = np.asarray([v.reward for v in verdicts], np.float32)
    errors = np.asarray([v.is_error for v in verdicts], bool)
    return rewards, [v.feedback for v in verdicts], errors, stats

  # ----------------------------------------------------------------- sampling
  def sample(self, params, model_cfg, prompts, *, n, key, mesh, rules, temperature,
             prompt_buckets):
    from fbos_jax import sampling
    sc = self.config.sampling
    return sampling.sample(
        params, model_cfg, prompts, key=key, n_per_prompt=n, mesh=mesh, rules=rules,
        max_new_tokens=sc.max_new_tokens, temperature=temperature, top_k=sc.top_k,
        top_p=sc.top_p, stop_token_ids=self.stop_ids, pad_id=self.pad_id,
        prompt_buckets=prompt_buckets, batch_buckets=tuple(sc.get("batch_buckets", ())) or None,
        allow_empty=True)

  def close(self):
    close = getattr(self.pool, "close", None)
    if close:
      close()


def held_out_examples(config, *, process_index: int = 0, process_count: int = 1) -> list:
  """This host's share of the fixed held-out set (the eval split, unshuffled).

  A procedural held-out set holds ``train.eval_prompts`` *distinct* problems:
  drawing by index repeats the problems of a small part of the space (the 1-digit
  sums' eval split has 9 problems, which made up 116 of 256 draws), and one
  problem counted dozens of times swamps the accuracy. Every host builds the same
  list and takes an equal slice of it."""
  n = int(config.train.eval_prompts)
  if n <= 0:
    return []
  dc = data_lib.default_data_config()
  dc.update(config.data.to_dict())
  dc.split = "eval"
  dc.shuffle = False
  dc.num_epochs = 1
  dc.drop_remainder = False  # a held-out split smaller than the batch is still used
  if dc.source == "procedural":
    dc.num_examples = 8 * n
    unique: dict = {}
    for batch in data_lib.make_prompt_iterator(dc, batch_size=n, process_index=0,
                                               process_count=1):
      for ex in batch:
        unique.setdefault(ex["prompt"], ex)
      if len(unique) >= n:
        break
    examples = list(unique.values())[:n]
    if len(examples) < n:
      logging.warning("held-out set: %d distinct problems (train.eval_prompts=%d); the "
                      "task's eval split is smaller", len(examples), n)
    share = len(examples) // process_count
    return examples[process_index * share:(process_index + 1) * share]
  it = data_lib.make_prompt_iterator(dc, batch_size=max(n // process_count, 1),
                                     process_index=process_index, process_count=process_count)
  try:
    return list(next(it))
  except StopIteration:
    return []


# ----------------------------------------------------------------------------- FAP budget


def longest_token_chars(tokenizer) -> int:
  """The most characters one token decodes to (special tokens skipped, as
  :meth:`Environment.decode` does): a response of R tokens has at most R times
  this many characters (the character tokenizer: 5, ``</EF>``)."""
  ids = [[i] for i in range(len(tokenizer))]
  return max((len(t) for t in tokenizer.batch_decode(ids, skip_special_tokens=True)), default=1)


def longest_fap_tokens(config, tokenizer, *, chars_per_token: Optional[int] = None
                       ) -> Optional[dict]:
  """The longest prompt of each kind ("fap", "aggregated" with one attempt,
  "fcp") the config's task can produce, in tokens, or None when the task is not
  procedural (its feedback has no known bound).

  It is the template's own tokens plus one per character of (see
  ``templates.PromptBuilder.longest_tokens``):

  * the longest problem: ``tasks.longest_prompt_chars(data.task, max difficulty)``;
  * the longest response: ``sampling.max_new_tokens`` tokens of at most
    :func:`longest_token_chars` characters each;
  * the longest feedback the procedural verifier can write about such a
    response: ``tasks.longest_feedback_chars`` in the wording of ``data.verifier``
    (``fbos_jax.verifiers.procedural.feedback_style_of``), with the answer when
    ``data.feedback_reveals_answer``.

  The dict also holds those three lengths ("prompt_chars", "response_chars",
  "feedback_chars") for messages and comments. ``chars_per_token`` replaces
  :func:`longest_token_chars` (1: the longest FAP of responses made of
  one-character tokens, the common case, which the SFT warm start pads to).
  """
  from fbos_jax import tasks as tasks_lib
  from fbos_jax.verifiers import procedural
  dc = config.data
  style = procedural.feedback_style_of(str(dc.verifier))
  if dc.source != "procedural" or style is None:
    return None
  hi = max(int(dc.difficulty), int(dc.get("max_difficulty", 0) or 0))
  prompt_chars = tasks_lib.longest_prompt_chars(dc.task, hi)
  per_token = longest_token_chars(tokenizer) if chars_per_token is None else int(chars_per_token)
  response_chars = int(config.sampling.max_new_tokens) * per_token
  feedback_chars = tasks_lib.longest_feedback_chars(
      dc.task, hi, response_chars, style=style,
      reveals_answer=bool(dc.get("feedback_reveals_answer", False)))
  builder = templates.PromptBuilder(tokenizer, config.templates)
  out = {kind: builder.longest_tokens(kind, prompt_chars=prompt_chars,
                                      response_chars=response_chars,
                                      feedback_chars=feedback_chars)
         for kind in ("fap", "aggregated", "fcp")}
  out.update(prompt_chars=prompt_chars, response_chars=response_chars,
             feedback_chars=feedback_chars)
  return out


def built_prompt_kinds(config) -> tuple:
  """The feedback prompt kinds a run of ``config`` builds (RL round 2, the SFT
  warm start's corrections, FCP contexts)."""
  rl, kinds = config.rl, []
  if rl.round2:
    kinds.append("aggregated" if rl.fap_mode == "aggregated" else "fap")
  sft = config.get("sft")
  if (config.train.warm_start == "sft" and sft is not None and not sft.conditional
      and float(sft.fap_fraction) > 0 and "fap" not in kinds):
    kinds.append("fap")
  fcp_term = rl.terms.get("fcp")
  if (rl.prompt == "fcp" or (fcp_term is not None and float(fcp_term.weight) > 0)
      or (sft is not None and config.train.warm_start == "sft" and sft.conditional)):
    kinds.append("fcp")
  return tuple(kinds)


def check_fap_budget(config, tokenizer) -> Optional[dict]:
  """Compare ``templates.max_prompt_tokens`` with the longest feedback prompt the
  task can produce (:func:`longest_fap_tokens`), for the kinds the run builds.

  Too small a budget cuts responses or feedback in the middle of the prompts
  (the feedback then cites positions of a response the model cannot see): a
  warning names the field and the length needed; with
  ``templates.truncation=error`` it is a ValueError instead. Called once when
  the rollout context is built (``fbos_jax.rl.rollout.RolloutContext``), i.e.
  at trainer init. Returns the bound (None: not a procedural task)."""
  kinds = built_prompt_kinds(config)
  if not kinds:
    return None
  need = longest_fap_tokens(config, tokenizer)
  if need is None:
    return None
  budget = int(config.templates.max_prompt_tokens)
  short = {k: need[k] for k in kinds if need[k] > budget}
  if short:
    kind, longest = max(short.items(), key=lambda kv: kv[1])
    msg = (f"templates.max_prompt_tokens={budget} is smaller than the longest {kind} prompt "
           f"this task can produce: {longest} tokens (problem <= {need['prompt_chars']}, "
           f"response <= {need['response_chars']}, feedback <= {need['feedback_chars']} "
           f"characters; data.task={config.data.task!r}, sampling.max_new_tokens="
           f"{config.sampling.max_new_tokens}). Longer prompts are cut "
           f"(templates.truncation={config.templates.truncation!r}); set "
           f"--config.templates.max_prompt_tokens={longest} and a "
           f"sampling.fap_prompt_buckets entry >= {longest}.")
    if config.templates.truncation == "error":
      raise ValueError(msg)
    logging.warning("%s", msg)
  return need
