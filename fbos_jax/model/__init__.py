"""Qwen2/Qwen3 model, KV cache, Hugging Face checkpoint import/export."""
from fbos_jax.model.qwen import (KVCache, ModelConfig, abstract_params, apply, count_params,
                                 forward, init_cache, init_params, logits, logits_fn,
                                 param_logical_axes, positions_from_mask, unembed_matrix)
from fbos_jax.model.hf import (CheckpointError, hf_config_dict, load_hf_params,
                               model_config_from_hf, save_hf_checkpoint, tensor_maps)
