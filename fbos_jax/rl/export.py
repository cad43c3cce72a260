"""Export a run's checkpoint as a Hugging Face model directory, and check it.

``export_run`` writes the safetensors (the run's float32 master rounded to the
source checkpoint's dtype, bfloat16 by default: :func:`export_dtype`), ``config.json`` (keys we do not own, such
as ``max_position_embeddings`` and the eos/bos ids, kept from the source
checkpoint's ``config.json`` when the run came from one), the tokenizer files
and the source's ``generation_config.json``: a directory vLLM, SGLang and
``transformers.AutoModelForCausalLM`` load as is. ``check_greedy`` reloads it
with transformers and compares greedy generations with our sampler's. Both
read only the params of the checkpoint (``fbos_jax.rl.state.restore_params``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax

from fbos_jax import data as data_lib
from fbos_jax import tokenizer as tok_lib
from fbos_jax.model import hf
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import state as state_lib
from fbos_jax.rl.context import RolloutContext
from fbos_jax.rl.state import restore_params

GENERATION_CONFIG = "generation_config.json"


DEFAULT_EXPORT_DTYPE = "bfloat16"


def export_dtype(config, dtype: str = "", src: str = "") -> str:
  """The dtype an export writes: ``dtype`` (the launcher's ``--dtype``), else
  ``export.dtype``, else the source checkpoint's (``src``: its ``config.json``),
  else :data:`DEFAULT_EXPORT_DTYPE`. The run's float32 master is rounded to it
  once, here, not during training."""
  chosen = dtype or config.get("export", {}).get("dtype", "")
  if not chosen and src:
    chosen = hf.checkpoint_dtype(src) or ""
  return chosen or DEFAULT_EXPORT_DTYPE


def export_run(config, workdir: str, out: str, *, step: int = -1, dtype: str = "",
               init_from_hf: str = "") -> tuple[list[str], int]:
  """Exports checkpoint ``step`` (-1 = latest) of ``workdir`` to ``out``, in
  :func:`export_dtype` (the source checkpoint's dtype; bfloat16 by default).

  ``init_from_hf`` (or ``config.model.hf_path``): the source HF directory; the
  model fields are set from its ``config.json`` (``apply_hf_config``) and its
  ``config.json`` / ``generation_config.json`` keys are kept in the export.

  Returns:
    (files written, the checkpoint's step).
  """
  src = init_from_hf or config.model.get("hf_path", "")
  config = config_lib.with_checkpoint_model(config, init_from_hf)
  tok_dir = tok_lib.resolve_tokenizer_path(config, workdir)  # a clear error before any work
  params, restored = restore_params(config, workdir, step=step)
  model_cfg = config_lib.build_parts(config).model
  paths = hf.save_hf_checkpoint(params, model_cfg, out, dtype=export_dtype(config, dtype, src),
                                base_config=hf.read_hf_config(src) if src else None)
  if jax.process_index() == 0:
    written = tok_lib.copy_tokenizer_files(tok_dir, out)
    if not written:  # so the directory serves as is
      written = list(tok_lib.load_tokenizer(tok_dir).save_pretrained(out))
    paths += written
    if src and os.path.isfile(os.path.join(src, GENERATION_CONFIG)):
      shutil.copyfile(os.path.join(src, GENERATION_CONFIG), os.path.join(out, GENERATION_CONFIG))
      paths.append(os.path.join(out, GENERATION_CONFIG))
  return paths, restored


# transformers' logit of its own token minus of ours, at the first token where the two
# greedy continuations differ, at or below which the difference is a near-tie: float32
# on both sides, but another order of the sums (XLA vs torch) moves a logit by ~1e-5
NEAR_TIE = 1e-3


@dataclasses.dataclass(frozen=True)
class GreedyCheck:
  """One held-out prompt of the export check.

  status: ``equal`` (token for token), ``near_tie`` (they part where transformers'
  logits of the two tokens are within ``NEAR_TIE``: float rounding, not the export)
  or ``mismatch``. position: the first differing token (-1 when equal); gap:
  transformers' logit of its token minus of ours there (inf when one side had
  stopped); ours / theirs: the tokens."""
  status: str
  position: int = -1
  gap: float = 0.0
  ours: tuple = ()
  theirs: tuple = ()

  @property
  def ok(self) -> bool:
    return self.status != "mismatch"


def compare_greedy(ours, theirs, scores, tolerance: float = NEAR_TIE) -> GreedyCheck:
  """Classify two greedy continuations of one prompt: ``ours`` and ``theirs``
  (token ids, the stop token included), ``scores[t]`` [V] transformers' logits at
  its step t (after the sampler's rules)."""
  ours, theirs = tuple(int(t) for t in ours), tuple(int(t) for t in theirs)
  if ours == theirs:
    return GreedyCheck("equal", ours=ours, theirs=theirs)
  t = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours),
                                                                              len(theirs)))
  gap = float("inf")
  if t < len(ours) and t < len(theirs) and t < len(scores):
    row = scores[t]
    gap = float(row[theirs[t]] - row[ours[t]])
  status = "near_tie" if abs(gap) <= tolerance else "mismatch"
  return GreedyCheck(status, t, gap, ours, theirs)


