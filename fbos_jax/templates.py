"""Prompt templates: the plain prompt q, FBOS's FAP(q, o, F), GOLF's aggregated
refinement prompt, and FCP's ``<EF>c</EF>q``.

Every template is a Python format string held in the config (see
``default_template_config``), so a config can override any of them. Styles:

* ``"compact"`` (default, for the tiny CPU model with a character tokenizer):
  FAP = ``"{prompt}{response}|{feedback}|"``, e.g.
  ``"12+45=56|digit 1 from the right is wrong|"``; the model then writes the
  corrected answer, exactly as it writes an answer after ``"12+45="``.
* ``"verbose"`` (paper style, for real LLMs): the problem, the previous
  attempt, the feedback and instructions, in prose.

Rendering goes through ``render_prompt``: when the tokenizer has a chat
template, the text becomes one user message and ``apply_chat_template(...,
add_generation_prompt=True)`` is used; otherwise the text is encoded as is
(``add_special_tokens=False``).

**Prompt-token budget policy** (``max_prompt_tokens``; the problem is never
cut):

1. If the rendered prompt fits, it is used unchanged.
2. Otherwise the previous response ``o`` is shortened according to
   ``truncation``: ``"middle"`` (default) keeps its head and tail around an
   ``ellipsis`` (the tail usually holds the final answer the feedback talks
   about), ``"left"`` keeps its tail, ``"right"`` keeps its head, and
   ``"error"`` raises ``PromptTooLongError`` instead of cutting anything.
3. If the prompt still does not fit with the response fully cut, the
   feedback is shortened from its end (its first lines are kept).
4. If the problem and the fixed template text alone exceed the budget,
   ``PromptTooLongError`` is raised.

:meth:`PromptBuilder.longest_tokens` bounds a prompt kind's length from the
longest pieces a task can produce, so a budget can be sized to cut nothing
(``fbos_jax.rl.fap_budget.longest_fap_tokens``).

The aggregated (GOLF) prompt adds failed attempts **shortest response first**,
greedily: an attempt whose block does not fit is skipped and the next one is
tried. If no attempt fits whole, the shortest one is included, cut by the
policy above. FCP cuts only the feedback.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import ml_collections

FCP_TEMPLATE = "<EF>{feedback}</EF>{prompt}"

FAP_TEMPLATES = {
    "compact": "{prompt}{response}|{feedback}|",
    "verbose": (
        "{prompt}\n\n"
        "Here is a previous attempt at this problem:\n"
        "{response}\n\n"
        "Feedback on that attempt:\n"
        "{feedback}\n\n"
        "Using the feedback, write a new complete response to the problem. "
        "Do not mention the previous attempt.\n"
    ),
}

# Aggregated refinement prompt = header + one block per attempt + footer.
AGGREGATED_TEMPLATES = {
    "compact": {
        "header": "{prompt}",
        "attempt": "{response}|{feedback}|",
        "footer": "",
    },
    "verbose": {
        "header": (
            "Problem:\n{prompt}\n\n"
            "Below are earlier attempts at this problem, each with feedback.\n"
        ),
        "attempt": (
            "\nAttempt {index} (score {score}):\n{response}\n"
            "Feedback: {feedback}\n"
        ),
        "footer": (
            "\nWrite a new solution to the problem. Keep the steps that were "
            "correct, fix the ones that were wrong, and do not mention the "
            "attempts.\n"
        ),
    },
}


class PromptTooLongError(ValueError):
  """The problem plus the fixed template text exceed the prompt budget."""


class Attempt(NamedTuple):
  """One round-1 attempt for the aggregated prompt."""

  response: str
  feedback: str
  score: float


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A rendered prompt.

  Attributes:
    text: the prompt text before any chat template (for logs).
    token_ids: [T] token ids fed to the model, T <= max_prompt_tokens.
    truncated: whether a response or feedback was cut to fit.
    num_attempts: aggregated prompts only: attempts included.
  """

  text: str
  token_ids: list[int]
  truncated: bool = False
  num_attempts: int = 0


