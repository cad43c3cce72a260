"""Plans of a config against hardware it does not own.

Two kinds, both without allocating anything:

* **Compiled plan** (:func:`compile_plan`, ``launch/train.py --dry_run
  --topology=v5p:2x4x4``): builds the config's mesh over the abstract devices of
  a TPU topology (``jax.experimental.topologies``; XLA's TPU compiler comes with
  the ``libtpu`` wheel and runs on a CPU host) and compiles every program one
  step of the config runs, at the largest shapes the config can produce (round-1
  and round-2 samplers, the update step, the pi_prox log-prob pass when
  configured, the eval samplers). Each program's per-device memory comes from
  XLA's ``memory_analysis()``; the chip's HBM from the compiler itself. This is
  the authority: a config is done only when every program fits.
* **Abstract plan** (:func:`memory_plan`, ``--dry_run --mesh_devices=N``): a
  quick estimate from ``jax.eval_shape`` and shardings on an abstract mesh (no
  compiler, any device count). Its activation term is a formula calibrated
  against the compiled plan (see :func:`activation_bytes`); the compiled plan
  wins where they differ.

FLOPs: XLA's ``cost_analysis()`` counts the body of a ``while``/``scan`` loop
once (checked in ``tests/test_plan.py``), so it undercounts the layer scan,
gradient accumulation and decode loops. The plan therefore prints both: XLA's
figure (per device, loop bodies once) and an analytic count of the whole
program (:func:`analytic_flops`), and uses the analytic one for the roofline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fbos_jax import sharding as sh
from fbos_jax.model import qwen

GiB = 1024 ** 3
FIT_FRACTION = 0.9  # a program fits when its peak is at most this share of HBM

# Public per-chip figures used by the roofline (bf16 dense matmul peak, HBM
# bandwidth). HBM capacity is NOT taken from here: the compiler reports it
# (:func:`hbm_bytes`). Sources: Google Cloud TPU system-architecture pages
# (v4, v5e, v5p, v6e), NVIDIA H100/H200 SXM datasheets.
@dataclasses.dataclass(frozen=True)
class ChipSpec:
  name: str
  peak_bf16_flops: float  # per chip, FLOP/s
  hbm_bandwidth: float  # per chip, bytes/s
  devices_per_chip: int = 1  # JAX devices per chip (v4 exposes both TensorCores)


CHIP_SPECS = {
    "TPU v4": ChipSpec("TPU v4", 275e12, 1.228e12, devices_per_chip=2),
    "TPU v5 lite": ChipSpec("TPU v5e", 197e12, 0.819e12),
    "TPU v5": ChipSpec("TPU v5p", 459e12, 2.765e12),
    "TPU v6 lite": ChipSpec("TPU v6e", 918e12, 1.640e12),
    "NVIDIA H100": ChipSpec("NVIDIA H100 SXM", 989e12, 3.35e12),
    "NVIDIA H200": ChipSpec("NVIDIA H200 SXM", 989e12, 4.8e12),
}
# HBM of common targets, for the abstract plan's "fits" lines (the compiled plan
# asks the compiler instead); TPU values are what XLA reports as available.
HBM_BYTES = {"v5p": int(95.74 * GiB), "v5e": int(15.75 * GiB), "v6e": int(31.25 * GiB),
             "v4": int(30.5 * GiB), "h100": 80 * GiB, "h200": 141 * GiB, "a100": 80 * GiB}

TOPOLOGY_FORMS = ("v4:2x2x2", "v5e:2x4", "v5p:2x2x1", "v5p:2x4x4", "v5p:4x4x4", "v6e:2x4",
                  "v6e:4x4", "h100:2x8")
_TPU_TOPOLOGY_RE = re.compile(r"^(v4|v5e|v5p|v6e):\d+x\d+(x\d+)?$")
# GPUs: CHIP:NODESxGPUS_PER_NODE, compiled from an XLA GpuTargetConfig (no GPU needed)
_GPU_TOPOLOGY_RE = re.compile(r"^(h100):(\d+)x(\d+)$")
GPU_TARGETS = {"h100": "h100_sxm.txtpb"}  # in fbos_jax/gpu_specs/
# JAX's GPU client takes this share of HBM by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
GPU_FIT_FRACTION = 0.75


class PlanError(ValueError):
  """A topology, mesh or config the plan cannot build; the message says what to change."""


# ----------------------------------------------------------------------------- topology


def topology_devices(name: str) -> list:
  """The abstract devices of a topology name: TPU ``v5p:2x4x4`` (XLA's TPU compiler,
  ``pip install libtpu==0.0.42.1``) or GPU ``h100:2x8`` (2 nodes x 8 GPUs; XLA's GPU
  compiler, ``pip install jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2``).
  Neither needs the accelerator."""
  if isinstance(name, str) and _GPU_TOPOLOGY_RE.match(name):
    return _gpu_topology_devices(name)
  if not isinstance(name, str) or not _TPU_TOPOLOGY_RE.match(name):
    raise PlanError(f"--topology={name!r} is not a topology name; accepted forms are "
                    f"GENERATION:AxB or GENERATION:AxBxC with GENERATION one of v4, v5e, v5p, "
                    f"v6e (TPU chips), or h100:NODESxGPUS (GPU nodes), e.g. "
                    f"{', '.join(TOPOLOGY_FORMS)}.")
  try:
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
  except Exception as e:  # noqa: BLE001  (libtpu missing, or a shape it rejects)
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "libtpu" in msg.lower() or "tpu" not in msg.lower() and "topology" not in msg.lower():
      raise PlanError(f"cannot build the TPU topology {name!r}: {msg}. The TPU compiler comes "
                      "with `pip install libtpu==0.0.42.1` (or `pip install -r "
                      "requirements-test.txt`); no TPU is needed.") from None
    raise PlanError(f"XLA rejects the topology {name!r}: {msg}. Accepted forms, e.g. "
                    f"{', '.join(TOPOLOGY_FORMS)}.") from None
  return list(topo.devices)


def _gpu_target_config(chip: str) -> str:
  import pathlib
  return (pathlib.Path(__file__).parent / "gpu_specs" / GPU_TARGETS[chip]).read_text()


def _gpu_topology_devices(name: str) -> list:
  """Compile-only GPUs (jax-ml/jax#28376: a GpuTargetConfig + ``jax_platforms=cpu``).
  The topology string is <partitions>x<hosts per partition>x<devices per host>,
  one NVLink domain per node."""
  chip, nodes, per_node = _GPU_TOPOLOGY_RE.match(name).groups()
  if "cpu" not in (jax.config.jax_platforms or ""):
    raise PlanError(f"--topology={name}: the GPU compiler runs deviceless only with "
                    "JAX_PLATFORMS=cpu set before JAX starts (launch/train.py's dry run sets it)")
  try:
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=_gpu_target_config(chip),
                                        topology=f"{nodes}x1x{per_node}")
  except (NotImplementedError, RuntimeError, ValueError) as e:
    raise PlanError(f"cannot build the GPU topology {name!r} ({str(e).splitlines()[0][:200]}); "
                    "XLA's GPU compiler comes with `pip install jax-cuda12-plugin==0.10.2 "
                    "jax-cuda12-pjrt==0.10.2` (no GPU needed)") from None
  return list(topo.devices)


def chip_spec(device) -> ChipSpec:
  kind = device.device_kind
  for k in sorted(CHIP_SPECS, key=len, reverse=True):
    if kind == k or kind.startswith(k + " "):
      return CHIP_SPECS[k]
  if kind in CHIP_SPECS:
    return CHIP_SPECS[kind]
  raise PlanError(f"no roofline figures for device kind {kind!r}; add it to "
                  "fbos_jax.plan.CHIP_SPECS.")


_HBM_RE = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT]?)\)")


@functools.lru_cache(maxsize=None)
def _hbm_of_kind(kind: str, devices: tuple) -> int:
  mesh = jax.sharding.Mesh(np.asarray(devices[:1]), ("x",))
  rep = NamedSharding(mesh, P())
  big = jax.ShapeDtypeStruct((64 * GiB,), jnp.int8, sharding=rep)
  try:
    jax.jit(lambda x: x + 1, out_shardings=rep).lower(big).compile()
  except Exception as e:  # noqa: BLE001
    m = _HBM_RE.search(str(e))
    if m:
      unit = {"": 1, "K": 1024, "M": 1024 ** 2, "G": GiB, "T": 1024 ** 4}[m.group(2)]
      return int(float(m.group(1)) * unit)
  raise PlanError(f"could not read the HBM size of {kind!r} from the compiler")


def hbm_bytes(device) -> int:
  """HBM one device may use. TPU: as XLA's TPU compiler reports it (e.g. 95.74 GiB
  on v5p, 15.75 GiB on v5e), read from its out-of-memory message for a deliberately
  oversized program (cached per device kind). GPU: the compiler does not refuse
  programs larger than HBM, so the target config's ``device_memory_size``."""
  if device.platform == "gpu":
    chip = next(c for c in GPU_TARGETS if c.upper() in device.device_kind.upper())
    return int(re.search(r"device_memory_size:\s*(\d+)", _gpu_target_config(chip)).group(1))
  return _hbm_of_kind(device.device_kind, (device,))


