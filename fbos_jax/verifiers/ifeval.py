"""Instruction-following (IFEval-style) constraint verifier.

An example lists its constraints in one of two forms:

* native: ``example["constraints"] = [{"type": ..., ...}, ...]`` with types
    ``max_words`` / ``min_words`` (``n``), ``max_sentences`` /
    ``min_sentences`` (``n``), ``include_keywords`` / ``forbidden_keywords``
    (``keywords``: list of str), ``json``, ``lowercase``, ``uppercase``;
* IFEval's own: ``instruction_id_list`` + ``kwargs`` for the supported ids
    ``length_constraints:number_words``, ``length_constraints:number_sentences``
    (``relation`` "less than" / "at least"), ``keywords:existence``,
    ``keywords:forbidden_words``, ``detectable_format:json_format``,
    ``change_case:english_lowercase``, ``change_case:english_capital``.
    Any other id raises ``ValueError`` (the pool turns that into an error
    verdict, logged once), rather than being silently counted as satisfied.

Feedback: one line per violated constraint, e.g.
``"the response has 63 words; the maximum is 50"``. Reward:
``reward_mode="fraction"`` (default) = satisfied / total, ``"all"`` = 1 only if
every constraint holds. Words are ``\\w+`` runs; sentences are runs of text
ended by ``.``, ``!`` or ``?`` (or the end of the text); keywords match whole
words, case-insensitively.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from fbos_jax.verifiers.base import CORRECT_FEEDBACK
from fbos_jax.verifiers.base import register_verifier
from fbos_jax.verifiers.base import Verdict

_IFEVAL_IDS = {
    "length_constraints:number_words",
    "length_constraints:number_sentences",
    "keywords:existence",
    "keywords:forbidden_words",
    "detectable_format:json_format",
    "change_case:english_lowercase",
    "change_case:english_capital",
}


def count_words(text: str) -> int:
  return len(re.findall(r"\w+", text))


def count_sentences(text: str) -> int:
  parts = re.split(r"[.!?]+(?:\s+|$)", text.strip())
  return sum(1 for p in parts if re.search(r"\w", p))


def _has_word(text: str, keyword: str) -> bool:
  return re.search(r"(?<!\w)" + re.escape(keyword) + r"(?!\w)", text,
                   re.IGNORECASE) is not None


def _quoted_list(words) -> str:
  q = [f"'{w}'" for w in words]
  return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " and " + q[-1]


def _strip_fences(text: str) -> str:
  t = text.strip()
  t = re.sub(r"^```(?:json|JSON)?\s*", "", t)
  return re.sub(r"\s*```$", "", t)


def normalize_constraints(example: Mapping[str, Any]) -> list[dict]:
  """Returns the example's constraints in the native form."""
  if "constraints" in example and example["constraints"] is not None:
    return [dict(c) for c in example["constraints"]]
  out = []
  for iid, kw in zip(example.get("instruction_id_list", []),
                     example.get("kwargs", [])):
    kw = {k: v for k, v in (kw or {}).items() if v is not None}
    if iid not in _IFEVAL_IDS:
      raise ValueError(f"unsupported IFEval instruction id {iid!r}")
    if iid.startswith("length_constraints:"):
      unit = "words" if iid.endswith("words") else "sentences"
      n = int(kw[f"num_{unit}"])
      if kw.get("relation", "less than") == "less than":
        out.append({"type": f"max_{unit}", "n": n - 1})
      else:
        out.append({"type": f"min_{unit}", "n": n})
    elif iid == "keywords:existence":
      out.append({"type": "include_keywords", "keywords": kw["keywords"]})
    elif iid == "keywords:forbidden_words":
      out.append({"type": "forbidden_keywords",
                  "keywords": kw["forbidden_words"]})
    elif iid == "detectable_format:json_format":
      out.append({"type": "json"})
    elif iid == "change_case:english_lowercase":
      out.append({"type": "lowercase"})
    else:
      out.append({"type": "uppercase"})
  return out


def check_constraint(c: Mapping[str, Any], text: str) -> str | None:
  """Returns the feedback line for a violated constraint, None if it holds."""
  kind = c["type"]
  if kind in ("max_words", "min_words", "max_sentences", "min_sentences"):
    unit = kind.split("_")[1]
    got = count_words(text) if unit == "words" else count_sentences(text)
    n = int(c["n"])
    noun = unit if got != 1 else unit[:-1]
    if kind.startswith("max") and got > n:
      return f"the response has {got} {noun}; the maximum is {n}"
    if kind.startswith("min") and got < n:
      return f"the response has {got} {noun}; the minimum is {n}"
    return None
  if kind == "include_keywords":
    missing = [k for k in c["keywords"] if not _has_word(text, k)]
    return f"the response must mention {_quoted_list(missing)}" if missing else None
  if kind == "forbidden_keywords":
    found = [k for k in c["keywords"] if _has_word(text, k)]
    return f"the response must not mention {_quoted_list(found)}" if found else None
  if kind == "json":
    try:
      json.loads(_strip_fences(text))
      return None
    except json.JSONDecodeError as e:
      return f"the response is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
  if kind in ("lowercase", "uppercase"):
    bad = [w for w in re.findall(r"\S+", text)
           if (w != w.lower() if kind == "lowercase" else w != w.upper())]
    if not bad:
      return None
    letters = "uppercase" if kind == "lowercase" else "lowercase"
    shown = bad[0] if len(bad[0]) <= 30 else bad[0][:27] + "..."
    return (f"the response must be all {kind}; found {letters} letters in "
            f"{_plural_words(len(bad))}, first in '{shown}'")
  raise ValueError(f"unknown constraint type {kind!r}")


def _plural_words(n: int) -> str:
  return "1 word" if n == 1 else f"{n} words"


@register_verifier("ifeval")
class IFEvalVerifier:
  """Checks every constraint of the example (see module doc).

  Args:
    reward_mode: "fraction" (satisfied / total) or "all" (all-or-nothing).
    feedback_reveals_answer: accepted for a uniform interface; constraint
      tasks have no hidden reference answer.
  """

  def __init__(self, reward_mode: str = "fraction",
               feedback_reveals_answer: bool = False):
    if reward_mode not in ("fraction", "all"):
      raise ValueError("reward_mode must be 'fraction' or 'all'")
    self.reward_mode = reward_mode
    del feedback_reveals_answer

  def __call__(self, example: Mapping[str, Any], response: str) -> Verdict:
    constraints = normalize_constraints(example)
    lines = [line for c in constraints
             if (line := check_constraint(c, response)) is not None]
    total = len(constraints)
    satisfied = total - len(lines)
    info = {"satisfied": satisfied, "total": total}
    if not lines:
      return Verdict(1.0, CORRECT_FEEDBACK, info)
    if self.reward_mode == "all":
      reward = 0.0
    else:
      reward = satisfied / total
    return Verdict(reward, "\n".join(lines), info)