def default_template_config() -> ml_collections.ConfigDict:
  """The template section of a config (``config.templates``)."""
  return ml_collections.ConfigDict({
      # "compact" | "verbose": picks the defaults below; non-empty custom
      # strings override the style's template.
      "style": "compact",
      "fap": "",  # fields: {prompt} {response} {feedback}
      "aggregated_header": "",  # fields: {prompt}
      "aggregated_attempt": "",  # fields: {index} {score} {response} {feedback}
      "aggregated_footer": "",  # fields: {prompt}
      "aggregated_dedupe": True,  # drop attempts whose response repeats one
      "fcp": FCP_TEMPLATE,  # fields: {feedback} {prompt}
      "max_prompt_tokens": 256,  # budget for every built prompt
      "truncation": "middle",  # "middle" | "left" | "right" | "error"
      "ellipsis": "...",  # marks where a response/feedback was cut
      "add_bos": False,  # prepend tokenizer.bos_token_id (plain-text path)
      "system_prompt": "",  # chat-template path only; "" = no system turn
      # Extra kwargs for apply_chat_template, e.g. {"enable_thinking": False}.
      "chat_template_kwargs": ml_collections.ConfigDict(),
  })


def render_text(tokenizer, text: str, *, system_prompt: str = "",
                chat_template_kwargs: dict | None = None) -> str:
  """The exact string that gets tokenized for prompt ``text``."""
  if getattr(tokenizer, "chat_template", None):
    messages = ([{"role": "system", "content": system_prompt}]
                if system_prompt else [])
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True,
        **(chat_template_kwargs or {}))
  return text


def render_prompt(tokenizer, text: str, *, system_prompt: str = "",
                  chat_template_kwargs: dict | None = None,
                  add_bos: bool = False) -> list[int]:
  """Token ids of prompt ``text`` (chat template if the tokenizer has one).

  Returns:
    [T] token ids, without special tokens other than those the chat template
    writes itself (and BOS if ``add_bos`` on the plain-text path).
  """
  chat = bool(getattr(tokenizer, "chat_template", None))
  s = render_text(tokenizer, text, system_prompt=system_prompt,
                  chat_template_kwargs=chat_template_kwargs)
  ids = list(tokenizer.encode(s, add_special_tokens=False))
  if add_bos and not chat and tokenizer.bos_token_id is not None:
    ids = [tokenizer.bos_token_id] + ids
  return ids


def _format_score(score: float) -> str:
  return f"{float(score):g}"