def fit_fraction(device) -> float:
  """The share of HBM a program may take: 90% on TPU; on GPU the 75% JAX's client
  preallocates by default (raise it with XLA_PYTHON_CLIENT_MEM_FRACTION)."""
  return GPU_FIT_FRACTION if device.platform == "gpu" else FIT_FRACTION


def target_mesh(config, devices, topology: str = "") -> jax.sharding.Mesh:
  """The config's mesh (``config.mesh``) over ``devices``; a mismatch names both numbers."""
  try:
    return sh.make_mesh(config.mesh, devices)
  except sh.ShardingError as e:
    where = f"the topology {topology} has" if topology else "there are"
    raise PlanError(f"{e} ({where} {len(devices)} devices; the mesh config "
                    f"{_mesh_str(config.mesh)} does not fit them)") from None


def _mesh_str(m) -> str:
  return ", ".join(f"mesh.{a}={m.get(a, 1)}" for a in sh.MESH_AXES)


# ----------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class SamplerShape:
  """One sampler program: ``prompts`` left-padded prompts of ``prompt_len`` tokens,
  ``n`` samples each, ``max_new_tokens`` new tokens."""
  prompts: int
  prompt_len: int
  n: int
  max_new_tokens: int
  greedy: bool = False

  @property
  def rows(self) -> int:
    return self.prompts * self.n


@dataclasses.dataclass(frozen=True)
class UpdateShape:
  """One update batch: ``rows`` sequences of ``prompt_len + response_len`` tokens."""
  rows: int
  prompt_len: int
  response_len: int

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.response_len


