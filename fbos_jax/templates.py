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

**Plain text** (issue 23): special tokens come only from templates. A
prompt, a response, a feedback (and the system prompt) are *fields*; the
template strings and the chat template around them are *template text*. A
rendered prompt is a list of pieces (:class:`Piece`) and :func:`encode_pieces`
gives a special token id only to a special-token text (any added token of the
tokenizer, special or not: ``<eos>``, ``<EF>``, ``<|im_end|>``, ``<think>``)
that lies inside template text; the same characters in a field are encoded as
the plain characters they are (:func:`encode_plain`), so a prompt holding
``<|im_end|><|im_start|>assistant`` cannot forge a chat turn, a response
holding ``</EF>`` cannot close the FCP brackets, and a feedback holding
``<eos>`` does not end anything. When no field holds such text, the ids are
exactly ``tokenizer.encode(text, add_special_tokens=False)`` of the rendered
text, as before.

The data loader also refuses, at load, a record whose text holds such a
marker (:func:`forbidden_texts`: the tokenizer's added tokens, the tags the
templates use, and the style's delimiters, ``templates.markers``), naming
``file:line``; ``data.special_text="escape"`` keeps the record instead (its
text is then encoded as plain characters) with a warning.

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
import json
import re
import string
from typing import Callable, NamedTuple, Sequence
import weakref

import ml_collections

FCP_TEMPLATE = "<EF>{feedback}</EF>{prompt}"

# The feedback prompts a PromptBuilder renders (PromptBuilder.longest_tokens' kinds):
# a FAP, GOLF's aggregated prompt, and FCP's <EF>c</EF>q (the template ``fcp``).
FCP_KIND = "fcp"
FEEDBACK_PROMPT_KINDS = ("fap", "aggregated", FCP_KIND)

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


# Delimiters of each style's templates that are ordinary characters (not
# tokens): a record holding one could forge the structure of a FAP
# (``templates.markers="auto"``; the tags such as ``<EF>`` are found in the
# templates themselves).
STYLE_MARKERS = {"compact": ("|",), "verbose": ()}
_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9_]*>")  # "<EF>", "</EF>" in a template


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
      FCP_KIND: FCP_TEMPLATE,  # fields: {feedback} {prompt}
      "max_prompt_tokens": 256,  # budget for every built prompt
      "truncation": "middle",  # "middle" | "left" | "right" | "error"
      "ellipsis": "...",  # marks where a response/feedback was cut
      "add_bos": False,  # prepend tokenizer.bos_token_id (plain-text path)
      "system_prompt": "",  # chat-template path only; "" = no system turn
      # Extra kwargs for apply_chat_template, e.g. {"enable_thinking": False}.
      "chat_template_kwargs": ml_collections.ConfigDict(),
      # Text a data record may not hold (besides the tokenizer's special-token
      # texts and the tags of the templates, always checked): "auto" = the
      # style's delimiters (STYLE_MARKERS: compact "|", verbose none), or a
      # whitespace-separated list, "" = none. See data.special_text.
      "markers": "auto",
  })


# ---------------------------------------------------------------------------
# Plain-text encoding: special tokens only from template text.


class Piece(NamedTuple):
  """One piece of a rendered prompt: template text (its special-token texts
  become special tokens) or a field (always plain text)."""

  text: str
  template: bool


def _field(text: str) -> Piece:
  return Piece(str(text), False)


def _tmpl(text: str) -> Piece:
  return Piece(text, True)


class _TokenizerInfo:
  """What plain-text encoding needs to know about one tokenizer (cached)."""

  def __init__(self, tokenizer):
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    contents = {}
    for i, tok in decoder.items():
      text = getattr(tok, "content", str(tok))
      if text:
        contents[text] = int(i)
    for text in getattr(tokenizer, "all_special_tokens", ()) or ():
      if text and text not in contents:
        tid = tokenizer.convert_tokens_to_ids(text)
        if tid is not None:
          contents[text] = int(tid)
    self.ids = contents  # special-token text -> id
    self.id_set = frozenset(contents.values())
    texts = sorted(contents, key=lambda t: (-len(t), t))  # longest first
    self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
    self._tokenizer = weakref.ref(tokenizer) if _weakrefable(tokenizer) else lambda: tokenizer
    self._plain_backend = None
    self._plain_backend_made = False

  @property
  def plain_backend(self):
    """Built on first need (a copy of a large vocabulary takes a second)."""
    if not self._plain_backend_made:
      self._plain_backend = _plain_backend(self._tokenizer())
      self._plain_backend_made = True
    return self._plain_backend


def _weakrefable(obj) -> bool:
  try:
    weakref.ref(obj)
    return True
  except TypeError:
    return False


