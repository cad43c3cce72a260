"""Sampling: the static sampler, and what it shares with the continuous engine.

* :mod:`fbos_jax.sampling.static`: the static sampler (the reference): one
  jitted prefill + decode program per bucket; :func:`sample`, and the
  teacher-forced log-probs the trainer must reproduce.
* :mod:`fbos_jax.sampling.shared`: what both samplers use, as public functions:
  the contract (:class:`SamplingConfig`, :class:`SampleOutput`,
  :class:`SamplingError`, :func:`make_config`), the prompts' rows and their
  agreement across processes (:func:`as_rows`, :func:`agree_prompts`,
  :func:`mesh_processes`, :func:`check_stream_ids`), the token draw
  (:func:`key_uniform`, :func:`draw_weights`, :func:`draw`, :func:`choose`,
  :func:`add_logit_bias`), the logits drawn from (:func:`step_logits_fn`, over the
  model's ``qwen.logits_fn``; :func:`restrict_vocab`), stop ids
  (:func:`stop_slots`, :func:`stop_id_array`) and program keys (:func:`rules_key`).
* The continuous engine still lives in :mod:`fbos_jax.engine`; it moves into this
  package (``sampling/engine/``) once the work on its runner (the async issue)
  has landed. It imports only the public names above.

``from fbos_jax import sampling; sampling.sample(...)`` and every other public
name of the former ``fbos_jax/sampling.py`` work unchanged (re-exported here).
"""

from fbos_jax.sampling import shared, static
from fbos_jax.sampling.shared import (DEFAULT_BATCH_BUCKETS, DEFAULT_PROMPT_BUCKETS, LAYER_LOOPS,
                                      TRUNCATE_POLICIES, SampleOutput, SamplingConfig,
                                      SamplingError, add_logit_bias, agree_prompts, as_rows,
                                      check_stream_ids, choose, draw, draw_weights, key_uniform,
                                      make_config, mesh_processes, prepare_prompts,
                                      restrict_vocab, rules_key, step_logits_fn, stop_id_array,
                                      stop_slots)
from fbos_jax.sampling.static import (call_args, call_buckets, compiled_programs,
                                      decode_phase_lengths, get_generate_fn, grow_cache, sample,
                                      sample_key, teacher_forced_logits, teacher_forced_logprobs)