def _bucket(n: int, buckets) -> int:
  fits = [int(b) for b in buckets if int(b) >= n]
  return min(fits) if fits else max(int(b) for b in buckets)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def sampler_shapes(config, batch_shards: int) -> dict[str, SamplerShape]:
  """The largest sampler programs one step (and the eval) can run."""
  from fbos_jax import sampling
  c, rl = config, config.rl
  sc = c.sampling
  buckets = tuple(sc.get("batch_buckets", ()) or ()) or sampling.DEFAULT_BATCH_BUCKETS
  max_b = max(int(b) for b in buckets)

  def chunk(prompts):  # the sampler's row bucket for this many prompts (chunks of max_b)
    return _round_up(_bucket(min(prompts, max_b), buckets), batch_shards)

  R = int(sc.max_new_tokens)
  pmax = max(int(b) for b in sc.prompt_buckets)
  fmax = max(int(b) for b in sc.fap_prompt_buckets)
  out = {"sample_round1": SamplerShape(chunk(rl.prompts_per_step),
                                       fmax if rl.prompt == "fcp" else pmax,
                                       rl.group_size, R)}
  if rl.round2:
    if rl.fap_mode == "aggregated":
      out["sample_round2"] = SamplerShape(chunk(rl.prompts_per_step), fmax, rl.round2_size, R)
    else:
      out["sample_round2"] = SamplerShape(chunk(rl.prompts_per_step * rl.round2_size), fmax, 1, R)
  if c.train.eval_every > 0 and c.train.eval_prompts > 0:
    greedy = float(sc.eval_temperature) == 0.0
    out["eval_greedy"] = SamplerShape(chunk(c.train.eval_prompts), pmax, 1, R, greedy=greedy)
    if c.train.eval_k > 1:
      out["eval_sampled"] = SamplerShape(chunk(c.train.eval_prompts), pmax, c.train.eval_k, R)
  return out


def update_shapes(config, batch_shards: int) -> tuple[UpdateShape, UpdateShape]:
  """(EPA, ECC) batch shapes at the largest row counts a step can produce (the
  update takes the whole step's rows and splits them into mini-batches itself).

  EPA rows: P * (n + appended off-policy rows); ECC rows: P * m (when ECC is on;
  else a one-row masked batch). Rows are padded as the trainer pads them
  (:func:`fbos_jax.buckets.bucket_rows` to a multiple of batch shards x micro-
  x mini-batches)."""
  from fbos_jax.buckets import bucket_rows
  rl = config.rl
  P_ = rl.prompts_per_step
  R = int(config.sampling.max_new_tokens)
  mult = batch_shards * max(rl.micro_batches, 1) * max(rl.mini_batches, 1)
  terms = {name: t for name, t in rl.terms.items() if t.weight > 0}
  extra = rl.epa_max_per_prompt if (rl.round2 and rl.epa_mode == "append" and "epa" in terms) else 0
  pmax = max(int(b) for b in config.sampling.prompt_buckets)
  fmax = max(int(b) for b in config.sampling.fap_prompt_buckets)
  epa_plen = fmax if (rl.prompt == "fcp" or "fcp" in terms) else pmax
  epa = UpdateShape(bucket_rows(P_ * (rl.group_size + extra), mult), epa_plen, R)
  if rl.round2 and "ecc" in terms:
    ecc = UpdateShape(bucket_rows(P_ * rl.round2_size, mult), fmax, R)
  else:
    ecc = UpdateShape(bucket_rows(1, mult), 8, R)
  return epa, ecc


# ----------------------------------------------------------------------------- abstract state


def abstract_train_state(config, mesh, model_cfg=None):
  """ShapeDtypeStructs (with shardings on ``mesh``) of the trainer's TrainState,
  and the optimizer: the same function the trainer places its state with."""
  from fbos_jax import optim as optim_lib
  from fbos_jax.rl import config as config_lib
  from fbos_jax.rl import state as state_lib
  model_cfg = model_cfg or qwen.ModelConfig.from_dict(config.model)
  ucfg = config_lib.update_config(config)
  optimizer = optim_lib.make_optimizer(config.optim,
                                       config.train.steps * ucfg.epochs * ucfg.mini_batches)
  return state_lib.abstract_state(config, mesh, model_cfg, optimizer, strict=True), optimizer


def _abstract_batch(shape: UpdateShape, mesh):
  from fbos_jax.rl.batch import PolicyBatch

  def arr(dims, dtype):
    spec = sh.fit_spec(sh.batch_spec(len(dims)), dims, mesh)
    return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, spec))

  n, t, r = shape.rows, shape.seq_len, shape.response_len
  return PolicyBatch(tokens=arr((n, t), jnp.int32), attn_mask=arr((n, t), jnp.int32),
                     loss_mask=arr((n, r), jnp.float32), advantages=arr((n,), jnp.float32),
                     old_logp=arr((n, r), jnp.float32), is_offpolicy=arr((n,), jnp.bool_))


# ----------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Program:
  """One jitted program of a step with abstract arguments, ready to lower."""
  name: str
  fn: Any  # a jax.jit-wrapped function
  args: tuple
  flops: float  # analytic FLOPs of one call, all devices together
  what: str  # one line: the shapes
  knobs: str  # the config fields that shrink it


def _trunk_matmul_params(mc: qwen.ModelConfig) -> int:
  d, h, k, dh, f = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size
  return mc.num_layers * (d * h * dh + 2 * d * k * dh + h * dh * d + 3 * d * f)