def _plain_backend(tokenizer):
  """A copy of the fast tokenizer's backend that never matches an added token
  (all of them marked special, special tokens encoded as text), or None."""
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is None:
    return None
  try:
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    spec = json.loads(backend.to_str())
    for tok in spec.get("added_tokens") or ():
      tok["special"] = True
    plain = Tokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain
  except Exception:  # pylint: disable=broad-except
    return None  # the slower splitting path below still keeps text plain


_INFO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_INFO_BY_ID: dict = {}


def _info(tokenizer) -> _TokenizerInfo:
  try:
    info = _INFO.get(tokenizer)
    if info is None:
      info = _INFO[tokenizer] = _TokenizerInfo(tokenizer)
    return info
  except TypeError:  # not weak-referenceable
    key = id(tokenizer)
    if key not in _INFO_BY_ID:
      _INFO_BY_ID[key] = (tokenizer, _TokenizerInfo(tokenizer))
    return _INFO_BY_ID[key][1]


def special_texts(tokenizer) -> tuple[str, ...]:
  """The texts that the tokenizer turns into one added token (special or
  not), longest first: ``<pad> <bos> <eos> <unk> <EF> </EF>`` for the
  character tokenizer, ``<|im_start|> <|im_end|> <think> ...`` for Qwen."""
  return tuple(sorted(_info(tokenizer).ids, key=lambda t: (-len(t), t)))


def encode_plain(tokenizer, text: str) -> list[int]:
  """Ids of ``text`` as plain text: never an added token, even where the
  text spells one (``"<eos>"`` is five characters, not EOS).

  For text without special-token text the ids equal
  ``tokenizer.encode(text, add_special_tokens=False)``.

  Raises:
    ValueError: the tokenizer still produced an added token (never silent).
  """
  info = _info(tokenizer)
  if not text:
    return []
  ids = None
  if info.pattern is None or not info.pattern.search(text):
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not any(i in info.id_set for i in ids):
      return ids  # the common case: nothing to keep out
  if info.plain_backend is not None:
    ids = list(info.plain_backend.encode(text, add_special_tokens=False).ids)
  elif info.pattern is not None:  # cut every occurrence after its first character
    cuts = sorted({m.start() + 1 for m in _overlapping(info.pattern, text)})
    parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    ids = [i for part in parts if part
           for i in tokenizer.encode(part, add_special_tokens=False)]
  bad = [i for i in ids if i in info.id_set]
  if bad:
    raise ValueError(
        f"encoding {text[:80]!r} as plain text still gave special token id(s) "
        f"{bad[:5]}; this tokenizer cannot keep special tokens out of data text")
  return ids


def _overlapping(pattern: re.Pattern, text: str):
  pos = 0
  while True:
    m = pattern.search(text, pos)
    if m is None:
      return
    yield m
    pos = m.start() + 1


def encode_pieces(tokenizer, pieces: Sequence[Piece]) -> list[int]:
  """Token ids of a rendered prompt: special tokens only from template text.

  Special-token texts inside a template piece become their ids; every other
  character (the rest of the template text and all of every field) is encoded
  as plain text. When every special-token text of the joined string lies
  inside a template piece (no field holds or completes one), this is exactly
  ``tokenizer.encode("".join(texts), add_special_tokens=False)``.
  """
  info = _info(tokenizer)
  text = "".join(p.text for p in pieces)
  if info.pattern is None:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
  allowed, pos = [], 0  # (start, end) of the markers inside template pieces
  for p in pieces:
    if p.template:
      allowed += [(pos + m.start(), pos + m.end()) for m in info.pattern.finditer(p.text)]
    pos += len(p.text)
  found = [(m.start(), m.end()) for m in info.pattern.finditer(text)]
  if found == allowed:  # the common case: the tokenizer sees what we mean
    ids = list(tokenizer.encode(text, add_special_tokens=False)) if text else []
    if sum(i in info.id_set for i in ids) == len(allowed):
      return ids
  out, pos = [], 0
  for start, end in allowed + [(len(text), len(text))]:
    out += encode_plain(tokenizer, text[pos:start])
    if end > start:
      out.append(info.ids[text[start:end]])
    pos = end
  return out


def template_markers(config: ml_collections.ConfigDict | None = None
                     ) -> tuple[str, ...]:
  """Marker texts of the configured templates that a record may not hold:
  the tags they use (``<EF>``, ``</EF>``) and the style's delimiters
  (``templates.markers``; "auto" = ``STYLE_MARKERS[style]``)."""
  cfg = config if config is not None else default_template_config()
  style = cfg.get("style", "compact")
  agg = AGGREGATED_TEMPLATES.get(style, AGGREGATED_TEMPLATES["compact"])
  texts = [cfg.get("fap") or FAP_TEMPLATES.get(style, ""),
           cfg.get("aggregated_header") or agg["header"],
           cfg.get("aggregated_attempt") or agg["attempt"],
           cfg.get("aggregated_footer") or agg["footer"],
           cfg.get(FCP_KIND, FCP_TEMPLATE)]
  tags = [t for x in texts for t in _TAG.findall(x)]
  chosen = cfg.get("markers", "auto")
  if chosen == "auto":
    extra = list(STYLE_MARKERS.get(style, ()))
  else:
    extra = str(chosen).split()
  return tuple(dict.fromkeys(tags + extra))