def _vocab_limit_processor(limit: int):
  """A transformers logits processor that never draws ids at or past ``limit``
  (the tokenizer's size), as our samplers (``SamplingConfig.vocab_limit``)."""
  import torch
  import transformers

  class VocabLimit(transformers.LogitsProcessor):
    def __call__(self, input_ids, scores):
      scores = scores.clone()
      scores[:, limit:] = -torch.inf
      return scores

  return VocabLimit()


def check_greedy(config, workdir: str, out: str, num_prompts: int, *, step: int = -1,
                 init_from_hf: str = "", tolerance: float = NEAR_TIE) -> list:
  """Greedy continuations of ``num_prompts`` held-out prompts: our sampler on
  checkpoint ``step`` (-1 = latest) vs transformers ``generate`` on the export,
  both in float32 and under the sampler's rules: stopped at the run's stop ids,
  never drawing an id beyond the tokenizer (``vocab_limit``). A difference that
  remains is reported with transformers' logit gap at the first differing token
  (:func:`compare_greedy`). Returns one :class:`GreedyCheck` per prompt (prints
  each)."""
  import torch
  import transformers
  config = config_lib.with_checkpoint_model(config, init_from_hf)
  with config.unlocked():
    config.model.compute_dtype = "float32"
  ctx = RolloutContext.build(config, workdir, with_pool=False, check_budget=False)
  params, _ = restore_params(config, workdir, step=step)
  # the weights the export holds: the master rounded to the export's dtype
  stored = hf.checkpoint_dtype(out) or "float32"
  params = jax.tree.map(lambda a: a.astype(stored).astype("float32"), params)
  examples = data_lib.held_out_examples(config.data, num_prompts, tokenizer=ctx.tokenizer,
                                        templates_config=config.templates)[:num_prompts]
  prompts = [ctx.prompt_ids(ex) for ex in examples]
  greedy = dataclasses.replace(ctx.parts.sampling.eval, temperature=0.0)
  ours = ctx.sample(params, prompts, 1, state_lib.stream_key(  # greedy: the key is unused
      state_lib.root_rng(ctx.parts.seed), "eval", 0), greedy)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  # only the sampler's rules: a fresh generation config (not the export's
  # generation_config.json, whose sampling knobs or penalties are not ours)
  rules = transformers.GenerationConfig(
      max_new_tokens=greedy.max_new_tokens, do_sample=False, eos_token_id=list(ctx.stop_ids),
      pad_token_id=ctx.pad_id, output_scores=True, return_dict_in_generate=True)
  limit = transformers.LogitsProcessorList(
      [_vocab_limit_processor(greedy.vocab_limit)] if greedy.vocab_limit else [])
  results = []
  for i, p in enumerate(prompts):
    with torch.no_grad():
      hf_out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              generation_config=rules, logits_processor=limit)
    theirs = hf_out.sequences[0, len(p):].tolist()
    scores = [s[0].float().numpy() for s in hf_out.scores]
    mine = ours.tokens[i, :int(ours.lengths[i])].tolist()
    if theirs and theirs[-1] == ctx.pad_id and len(theirs) > len(scores):
      theirs = theirs[:len(scores)]  # padding after a stop (batch of one: none expected)
    r = compare_greedy(mine, theirs, scores, tolerance)
    results.append(r)
    where = "" if r.status == "equal" else (
        f" at token {r.position}: ours {mine[r.position] if r.position < len(mine) else 'stop'}"
        f", HF {theirs[r.position] if r.position < len(theirs) else 'stop'}, HF's logit gap "
        f"{r.gap:.3g}" + (f" <= {tolerance:g}" if r.status == "near_tie" else ""))
    print(f"prompt {i}: {r.status.upper().replace('_', '-')}{where} ({len(mine)} tokens)\n"
          f"  ours: {ctx.tokenizer.decode(mine)!r}\n"
          f"  HF:   {ctx.tokenizer.decode(theirs)!r}")
  return results


def summarize_greedy(results: list) -> str:
  """One line for the console: how many prompts were equal, near-ties, mismatches."""
  n = {k: sum(r.status == k for r in results) for k in ("equal", "near_tie", "mismatch")}
  ties = "; ".join(f"prompt {i} at token {r.position}, logit gap {r.gap:.2g}"
                   for i, r in enumerate(results) if r.status == "near_tie")
  return (f"greedy check: {n['equal']}/{len(results)} held-out prompts equal token for token"
          + (f", {n['near_tie']} part at a near-tie ({ties}: float rounding, not the export)"
             if n["near_tie"] else "")
          + (f", {n['mismatch']} MISMATCH" if n["mismatch"] else ""))
