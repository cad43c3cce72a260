"""The longest feedback prompt a task can produce, and the check of the budget against it.

A FAP holds the problem, a whole response and the verifier's feedback on it. For
the procedural tasks all three have known bounds, so the budget
``templates.max_prompt_tokens`` can be checked once at start: too small a
budget would cut responses or feedback in the middle of the prompts.
"""

from __future__ import annotations

from typing import Optional

from absl import logging

from fbos_jax import templates
from fbos_jax.rl import batch_kinds




def longest_token_chars(tokenizer) -> int:
  """The most characters one token decodes to (special tokens skipped, as
  :meth:`fbos_jax.rl.context.RolloutContext.decode` does): a response of R tokens has at most R times
  this many characters (the character tokenizer: 5, ``</EF>``)."""
  ids = [[i] for i in range(len(tokenizer))]
  return max((len(t) for t in tokenizer.batch_decode(ids, skip_special_tokens=True)), default=1)


def longest_fap_tokens(config, parts, tokenizer, *, chars_per_token: Optional[int] = None
                       ) -> Optional[dict]:
  """The longest prompt of each kind (``templates.FEEDBACK_PROMPT_KINDS``: fap,
  aggregated with one attempt, fcp) the config's task can produce, in tokens,
  or None when the task is not procedural (its feedback has no known bound).

  It is the template's own tokens plus one per character of (see
  ``templates.PromptBuilder.longest_tokens``):

  * the longest problem: ``tasks.longest_prompt_chars(data.task, max difficulty)``;
  * the longest response: ``sampling.max_new_tokens`` (``parts``' round-1 sampler) tokens of at most
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
  response_chars = int(parts.sampling.round1.max_new_tokens) * per_token
  feedback_chars = tasks_lib.longest_feedback_chars(
      dc.task, hi, response_chars, style=style,
      reveals_answer=bool(dc.get("feedback_reveals_answer", False)))
  builder = templates.PromptBuilder(tokenizer, config.templates)
  out = {kind: builder.longest_tokens(kind, prompt_chars=prompt_chars,
                                      response_chars=response_chars,
                                      feedback_chars=feedback_chars)
         for kind in templates.FEEDBACK_PROMPT_KINDS}
  out.update(prompt_chars=prompt_chars, response_chars=response_chars,
             feedback_chars=feedback_chars)
  return out


def built_prompt_kinds(config, parts) -> tuple:
  """The feedback prompt kinds a run of ``config`` builds (RL round 2, the SFT
  warm start's corrections, FCP contexts)."""
  rl, kinds = parts.rollout, []
  if rl.round2:
    kinds.append("aggregated" if rl.fap_mode == "aggregated" else "fap")
  sft = config.get("sft")
  if (config.train.warm_start == "sft" and sft is not None and not sft.conditional
      and float(sft.fap_fraction) > 0 and "fap" not in kinds):
    kinds.append("fap")
  # a term's batch whose builder renders a template of its own (FCP's <EF>c</EF>q)
  kinds += [batch_kinds.kind(name).template for name in rl.batch_names
            if batch_kinds.kind(name).template]
  if rl.conditional or (sft is not None and config.train.warm_start == "sft" and sft.conditional):
    kinds.append(templates.FCP_KIND)  # round 1 under <EF>c+</EF>q, or the SFT stage on it
  return tuple(dict.fromkeys(kinds))


def check_fap_budget(config, parts, tokenizer) -> Optional[dict]:
  """Compare ``templates.max_prompt_tokens`` with the longest feedback prompt the
  task can produce (:func:`longest_fap_tokens`), for the kinds the run builds.

  Too small a budget cuts responses or feedback in the middle of the prompts
  (the feedback then cites positions of a response the model cannot see): a
  warning names the field and the length needed; with
  ``templates.truncation=error`` it is a ValueError instead. Called once when
  the rollout context is built (:meth:`fbos_jax.rl.context.RolloutContext.build`).
  Returns the bound (None: not a procedural task)."""
  kinds = built_prompt_kinds(config, parts)
  if not kinds:
    return None
  need = longest_fap_tokens(config, parts, tokenizer)
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
           f"{parts.sampling.round1.max_new_tokens}). Longer prompts are cut "
           f"(templates.truncation={config.templates.truncation!r}); set "
           f"--config.templates.max_prompt_tokens={longest} and a "
           f"sampling.fap_prompt_buckets entry >= {longest}.")
    if config.templates.truncation == "error":
      raise ValueError(msg)
    logging.warning("%s", msg)
  return need