def analytic_flops(mc: qwen.ModelConfig, *, kind: str, rows: int, seq: int = 0,
                   prompt_len: int = 0, response_len: int = 0, prompts: int = 0,
                   n: int = 1, remat: str = "none") -> float:
  """Matmul FLOPs of one program call (all devices), counting every loop iteration.

  * ``train``: rows x seq tokens through the trunk (causal attention: on average
    seq/2 keys per query), logits only on the response_len positions; forward +
    backward = 3x the forward, plus one more trunk forward when the layer is
    rematerialised in full (``remat='full'``).
  * ``logprob``: the forward of ``train`` only.
  * ``sample``: a prefill of ``prompts`` x prompt_len tokens, then
    ``response_len - 1`` decode steps of ``rows = prompts * n`` tokens against a
    cache filled to prompt_len + t (all steps run: the loop's upper bound).
  """
  trunk = _trunk_matmul_params(mc)
  attn = 4 * mc.num_layers * mc.num_heads * mc.head_dim  # per (query, key) pair: QK^T and PV
  head = 2 * mc.hidden_size * mc.vocab_size  # logits of one position
  if kind in ("train", "logprob"):
    tokens = rows * seq
    fwd_trunk = 2 * trunk * tokens + attn * rows * seq * (seq + 1) / 2
    fwd = fwd_trunk + head * rows * response_len
    if kind == "logprob":
      return float(fwd)
    return float(3 * fwd + (fwd_trunk if remat == "full" else 0))
  if kind == "sample":
    pre = 2 * trunk * prompts * prompt_len + attn * prompts * prompt_len * (prompt_len + 1) / 2
    pre += head * prompts
    steps = max(response_len - 1, 0)
    ctx = steps * prompt_len + steps * (steps + 1) / 2  # keys read over all decode steps
    dec = (2 * trunk + head) * rows * steps + attn * rows * ctx
    return float(pre + dec)
  raise ValueError(f"kind={kind!r}")


def _sampler_program(name, shape: SamplerShape, config, mesh, params, model_cfg) -> Program:
  from fbos_jax import sampling
  sc = config.sampling
  stop_ids = (model_cfg.vocab_size - 1,)  # the count matters (compile-time), not the id
  scfg = sampling.make_config(
      max_new_tokens=shape.max_new_tokens,
      temperature=0.0 if shape.greedy else (float(sc.temperature) or 1.0),
      top_k=int(sc.top_k), top_p=float(sc.top_p), stop_token_ids=stop_ids,
      prompt_buckets=(shape.prompt_len,)).validate(model_cfg.vocab_size)
  fn = sampling.get_generate_fn(model_cfg, scfg, batch=shape.prompts, prompt_len=shape.prompt_len,
                                n_per_prompt=shape.n, mesh=mesh,
                                rules=sh.rules_dict(config.mesh.rules))
  spec2 = NamedSharding(mesh, sh.batch_spec(2, mesh, shape.prompts))
  spec1 = NamedSharding(mesh, sh.batch_spec(1, mesh, shape.prompts))
  rep = NamedSharding(mesh, P())
  args = (params,
          jax.ShapeDtypeStruct((shape.prompts, shape.prompt_len), jnp.int32, sharding=spec2),
          jax.ShapeDtypeStruct((shape.prompts, shape.prompt_len), jnp.int32, sharding=spec2),
          jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
          jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
          jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
          jax.ShapeDtypeStruct((sampling.stop_id_array(stop_ids).size,), jnp.int32, sharding=rep),
          jax.ShapeDtypeStruct((shape.prompts,), jnp.int32, sharding=spec1))
  flops = analytic_flops(model_cfg, kind="sample", rows=shape.rows, prompts=shape.prompts,
                         prompt_len=shape.prompt_len, response_len=shape.max_new_tokens)
  what = (f"{shape.prompts} prompts x {shape.n} samples, prompt {shape.prompt_len} + "
          f"{shape.max_new_tokens} new tokens" + (" (greedy)" if shape.greedy else ""))
  knobs = ("sampling.batch_buckets (largest = prompts per call), sampling.max_new_tokens, "
           + ("sampling.fap_prompt_buckets / templates.max_prompt_tokens" if "round2" in name
              else "sampling.prompt_buckets") + ", mesh (more fsdp/tensor)")
  return Program(name, fn, args, flops, what, knobs)


def _update_program(config, mesh, state, optimizer, model_cfg, epa: UpdateShape,
                    ecc: UpdateShape) -> Program:
  from fbos_jax.rl import config as config_lib
  from fbos_jax.rl import state as state_lib
  from fbos_jax.rl import update as update_lib
  rep = NamedSharding(mesh, P())
  ucfg = config_lib.update_config(config)
  fn = update_lib.make_update_fn(model_cfg, optimizer, ucfg)
  jitted = jax.jit(fn, donate_argnums=(0,),
                   out_shardings=(state_lib.state_shardings(state), rep))
  shapes = {"epa": epa, "ecc": ecc, "fcp": epa}
  batches = {t.batch: _abstract_batch(shapes[t.batch], mesh) for t in ucfg.terms}
  flops = 0.0
  for t in ucfg.terms:
    sh_ = shapes[t.batch]
    kw = dict(rows=sh_.rows, seq=sh_.seq_len, response_len=sh_.response_len)
    flops += analytic_flops(model_cfg, kind="train", remat=model_cfg.remat, **kw)
    if config.rl.kl_beta > 0:  # the frozen reference's log-probs
      flops += analytic_flops(model_cfg, kind="logprob", **kw)
    if t.loss == "decoupled":  # pi_prox, in the same program
      flops += analytic_flops(model_cfg, kind="logprob", **kw)
  flops *= ucfg.epochs
  what = ", ".join(f"{t.batch.upper()} {shapes[t.batch].rows} rows x "
                   f"({shapes[t.batch].prompt_len} + {shapes[t.batch].response_len})"
                   for t in ucfg.terms)
  what += (f"; {ucfg.epochs} epoch(s) x {ucfg.mini_batches} mini-batch(es) x "
           f"{ucfg.micro_batches} micro-batches")
  knobs = ("rl.micro_batches (more = fewer rows at once), rl.mini_batches, model.remat, "
           "rl.prompts_per_step, sampling.max_new_tokens, mesh (more fsdp)")
  return Program("update", jitted, (state, batches), flops, what, knobs)