class PromptBuilder:
  """Builds every prompt kind for one tokenizer and template config.

  Args:
    tokenizer: a Hugging Face tokenizer.
    config: ``default_template_config()`` or an override of it.
  """

  def __init__(self, tokenizer, config: ml_collections.ConfigDict | None = None):
    cfg = config if config is not None else default_template_config()
    if cfg.style not in FAP_TEMPLATES:
      raise ValueError(f"unknown template style {cfg.style!r}; known: "
                       f"{sorted(FAP_TEMPLATES)}")
    if cfg.truncation not in ("middle", "left", "right", "error"):
      raise ValueError(f"unknown truncation policy {cfg.truncation!r}")
    agg = AGGREGATED_TEMPLATES[cfg.style]
    self.tokenizer = tokenizer
    self.fap_template = cfg.fap or FAP_TEMPLATES[cfg.style]
    self.agg_header = cfg.aggregated_header or agg["header"]
    self.agg_attempt = cfg.aggregated_attempt or agg["attempt"]
    self.agg_footer = cfg.aggregated_footer or agg["footer"]
    self.agg_dedupe = bool(cfg.aggregated_dedupe)
    self.fcp_template = cfg.fcp
    self.max_prompt_tokens = int(cfg.max_prompt_tokens)
    self.truncation = cfg.truncation
    self.ellipsis = cfg.ellipsis
    self._render_kwargs = dict(
        system_prompt=cfg.system_prompt,
        chat_template_kwargs=dict(cfg.chat_template_kwargs or {}),
        add_bos=bool(cfg.add_bos))

  # -- helpers -------------------------------------------------------------

  def encode(self, text: str) -> list[int]:
    """``render_prompt`` with this builder's chat settings."""
    return render_prompt(self.tokenizer, text, **self._render_kwargs)

  def _cut(self, ids: list[int], keep: int, side: str) -> str:
    """Text of ``keep`` of the tokens ``ids``, cut on ``side``."""
    if keep >= len(ids):
      return self.tokenizer.decode(ids)
    dec = lambda x: self.tokenizer.decode(x) if x else ""
    if side == "middle":
      head = keep - keep // 2
      tail = keep - head
      return dec(ids[:head]) + self.ellipsis + dec(ids[len(ids) - tail:] if tail else [])
    if side == "left":  # drop the start, keep the tail
      return self.ellipsis + dec(ids[len(ids) - keep:] if keep else [])
    return dec(ids[:keep]) + self.ellipsis  # "right": keep the head

  def _largest_fit(self, render: Callable[[str], str], piece: str,
                   side: str) -> tuple[str, list[int]] | None:
    """Cuts ``piece`` to the most tokens with which ``render(piece)`` fits.

    Binary search over the kept token count; returns (text, ids) or None if
    even the fully cut piece does not fit.
    """
    ids = list(self.tokenizer.encode(piece, add_special_tokens=False))
    best = None
    lo, hi = 0, len(ids)
    while lo <= hi:
      mid = (lo + hi) // 2
      text = render(self._cut(ids, mid, side))
      tok = self.encode(text)
      if len(tok) <= self.max_prompt_tokens:
        best, lo = (text, tok), mid + 1
      else:
        hi = mid - 1
    return best

  def _fit(self, render: Callable[[str, str], str], response: str,
           feedback: str) -> tuple[str, list[int], bool]:
    """Applies the budget policy (module doc) to ``render(response, feedback)``."""
    text = render(response, feedback)
    ids = self.encode(text)
    if len(ids) <= self.max_prompt_tokens:
      return text, ids, False
    if self.truncation == "error":
      raise PromptTooLongError(
          f"prompt has {len(ids)} tokens > max_prompt_tokens="
          f"{self.max_prompt_tokens} and truncation='error'")
    fit = self._largest_fit(lambda r: render(r, feedback), response,
                            self.truncation) if response else None
    if fit is not None:
      return fit[0], fit[1], True
    no_response = self.ellipsis if response else ""  # response fully cut
    if feedback:
      fit = self._largest_fit(lambda f: render(no_response, f), feedback,
                              "right")
      if fit is not None:
        return fit[0], fit[1], True
    raise PromptTooLongError(
        f"the problem and template alone exceed max_prompt_tokens="
        f"{self.max_prompt_tokens}: "
        f"{len(self.encode(render(no_response, '')))} tokens")

  # -- budget bound --------------------------------------------------------

  SCORE_CHARS = len("-0.333333")  # the widest "{score}" of an aggregated attempt

  def longest_tokens(self, kind: str, *, prompt_chars: int, response_chars: int,
                     feedback_chars: int) -> int:
    """The most tokens a prompt of ``kind`` ("fap", "aggregated" with one
    attempt, "fcp") can have when its problem, response and feedback have at
    most these many characters: the template's own tokens (rendered with empty
    fields, chat template and BOS included) plus one token per character.

    Exact for the character tokenizer (one token per character; an added token
    such as ``<EF>`` spans several). For a BPE tokenizer on ASCII text each token
    covers at least one character, so this is an upper bound up to the merges
    at the joins between the template text and the fields.
    """
    if kind == "fap":
      fixed = self.fap_template.format(prompt="", response="", feedback="")
      chars = prompt_chars + response_chars + feedback_chars
    elif kind == "aggregated":
      fixed = (self.agg_header.format(prompt="")
               + self.agg_attempt.format(index=1, score="", response="", feedback="")
               + self.agg_footer.format(prompt=""))
      chars = prompt_chars + response_chars + feedback_chars
      if "{score}" in self.agg_attempt:
        chars += self.SCORE_CHARS
      if "{prompt}" in self.agg_footer:
        chars += prompt_chars
    elif kind == "fcp":
      fixed = self.fcp_template.format(prompt="", feedback="")
      chars = prompt_chars + feedback_chars
    else:
      raise ValueError(f"prompt kind {kind!r}; expected fap | aggregated | fcp")
    return len(self.encode(fixed)) + chars

  # -- prompt kinds --------------------------------------------------------

  def plain(self, prompt: str) -> Prompt:
    """Round-1 prompt q. Raises PromptTooLongError if over budget."""
    ids = self.encode(prompt)
    if len(ids) > self.max_prompt_tokens:
      raise PromptTooLongError(
          f"prompt has {len(ids)} tokens > max_prompt_tokens="
          f"{self.max_prompt_tokens}")
    return Prompt(prompt, ids)

  def fap(self, prompt: str, response: str, feedback: str) -> Prompt:
    """FBOS feedback-augmented prompt FAP(q, o, F)."""
    render = lambda r, f: self.fap_template.format(
        prompt=prompt, response=r, feedback=f)
    text, ids, cut = self._fit(render, response, feedback)
    return Prompt(text, ids, cut)

  def fcp(self, prompt: str, feedback: str) -> Prompt:
    """FCP feedback-conditioned prompt ``<EF>c</EF>q`` (cuts only c)."""
    render = lambda _, f: self.fcp_template.format(prompt=prompt, feedback=f)
    text, ids, cut = self._fit(render, "", feedback)
    return Prompt(text, ids, cut)

  def aggregated(self, prompt: str, attempts: Sequence[Attempt | tuple]
                 ) -> Prompt:
    """GOLF aggregated refinement prompt over failed ``attempts``.

    Args:
      prompt: the problem q.
      attempts: the failed round-1 attempts as ``Attempt(response, feedback,
        score)`` (the caller decides what "failed" means).

    Returns:
      The prompt; ``num_attempts`` says how many attempts fit.
    """
    atts = [Attempt(*a) for a in attempts]
    if self.agg_dedupe:
      seen, unique = set(), []
      for a in atts:
        if a.response not in seen:
          seen.add(a.response)
          unique.append(a)
      atts = unique
    lengths = [len(self.tokenizer.encode(a.response, add_special_tokens=False))
               for a in atts]
    order = sorted(range(len(atts)), key=lambda i: (lengths[i], i))
    head = self.agg_header.format(prompt=prompt)
    foot = self.agg_footer.format(prompt=prompt)
    block = lambda k, a, r, f: self.agg_attempt.format(
        index=k, score=_format_score(a.score), response=r, feedback=f)

    blocks: list[str] = []
    for i in order:
      cand = blocks + [block(len(blocks) + 1, atts[i], atts[i].response,
                             atts[i].feedback)]
      if len(self.encode(head + "".join(cand) + foot)) <= self.max_prompt_tokens:
        blocks = cand
    if blocks or not atts:
      text = head + "".join(blocks) + foot
      ids = self.encode(text)
      if len(ids) > self.max_prompt_tokens:
        raise PromptTooLongError(
            f"aggregated prompt header+footer has {len(ids)} tokens > "
            f"max_prompt_tokens={self.max_prompt_tokens}")
      return Prompt(text, ids, False, len(blocks))
    a = atts[order[0]]  # nothing fits whole: cut the shortest attempt
    render = lambda r, f: head + block(1, a, r, f) + foot
    text, ids, _ = self._fit(render, a.response, a.feedback)
    return Prompt(text, ids, True, 1)