def forbidden_texts(tokenizer=None, config: ml_collections.ConfigDict | None = None
                    ) -> tuple[str, ...]:
  """Every text a data record may not hold (refused or escaped at load, see
  ``data.special_text``): the tokenizer's special-token texts (none without
  a tokenizer) and :func:`template_markers`. Longest first."""
  texts = list(special_texts(tokenizer)) if tokenizer is not None else []
  texts += template_markers(config)
  return tuple(sorted(dict.fromkeys(t for t in texts if t), key=lambda t: (-len(t), t)))


def find_forbidden(text: str, forbidden: Sequence[str]) -> str | None:
  """The first of ``forbidden`` that ``text`` holds, or None."""
  for marker in forbidden:
    if marker in text:
      return marker
  return None


def inferred_template_config(tokenizer) -> ml_collections.ConfigDict:
  """The default template config of the style a tokenizer is paired with
  (``tokenizer.check_tokenizer_compat``: a chat template goes with "verbose",
  none with "compact")."""
  cfg = default_template_config()
  if getattr(tokenizer, "chat_template", None):
    cfg.style = "verbose"
  return cfg


# ---------------------------------------------------------------------------
# Rendering.

_SENTINEL = "FBOSfield{}x7Q"  # stands for a field while the chat template renders
_CHAT_SPLITS: dict = {}  # (chat template, system?, ...) -> its text around the fields


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


def _split_at(rendered: str, sentinel: str, what: str) -> tuple[str, str]:
  if rendered.count(sentinel) != 1:
    raise ValueError(
        f"the tokenizer's chat template does not copy the {what} verbatim into "
        "the prompt, so the prompt text cannot be kept apart from the "
        "template's special tokens; use a chat template that inserts "
        "message['content'] as is")
  head, tail = rendered.split(sentinel)
  return head, tail


def render_pieces(tokenizer, pieces: Sequence[Piece], *, system_prompt: str = "",
                  chat_template_kwargs: dict | None = None,
                  add_bos: bool = False) -> list[Piece]:
  """The pieces of the exact string that gets tokenized (chat template
  around ``pieces`` when the tokenizer has one, else ``pieces`` with BOS)."""
  pieces = list(pieces)
  if not getattr(tokenizer, "chat_template", None):
    if add_bos and tokenizer.bos_token_id is not None:
      return [Piece(tokenizer.bos_token, True)] + pieces
    return pieces
  user = "".join(p.text for p in pieces)
  key = (tokenizer.chat_template, bool(system_prompt), getattr(tokenizer, "bos_token", None),
         getattr(tokenizer, "eos_token", None),
         json.dumps(chat_template_kwargs or {}, sort_keys=True, default=str))
  if key not in _CHAT_SPLITS:
    s_sys, s_user = _SENTINEL.format(0), _SENTINEL.format(1)
    rendered = render_text(tokenizer, s_user, system_prompt=s_sys if system_prompt else "",
                           chat_template_kwargs=chat_template_kwargs)
    head, tail = _split_at(rendered, s_user, "user message")
    before, after = _split_at(head, s_sys, "system prompt") if system_prompt else (head, "")
    if len(_CHAT_SPLITS) > 64:
      _CHAT_SPLITS.clear()
    _CHAT_SPLITS[key] = (before, after, tail)
  before, after, tail = _CHAT_SPLITS[key]
  out = [_tmpl(before)]
  if system_prompt:
    out += [_field(system_prompt), _tmpl(after)]
  real = render_text(tokenizer, user, system_prompt=system_prompt,
                     chat_template_kwargs=chat_template_kwargs)
  if real != "".join(p.text for p in out) + user + tail:
    raise ValueError(
        "the tokenizer's chat template changes the user message (e.g. strips "
        "it), so the prompt text cannot be kept apart from the template's "
        "special tokens; use a chat template that inserts message['content'] "
        "as is")
  return out + pieces + [_tmpl(tail)]


def render_prompt(tokenizer, text: str, *, system_prompt: str = "",
                  chat_template_kwargs: dict | None = None,
                  add_bos: bool = False) -> list[int]:
  """Token ids of prompt ``text`` (chat template if the tokenizer has one).

  ``text`` is plain text (a field, see the module doc): special-token text
  in it stays characters.

  Returns:
    [T] token ids, without special tokens other than those the chat template
    writes itself (and BOS if ``add_bos`` on the plain-text path).
  """
  return encode_pieces(tokenizer, render_pieces(
      tokenizer, [_field(text)], system_prompt=system_prompt,
      chat_template_kwargs=chat_template_kwargs, add_bos=add_bos))