def step_programs(config, mesh, *, model_cfg=None) -> list[Program]:
  """Every program one training step (and the periodic eval) of ``config`` runs."""
  model_cfg = model_cfg or qwen.ModelConfig.from_dict(config.model)
  state, optimizer = abstract_train_state(config, mesh, model_cfg)
  shards = sh.batch_shard_count(mesh)
  progs = [_sampler_program(name, s, config, mesh, state.params, model_cfg)
           for name, s in sampler_shapes(config, shards).items()]
  epa, ecc = update_shapes(config, shards)
  progs.append(_update_program(config, mesh, state, optimizer, model_cfg, epa, ecc))
  return progs


# ----------------------------------------------------------------------------- compile


@dataclasses.dataclass
class ProgramReport:
  name: str
  what: str
  knobs: str
  flops: float  # analytic, all devices
  xla_flops: float = float("nan")  # XLA cost_analysis, per device, loop bodies once
  xla_bytes: float = float("nan")
  argument: int = 0
  output: int = 0
  alias: int = 0
  temp: int = 0
  code: int = 0
  error: str = ""  # the compiler's message when it did not compile

  @property
  def peak(self) -> int:
    """Per-device bytes while the program runs: arguments + outputs that do not
    alias an argument + temporaries + generated code."""
    return self.argument + self.output - self.alias + self.temp + self.code

  def as_json(self) -> dict:
    return {"peak_bytes": self.peak if not self.error else None, "flops": self.flops,
            "xla_flops_per_device_loop_bodies_once": self.xla_flops,
            "argument_bytes": self.argument, "output_bytes": self.output,
            "alias_bytes": self.alias, "temp_bytes": self.temp, "code_bytes": self.code,
            "error": self.error or None}


_OOM_RE = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")


def compile_program(prog: Program, mesh) -> ProgramReport:
  rep = ProgramReport(prog.name, prog.what, prog.knobs, prog.flops)
  try:
    with jax.set_mesh(mesh):
      compiled = prog.fn.lower(*prog.args).compile()
  except Exception as e:  # noqa: BLE001  (XLA reports OOM as a compile error)
    msg = str(e)
    m = _OOM_RE.search(msg)
    if m:
      unit = {"": 1, "K": 1024, "M": 1024 ** 2, "G": GiB, "T": 1024 ** 4}[m.group(2)]
      rep.temp = int(float(m.group(1)) * unit)
    rep.error = msg.splitlines()[0][:400] if msg else type(e).__name__
    return rep
  ma = compiled.memory_analysis()
  rep.argument = int(ma.argument_size_in_bytes)
  rep.output = int(ma.output_size_in_bytes)
  rep.alias = int(ma.alias_size_in_bytes)
  rep.temp = int(ma.temp_size_in_bytes)
  rep.code = int(ma.generated_code_size_in_bytes)
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  if ca:
    rep.xla_flops = float(ca.get("flops", float("nan")))
    rep.xla_bytes = float(ca.get("bytes accessed", float("nan")))
  return rep


def _fits(rep: ProgramReport, budget: float) -> bool:
  """Compiled, and its peak within ``budget`` bytes (fit fraction x HBM)."""
  return not rep.error and rep.peak <= budget


def _micro_batch_options(config, shards: int) -> list[int]:
  """Larger micro-batch counts that keep rows divisible (at least one row per shard)."""
  epa, _ = update_shapes(config, shards)
  rows_per_shard = epa.rows // shards
  m = max(config.rl.micro_batches, 1)
  out = []
  while m * 2 <= rows_per_shard * max(config.rl.micro_batches, 1):
    m *= 2
    out.append(m)
  return out


