"""The trainer's view of the outside world: tokenizer, data, prompt templates,
the verifier pool and the sampler, behind one small object. The host-side text
work of a step (render prompts, decode, verify, build FAPs) lives here."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np

from fbos_jax import data as data_lib
from fbos_jax import sampling
from fbos_jax import templates
from fbos_jax import tokenizer as tok_lib
from fbos_jax.verifiers import VerifierPool, get_verifier


class Environment:
  """Host-side helpers bound to one config (see ``from_config``)."""

  def __init__(self, config, tokenizer, verifier, *, train_iter=None, eval_examples=None):
    self.config = config
    self.tokenizer = tokenizer
    self.verifier = verifier
    self.pool = VerifierPool(verifier, num_workers=config.verifier.workers,
                             timeout_s=config.verifier.timeout_s)
    self.train_iter = train_iter
    self._eval_examples = eval_examples
    self.pad_id = int(tokenizer.pad_token_id)
    self.eos_id = int(tokenizer.eos_token_id)
    self.vocab_size = len(tokenizer)
    stops = list(config.sampling.get("stop_token_ids", ()) or ())
    self.stop_ids = tuple(dict.fromkeys([self.eos_id] + [int(s) for s in stops]))

  @classmethod
  def from_config(cls, config, workdir: str, *, process_index: Optional[int] = None,
                  process_count: Optional[int] = None) -> "Environment":
    import jax
    tok_path = config.model.tokenizer_path or config.model.hf_path
    if not tok_path:  # tiny configs: build the character tokenizer once, in the workdir
      tok_path = os.path.join(workdir, "tokenizer")
      if not os.path.exists(os.path.join(tok_path, "tokenizer.json")):
        tok_lib.build_char_tokenizer(tok_path)
    tokenizer = tok_lib.load_tokenizer(tok_path)
    verifier = get_verifier(config.verifier.name,
                            **_verifier_kwargs(config))
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    local_batch = config.rl.prompts_per_step // pc
    train_iter = data_lib.make_prompt_iterator(config.data, batch_size=local_batch,
                                               process_index=pi, process_count=pc,
                                               seed=config.seed, split="train")
    eval_n = config.train.eval_prompts // pc if config.train.eval_prompts else 0
    eval_examples = data_lib.eval_examples(config.data, eval_n, process_index=pi,
                                           process_count=pc) if eval_n else []
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
    return templates.render_prompt(self.tokenizer, example["prompt"])

  def fap_ids(self, example, response: str, feedback: str) -> list[int]:
    """FAP(q, o, F): the feedback-augmented prompt of one rollout."""
    c = self.config
    return templates.fap_prompt(self.tokenizer, example["prompt"], response, feedback,
                                style=c.rl.fap_template,
                                max_prompt_tokens=c.rl.fap_max_tokens or c.sampling.max_prompt_tokens)

  def aggregated_ids(self, example, responses: Sequence[str], feedbacks: Sequence[str],
                     rewards) -> list[int]:
    """GOLF's aggregated refinement prompt over q's failed attempts."""
    c = self.config
    thr = c.verifier.success_threshold
    attempts = [(r, f, float(s)) for r, f, s in zip(responses, feedbacks, rewards) if s < thr]
    return templates.aggregated_prompt(
        self.tokenizer, example["prompt"], attempts, style=c.rl.fap_template,
        max_prompt_tokens=c.rl.fap_max_tokens or c.sampling.max_prompt_tokens)

  def fcp_prompt(self, example, feedback: str) -> list[int]:
    return templates.fcp_prompt(self.tokenizer, example["prompt"], feedback)

  def decode(self, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    out = []
    for row, n in zip(np.asarray(tokens), np.asarray(lengths)):
      ids = [int(t) for t in row[:int(n)] if int(t) not in self.stop_ids]
      out.append(self.tokenizer.decode(ids, skip_special_tokens=True))
    return out

  def verify(self, examples: Sequence, texts: Sequence[str]):
    verdicts, stats = self.pool.run(list(examples), list(texts))
    rewards = np.asarray([v.reward for v in verdicts], np.float32)
    return rewards, [v.feedback for v in verdicts], {
        "errors": stats.get("verifier/errors", 0)}

  # ----------------------------------------------------------------- sampling
  def sample(self, params, model_cfg, prompts, *, n, key, mesh, rules, temperature,
             prompt_buckets):
    sc = self.config.sampling
    return sampling.sample(
        params, model_cfg, prompts, key=key, n_per_prompt=n, mesh=mesh, rules=rules,
        max_new_tokens=sc.max_new_tokens, temperature=temperature, top_k=sc.top_k,
        top_p=sc.top_p, stop_token_ids=self.stop_ids, pad_id=self.pad_id,
        prompt_buckets=prompt_buckets, batch_buckets=tuple(sc.get("batch_buckets", ())) or None)

  def close(self):
    close = getattr(self.pool, "close", None)
    if close:
      close()


def _verifier_kwargs(config) -> dict:
  kw = dict(config.verifier.get("kwargs", {}) or {})
  if config.verifier.name in ("procedural", "math", "ifeval", "code"):
    kw.setdefault("feedback_reveals_answer", config.verifier.feedback_reveals_answer)
  return kw