def format_pieces(template: str, **fields) -> list[Piece]:
  """``template.format(**fields)`` as pieces: the template's literal text is
  template text, each substituted value a field."""
  out = []
  for literal, name, spec, conv in string.Formatter().parse(template):
    if literal:
      out.append(_tmpl(literal))
    if name is not None:
      value = fields[name]
      if conv:
        value = {"r": repr, "s": str, "a": ascii}[conv](value)
      out.append(_field(format(value, spec) if spec else str(value)))
  return out


def _join(pieces: Sequence[Piece]) -> str:
  return "".join(p.text for p in pieces)


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
    """``render_prompt`` with this builder's chat settings (``text`` is plain)."""
    return self.encode_pieces([_field(text)])

  def encode_pieces(self, pieces: Sequence[Piece]) -> list[int]:
    """Ids of prompt ``pieces`` (template text and fields, see the module
    doc) inside this builder's chat template."""
    return encode_pieces(self.tokenizer, render_pieces(
        self.tokenizer, pieces, **self._render_kwargs))

  def _plain_ids(self, text: str) -> list[int]:
    return encode_plain(self.tokenizer, text)

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

  def _largest_fit(self, render: Callable[[str], list[Piece]], piece: str,
                   side: str) -> tuple[str, list[int]] | None:
    """Cuts ``piece`` to the most tokens with which ``render(piece)`` fits.

    Binary search over the kept token count; returns (text, ids) or None if
    even the fully cut piece does not fit.
    """
    ids = self._plain_ids(piece)
    best = None
    lo, hi = 0, len(ids)
    while lo <= hi:
      mid = (lo + hi) // 2
      pieces = render(self._cut(ids, mid, side))
      tok = self.encode_pieces(pieces)
      if len(tok) <= self.max_prompt_tokens:
        best, lo = (_join(pieces), tok), mid + 1
      else:
        hi = mid - 1
    return best

  def _fit(self, render: Callable[[str, str], list[Piece]], response: str,
           feedback: str) -> tuple[str, list[int], bool]:
    """Applies the budget policy (module doc) to ``render(response, feedback)``."""
    pieces = render(response, feedback)
    ids = self.encode_pieces(pieces)
    if len(ids) <= self.max_prompt_tokens:
      return _join(pieces), ids, False
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
        f"{len(self.encode_pieces(render(no_response, '')))} tokens")

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
    elif kind == FCP_KIND:
      fixed = self.fcp_template.format(prompt="", feedback="")
      chars = prompt_chars + feedback_chars
    else:
      raise ValueError(f"prompt kind {kind!r}; expected fap | aggregated | fcp")
    return len(self.encode_pieces([_tmpl(fixed)] if fixed else [])) + chars

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
    render = lambda r, f: format_pieces(
        self.fap_template, prompt=prompt, response=r, feedback=f)
    text, ids, cut = self._fit(render, response, feedback)
    return Prompt(text, ids, cut)

  def fcp(self, prompt: str, feedback: str) -> Prompt:
    """FCP feedback-conditioned prompt ``<EF>c</EF>q`` (cuts only c)."""
    render = lambda _, f: format_pieces(self.fcp_template, prompt=prompt, feedback=f)
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
    lengths = [len(self._plain_ids(a.response)) for a in atts]
    order = sorted(range(len(atts)), key=lambda i: (lengths[i], i))
    head = format_pieces(self.agg_header, prompt=prompt)
    foot = format_pieces(self.agg_footer, prompt=prompt)
    block = lambda k, a, r, f: format_pieces(
        self.agg_attempt, index=k, score=_format_score(a.score), response=r,
        feedback=f)

    blocks: list[list[Piece]] = []
    flat = lambda bs: [p for b in bs for p in b]
    for i in order:
      cand = blocks + [block(len(blocks) + 1, atts[i], atts[i].response,
                             atts[i].feedback)]
      if len(self.encode_pieces(head + flat(cand) + foot)) <= self.max_prompt_tokens:
        blocks = cand
    if blocks or not atts:
      pieces = head + flat(blocks) + foot
      ids = self.encode_pieces(pieces)
      if len(ids) > self.max_prompt_tokens:
        raise PromptTooLongError(
            f"aggregated prompt header+footer has {len(ids)} tokens > "
            f"max_prompt_tokens={self.max_prompt_tokens}")
      return Prompt(_join(pieces), ids, False, len(blocks))
    a = atts[order[0]]  # nothing fits whole: cut the shortest attempt
    render = lambda r, f: head + block(1, a, r, f) + foot
    text, ids, _ = self._fit(render, a.response, a.feedback)
    return Prompt(text, ids, True, 1)