def compile_plan(config, topology: str, *, search: bool = True,
                 progress: Optional[Callable[[str], None]] = None) -> dict:
  """Compile every program of one step of ``config`` for ``topology`` and report.

  With ``search``, a program that does not fit is recompiled with larger
  ``rl.micro_batches`` (update) or a smaller largest ``sampling.batch_buckets``
  (samplers) to find the setting that fits; the report names it."""
  devices = topology_devices(topology)
  mesh = target_mesh(config, devices, topology)
  chip = chip_spec(devices[0])
  hbm = hbm_bytes(devices[0])
  frac = fit_fraction(devices[0])
  budget = frac * hbm
  model_cfg = qwen.ModelConfig.from_dict(config.model)
  say = progress or (lambda s: None)
  reports: dict[str, ProgramReport] = {}
  suggestions: dict[str, str] = {}
  for prog in step_programs(config, mesh, model_cfg=model_cfg):
    say(f"compiling {prog.name}: {prog.what}")
    rep = compile_program(prog, mesh)
    reports[prog.name] = rep
    if search and not _fits(rep, budget):
      suggestions[prog.name] = _search(config, mesh, prog.name, budget, say)
  shards = sh.batch_shard_count(mesh)
  n_dev = len(devices)
  est = roofline(config, model_cfg, mesh, chip, reports)
  return {
      "topology": topology, "chip": chip.name, "device_kind": devices[0].device_kind,
      "num_devices": n_dev, "mesh": dict(mesh.shape), "batch_shards": shards,
      "hbm_bytes": hbm, "fit_fraction": frac,
      "dtypes": {"params": model_cfg.param_dtype, "compute": model_cfg.compute_dtype,
                 "optimizer_state": str(config.optim.get("opt_state_dtype", "float32")),
                 "kv_cache": model_cfg.compute_dtype},
      "attention": getattr(model_cfg, "attention", "dense"), "remat": model_cfg.remat,
      "param_count": qwen.count_params(qwen.abstract_params(model_cfg)),
      "fits": all(_fits(r, budget) for r in reports.values()),
      "programs": {k: r for k, r in reports.items()},
      "suggestions": suggestions, "roofline": est,
      "est_step_s": est["step_s"],
  }


def _search(config, mesh, name: str, budget: float, say) -> str:
  """The smallest change of one knob that makes program ``name`` fit, as a flag."""
  import copy
  if name == "update":
    for m in _micro_batch_options(config, sh.batch_shard_count(mesh)):
      c = copy.deepcopy(config)
      with c.unlocked():
        c.rl.micro_batches = m
      prog = next(p for p in step_programs(c, mesh) if p.name == name)
      say(f"  retry {name} with rl.micro_batches={m}")
      rep = compile_program(prog, mesh)
      if _fits(rep, budget):
        return f"--config.rl.micro_batches={m} (peak {rep.peak / GiB:.1f} GiB)"
    return ("no rl.micro_batches fits (down to one row per batch shard); shrink the sequence "
            "(sampling.max_new_tokens, prompt buckets), use model.remat='full', or add devices")
  if name.startswith(("sample", "eval")):
    from fbos_jax import sampling
    buckets = tuple(config.sampling.get("batch_buckets", ()) or ()) or sampling.DEFAULT_BATCH_BUCKETS
    top = max(buckets)
    while top > sh.batch_shard_count(mesh):
      top //= 2
      c = copy.deepcopy(config)
      with c.unlocked():
        c.sampling.batch_buckets = tuple(b for b in buckets if b <= top) or (top,)
      shapes = sampler_shapes(c, sh.batch_shard_count(mesh))
      if name not in shapes:
        break
      say(f"  retry {name} with sampling.batch_buckets up to {top}")
      state, _ = abstract_train_state(c, mesh)
      rep = compile_program(_sampler_program(name, shapes[name], c, mesh, state.params,
                                             qwen.ModelConfig.from_dict(c.model)), mesh)
      if _fits(rep, budget):
        return (f"--config.sampling.batch_buckets='{tuple(b for b in buckets if b <= top) or (top,)}'"
                f" (peak {rep.peak / GiB:.1f} GiB)")
    return "no batch bucket fits; shorten prompts / responses or add devices"
  return ""


