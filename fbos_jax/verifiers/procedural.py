"""The verifier for the procedural task families in ``fbos_jax.tasks``.

Reward is 1.0 for an exactly correct response, else ``partial_credit *
score`` where ``score`` in [0, 1] is the family's partial-credit fraction
(``partial_credit`` defaults to 0, i.e. binary rewards). Feedback is the
family's located error lines joined by ``"; "``, e.g. ``"the answer has 3
digits, expected 2; digit 2 from the right is wrong"``. With
``feedback_reveals_answer=True`` it ends with ``"; the correct answer is X"``.

``feedback_style`` picks the wording (``fbos_jax.tasks.FEEDBACK_STYLES``):
``"prose"`` (default) or ``"compact"`` (one short line per kind of error; it
differs for ``sort`` only). The compact wording has its own import path, so a
config selects it with ``data.verifier`` alone::

  --config.data.verifier=fbos_jax.verifiers.procedural:CompactProceduralVerifier
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from fbos_jax import tasks
from fbos_jax.verifiers.base import CORRECT_FEEDBACK
from fbos_jax.verifiers.base import register_verifier
from fbos_jax.verifiers.base import Verdict

SEPARATOR = "; "  # joins feedback lines (short, stays on one line)


@register_verifier("procedural")
class ProceduralVerifier:
  """Checks responses to ``tasks.make_example`` problems of any family.

  Args:
    feedback_reveals_answer: append the reference answer to the feedback of
      wrong responses (off by default; see ALGORITHMS.md section 6).
    partial_credit: weight of the family's partial score for wrong responses
      (0 = binary reward).
    feedback_style: "prose" | "compact" (default: the class's ``feedback_style``).
  """

  required_fields = ("task", "answer")  # the data loader refuses records without them

  feedback_style = "prose"

  def __init__(self, feedback_reveals_answer: bool = False,
               partial_credit: float = 0.0, feedback_style: str | None = None):
    if not 0.0 <= partial_credit < 1.0:
      raise ValueError("partial_credit must be in [0, 1)")
    if feedback_style is not None:
      if feedback_style not in tasks.FEEDBACK_STYLES:
        raise ValueError(f"feedback_style={feedback_style!r}; expected one of "
                         f"{tasks.FEEDBACK_STYLES}")
      self.feedback_style = feedback_style
    self.feedback_reveals_answer = feedback_reveals_answer
    self.partial_credit = partial_credit

  def __call__(self, example: Mapping[str, Any], response: str) -> Verdict:
    result = tasks.check(example, response, self.feedback_style)
    info = {"task": example["task"], "score": result.score, **result.info}
    if result.correct:
      return Verdict(1.0, CORRECT_FEEDBACK, info)
    lines = list(result.errors)
    if self.feedback_reveals_answer:
      lines.append(f"the correct answer is {tasks.solve(example)}")
    return Verdict(self.partial_credit * result.score, SEPARATOR.join(lines),
                   info)


@register_verifier("procedural_compact")
class CompactProceduralVerifier(ProceduralVerifier):
  """The procedural verifier with the compact feedback wording (the tiny
  configs set ``data.verifier`` to :data:`COMPACT_PATH`)."""

  feedback_style = "compact"


# an import path works in every process (a registered name needs this module imported)
COMPACT_PATH = "fbos_jax.verifiers.procedural:CompactProceduralVerifier"


def feedback_style_of(verifier_name: str) -> str | None:
  """The feedback wording a ``data.verifier`` value gives procedural examples
  ("prose" for "auto" and "procedural"), or None for any other verifier."""
  if verifier_name in ("auto", "procedural"):
    return "prose"
  if verifier_name in (COMPACT_PATH, "procedural_compact"):
    return "compact"
  return None


class FeedbackRevealsAnswerError(ValueError):
  """A task's feedback contains its final answer while the config forbids it."""


def check_answer_hidden(verifier, examples, *, responses_per_example: int = 32,
                        seed: int = 0) -> int:
  """Run ``verifier`` on wrong responses to ``examples`` (adversarial ones
  included: ``tasks.wrong_responses``) and raise :class:`FeedbackRevealsAnswerError`
  at the first feedback that contains the example's final answer
  (``tasks.feedback_reveals_answer``), naming the record, the response and the
  feedback. Returns the number of (example, response) pairs checked."""
  import random
  from fbos_jax import data as data_lib
  rng = random.Random(seed)
  checked = 0
  for ex in examples:
    for response in tasks.wrong_responses(ex, rng, responses_per_example):
      verdict = verifier(ex, response)
      feedback = getattr(verdict, "feedback", None)
      if feedback is None and isinstance(verdict, tuple):
        feedback = verdict[1]
      checked += 1
      if tasks.feedback_reveals_answer(str(feedback), ex):
        raise FeedbackRevealsAnswerError(
            f"data.require_hidden_answer=True, but the feedback of task "
            f"{ex.get('task')!r} contains the final answer "
            f"{tasks.final_answer(ex)!r}. Example record {data_lib.locate(ex)}: prompt "
            f"{ex['prompt']!r}, answer {ex['answer']!r}; response {response!r} got feedback "
            f"{feedback!r}. Turn data.feedback_reveals_answer off, use a task whose feedback "
            "hides the answer (e.g. data.task=chain), or set "
            "--config.data.require_hidden_answer=False to allow it.")
  return checked


def check_config_answer_hidden(config, verifier, *, num_examples: int = 64,
                               responses_per_example: int = 32) -> Optional[int]:
  """At start: with ``data.require_hidden_answer=True``, check the feedback of
  the config's procedural task (``num_examples`` training problems from
  ``data.difficulty`` to ``data.max_difficulty``, ``responses_per_example`` wrong
  responses each) with :func:`check_answer_hidden`. Returns the pairs checked,
  or None when the flag allows revealing (or the source is not procedural:
  a warning, its records have no generator of wrong responses)."""
  dc = config.data
  if not dc.get("require_hidden_answer", False):
    return None
  if dc.source != "procedural":
    from absl import logging
    logging.warning("data.require_hidden_answer=True is checked on procedural tasks "
                    "only; data.source=%r is not checked", dc.source)
    return None
  src = tasks.ProceduralSource(dc.task, seed=dc.generation_seed, difficulty=dc.difficulty,
                               max_difficulty=dc.max_difficulty or None, split="train")
  name = "procedural" if dc.verifier == "auto" else dc.verifier  # as fbos_jax/data.py sets it
  examples = [dict(src[i], verifier=name) for i in range(num_examples)]
  return check_answer_hidden(verifier, examples, responses_per_example=responses_per_example)