def fit_micro_batches(config, topology: str, *, progress=None) -> tuple[int, dict]:
  """The fewest ``rl.micro_batches`` (powers of two) at which the update program
  compiles within the fit fraction of HBM on ``topology``: the value a config
  should ship (fewer micro-batches = larger matmuls). Starts at the configured
  count and halves while it fits, or doubles until it does. Returns (count,
  {count: peak bytes, or None when it did not compile}); count 0 if none fits."""
  import copy
  devices = topology_devices(topology)
  mesh = target_mesh(config, devices, topology)
  budget = fit_fraction(devices[0]) * hbm_bytes(devices[0])
  say = progress or (lambda s: None)
  shards = sh.batch_shard_count(mesh)
  epa, _ = update_shapes(config, shards)
  tried: dict = {}

  def fits(m: int) -> bool:
    c = copy.deepcopy(config)
    with c.unlocked():
      c.rl.micro_batches = m
    rep = compile_program(next(p for p in step_programs(c, mesh) if p.name == "update"), mesh)
    tried[m] = None if rep.error else rep.peak
    say(f"update with rl.micro_batches={m}: "
        + (f"peak {rep.peak / GiB:.2f} GiB" if not rep.error else "does not compile"))
    return _fits(rep, budget)

  m = max(1, 2 ** int(math.log2(max(config.rl.micro_batches, 1))))
  if fits(m):
    while m > 1 and fits(m // 2):
      m //= 2
    return m, tried
  while m * 2 * shards <= epa.rows:
    m *= 2
    if fits(m):
      return m, tried
  return 0, tried


# ----------------------------------------------------------------------------- roofline


def _param_bytes_per_device_decode(model_cfg, mesh) -> float:
  """Weight bytes one device reads per decode step: its tensor-parallel share of
  all weights (FSDP shards are gathered for the matmuls)."""
  n = qwen.count_params(qwen.abstract_params(model_cfg))
  return n * jnp.dtype(model_cfg.compute_dtype).itemsize / mesh.shape["tensor"]


def _kv_bytes_per_device(model_cfg, mesh, rows: int, ctx: float) -> float:
  per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
  per_token *= jnp.dtype(model_cfg.compute_dtype).itemsize
  shards = sh.batch_shard_count(mesh) * min(mesh.shape["tensor"], model_cfg.num_kv_heads)
  return rows * ctx * per_token / shards


def roofline(config, model_cfg, mesh, chip: ChipSpec, reports: dict) -> dict:
  """Lower bounds on time from the analytic FLOPs (at the chip's bf16 peak) and
  the bytes a decode step must read (at its HBM bandwidth). Not a measurement."""
  n_dev = mesh.size
  peak = chip.peak_bf16_flops / chip.devices_per_chip  # per JAX device
  bw = chip.hbm_bandwidth / chip.devices_per_chip
  shards = sh.batch_shard_count(mesh)
  out: dict[str, Any] = {"chip": chip.name, "peak_bf16_flops_per_chip": chip.peak_bf16_flops,
                         "hbm_bandwidth_per_chip": chip.hbm_bandwidth}
  step = 0.0
  useful = 0.0
  for name, s in sampler_shapes(config, shards).items():
    pre = analytic_flops(model_cfg, kind="sample", rows=s.prompts, prompts=s.prompts,
                         prompt_len=s.prompt_len, response_len=1)
    pre_s = pre / (n_dev * peak)
    ctx = s.prompt_len + s.max_new_tokens / 2
    bytes_tok = _param_bytes_per_device_decode(model_cfg, mesh) + _kv_bytes_per_device(
        model_cfg, mesh, s.rows, ctx)
    dec_flops_tok = analytic_flops(model_cfg, kind="sample", rows=s.rows, prompts=0, prompt_len=0,
                                   response_len=2) / n_dev
    per_tok = max(bytes_tok / bw, dec_flops_tok / peak)
    t = pre_s + (s.max_new_tokens - 1) * per_tok
    out[name] = {"prefill_s": pre_s, "decode_s_per_token": per_tok,
                 "decode_bound": "memory" if bytes_tok / bw >= dec_flops_tok / peak else "compute",
                 "total_s": t}
    if name.startswith("sample"):
      step += t
      useful += reports[name].flops if name in reports else 0.0
  upd = reports.get("update")
  if upd is not None:  # its FLOPs already count every epoch and mini-batch
    t = upd.flops / (n_dev * peak)
    out["update"] = {"total_s": t}
    step += t
    useful += upd.flops
  out["step_s"] = step
  out["mfu_bound"] = useful / (step * n_dev * peak) if step else 0.0
  return out


def format_compiled_plan(plan: dict) -> str:
  hbm = plan["hbm_bytes"]
  budget = plan["fit_fraction"] * hbm
  d = plan["dtypes"]
  lines = [
      f"topology {plan['topology']}: {plan['num_devices']} x {plan['chip']} "
      f"({plan['device_kind']}), HBM {hbm / GiB:.2f} GiB per device (from the compiler); "
      f"a program fits at <= {plan['fit_fraction']:.0%}",
      "mesh: " + " x ".join(f"{k}={v}" for k, v in plan["mesh"].items()),
      f"params: {plan['param_count']:,} ({d['params']}), compute {d['compute']}, optimizer "
      f"state {d['optimizer_state']}, KV cache {d['kv_cache']}, attention "
      f"{plan['attention']}, remat {plan['remat']}",
      "",
      f"{'program':<20} {'args':>8} {'out':>8} {'alias':>8} {'temp':>8} {'code':>6} "
      f"{'peak GiB':>9} {'% HBM':>6}  {'FLOPs (analytic)':>16} {'XLA FLOPs/dev*':>14}",
  ]
  for name, r in plan["programs"].items():
    g = lambda b: f"{b / GiB:8.2f}"
    if r.error and not r.temp:
      lines.append(f"{name:<20} {'does not compile: ' + r.error}")
      continue
    peak = r.peak if not r.error else r.argument + r.temp
    lines.append(f"{name:<20} {g(r.argument)} {g(r.output)} {g(r.alias)} {g(r.temp)} "
                 f"{r.code / GiB:6.2f} {peak / GiB:9.2f} {100 * peak / hbm:5.0f}%  "
                 f"{r.flops:16.3e} {r.xla_flops:14.3e}"
                 + ("" if _fits(r, budget) else "  <-- DOES NOT FIT"))
    lines.append(f"{'':<20} {r.what}")
  lines.append("* XLA's cost_analysis counts a loop body once (layer scan, micro-batches, "
               "decode): per device, a lower bound. The analytic column counts every iteration "
               "(all devices).")
  for name, r in plan["programs"].items():
    if not _fits(r, budget):
      peak = r.peak if not r.error else r.temp
      lines.append(f"\n{name} does not fit: {peak / GiB:.2f} GiB > {plan['fit_fraction']:.0%} of "
                   f"{hbm / GiB:.2f} GiB HBM{' (' + r.error + ')' if r.error else ''}.")
      lines.append(f"  knobs that shrink it: {r.knobs}")
      if plan["suggestions"].get(name):
        lines.append(f"  found by recompiling: {plan['suggestions'][name]}")
  rf = plan["roofline"]
  lines.append("")
  lines.append(f"roofline ({rf['chip']}: {rf['peak_bf16_flops_per_chip'] / 1e12:.0f} TFLOP/s bf16, "
               f"{rf['hbm_bandwidth_per_chip'] / 1e12:.2f} TB/s HBM per chip; lower bounds):")
  for name, v in rf.items():
    if isinstance(v, dict) and "decode_s_per_token" in v:
      lines.append(f"  {name:<18} prefill {v['prefill_s']:.3f} s + decode "
                   f"{1e3 * v['decode_s_per_token']:.2f} ms/token ({v['decode_bound']}-bound) "
                   f"= {v['total_s']:.2f} s")
    elif isinstance(v, dict):
      lines.append(f"  {name:<18} {v['total_s']:.2f} s at peak")
  lines.append(f"  one step (rounds + update, eval excluded): >= {rf['step_s']:.2f} s; MFU bound "
               f"{100 * rf['mfu_bound']:.0f}% (decode is memory-bound)")
  lines.append("fits: " + ("yes" if plan["fits"] else "NO"))
  return "\n".join(lines)


def plan_json(plan: dict) -> dict:
  """The machine-readable summary (the last line of the dry run)."""
  return {"topology": plan["topology"], "hbm_bytes": plan["hbm_bytes"], "fits": plan["fits"],
          "programs": {k: {"peak_bytes": (r.peak if not r.error else None), "flops": r.flops,
                           "xla_flops": r.xla_flops, "temp_bytes": r.temp,
                           "argument_bytes": r.argument}
                       for k, r in plan["programs"].items()},
          "est_step_s": plan["est_step_s"], "mfu_bound": plan["roofline"]["mfu_bound"],
          "suggestions": plan["suggestions"], "dtypes": plan["dtypes"]}


# ----------------------------------------------------------------------------- abstract plan


def memory_plan(config, num_devices: int) -> dict[str, Any]:
  """Per-device bytes of the arrays whose size the shardings decide exactly:
  params, optimizer state, gradients and the round-1 KV cache, on an abstract
  mesh of ``num_devices`` (``jax.eval_shape``; nothing is allocated, so an 8B
  model plans on a laptop), and the param shardings.

  It does not estimate activations and temporaries: a hand formula was 4-60x
  too low against the compiler's figures (issue 17), so whether a config fits
  is only said by :func:`compile_plan` (``--dry_run --topology=...``)."""
  from fbos_jax.optim import init_opt_state, make_optimizer
  from fbos_jax.rl import state as state_lib

  model_cfg = qwen.ModelConfig.from_dict(config.model)
  mesh = sh.make_abstract_mesh(config.mesh, num_devices)
  rules = sh.rules_dict(config.mesh.rules)
  abstract = qwen.abstract_params(model_cfg)
  logical = qwen.param_logical_axes(model_cfg)
  specs = sh.tree_specs(logical, rules, abstract, mesh, strict=True)
  opt = make_optimizer(config.optim, config.train.steps)
  opt_abstract = jax.eval_shape(lambda p: init_opt_state(opt, p, config.optim), abstract)
  opt_specs = state_lib.like_params(opt_abstract, abstract, specs, P())
  grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), abstract)
  batch_shards = sh.batch_shard_count(mesh)
  rows = config.rl.prompts_per_step * max(config.rl.group_size, 1)
  seq = max(config.sampling.prompt_buckets) + config.sampling.max_new_tokens
  cache = jax.eval_shape(lambda: qwen.init_cache(model_cfg, rows, seq))
  axes = qwen.cache_logical_axes()
  cache_specs = qwen.KVCache(*(sh.fit_spec(sh.logical_to_spec(ax, rules), a.shape, mesh)
                               for a, ax in zip(cache, axes)))
  out = {
      "params": sh.per_device_bytes(abstract, specs, mesh),
      "optimizer": sh.per_device_bytes(opt_abstract, opt_specs, mesh),
      "gradients": sh.per_device_bytes(grads, specs, mesh),
      "kv_cache": sh.per_device_bytes(cache, cache_specs, mesh),
  }
  out["total_static"] = sum(out.values())
  return {
      "param_count": qwen.count_params(abstract),
      "mesh": dict(mesh.shape),
      "num_devices": num_devices,
      "bytes_per_device": out,
      "kv_rows": rows, "kv_seq": seq, "batch_shards": batch_shards,
      "param_specs": _group_specs(specs),
  }


def _group_specs(specs) -> dict[str, str]:
  flat = jax.tree.flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
  return {jax.tree_util.keystr(path, simple=True, separator="/"): str(s) for path, s in flat}


def format_plan(plan: dict, hbm: dict[str, int] | None = None) -> str:
  b = plan["bytes_per_device"]
  lines = [f"params: {plan['param_count']:,}",
           "mesh: " + " x ".join(f"{k}={v}" for k, v in plan["mesh"].items()) +
           f" ({plan['num_devices']} devices)",
           "param sharding:"]
  for name, spec in plan["param_specs"].items():
    lines.append(f"  {name:<22} {spec}")
  lines.append(f"per-device bytes of the sharded arrays (KV cache for {plan['kv_rows']} rows x "
               f"{plan['kv_seq']} slots):")
  for k in ("params", "optimizer", "gradients", "kv_cache", "total_static"):
    lines.append(f"  {k:<12} {b[k] / GiB:8.2f} GiB")
  lines.append("activations and temporaries are not estimated here: whether each program "
               "fits is what `--dry_run --topology=v5p:2x4x4` (XLA's compiler) reports")
  for name, cap in (hbm or {}).items():
    lines.append(f"  the sharded arrays alone take {100 * b['total_static'] / cap:.0f}% of a "
                 f"{name} ({cap / GiB:.2f} GiB HBM)")
  return "\n".join(lines)
