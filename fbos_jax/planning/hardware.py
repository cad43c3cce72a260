"""The hardware side of a plan: topologies without the hardware, chip figures, HBM, the roofline.

* :func:`topology_devices`: the abstract devices of a TPU topology (``v5p:2x4x4``;
  XLA's TPU compiler from the ``libtpu`` wheel runs on a CPU host) or of GPU nodes
  (``h100:2x8``; XLA's GPU compiler, deviceless);
* :func:`hbm_bytes` / :func:`fit_fraction`: how much a program may take, as the
  compiler reports it;
* :data:`CHIP_SPECS` and :func:`roofline`: lower bounds on time from FLOPs at the
  chip's bf16 peak and from the bytes a decode step must read at its HBM bandwidth,
  under an assumed response-length distribution (:data:`RESPONSE_LENGTHS`), for
  the static sampler (every call runs to its longest row) and the continuous
  engine (slots refilled as rows stop) side by side.

The programs themselves (what a step compiles, at which shapes) are in
``fbos_jax/planning/programs.py``; their shapes come from the rollout's shape model
(``fbos_jax/rl/shapes.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import re
import statistics
from typing import Any

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
GPU_TARGETS = {"h100": "h100_sxm.txtpb"}  # in fbos_jax/planning/gpu_specs/
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
                  "fbos_jax.planning.hardware.CHIP_SPECS.")


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


# ----------------------------------------------------------------------------- FLOPs and roofline


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



def decode_flops(mc: qwen.ModelConfig, tokens: float, ctx: float) -> float:
  """Matmul FLOPs of ``tokens`` decoded tokens (all devices), each attending to
  ``ctx`` keys on average: the trunk and the LM head per token, QK^T and PV per
  (query, key) pair."""
  per_tok = 2 * _trunk_matmul_params(mc) + 2 * mc.hidden_size * mc.vocab_size
  attn = 4 * mc.num_layers * mc.num_heads * mc.head_dim
  return float(tokens * (per_tok + attn * ctx))


# ----------------------------------------------------------------------------- response lengths

_Z99 = statistics.NormalDist().inv_cdf(0.99)


@dataclasses.dataclass(frozen=True)
class ResponseLengths:
  """The response-length distribution the roofline assumes: lognormal with median
  ``median_fraction`` x max_new_tokens and 99th percentile ``p99_fraction`` x
  max_new_tokens, capped at max_new_tokens (a row that reaches the cap stops
  there). An assumption, not a measurement: set it from a run's
  ``rollout/response_len`` when one exists."""
  median_fraction: float = 0.25
  p99_fraction: float = 1.0

  def __post_init__(self):
    if not 0 < self.median_fraction <= self.p99_fraction:
      raise PlanError(f"ResponseLengths(median_fraction={self.median_fraction}, p99_fraction="
                      f"{self.p99_fraction}): need 0 < median_fraction <= p99_fraction.")

  def _mu_sigma(self, cap: int) -> tuple:
    sigma = math.log(self.p99_fraction / self.median_fraction) / _Z99
    return math.log(self.median_fraction * cap), sigma

  def cdf(self, x, cap: int):
    """P(length <= x) for lengths capped at ``cap`` (x an array)."""
    mu, sigma = self._mu_sigma(cap)
    x = np.asarray(x, np.float64)
    if sigma == 0:
      below = (x >= math.exp(mu)).astype(np.float64)
    else:
      z = (np.log(np.maximum(x, 1e-300)) - mu) / (sigma * math.sqrt(2))
      below = 0.5 * (1 + np.vectorize(math.erf)(z))
    return np.where(x >= cap, 1.0, np.where(x <= 0, 0.0, below))

  def mean(self, cap: int) -> float:
    """E[min(L, cap)]."""
    return self.expected_max(1, cap)

  def expected_max(self, rows: int, cap: int) -> float:
    """E[max of ``rows`` independent lengths] (capped): the steps of a static
    call of ``rows`` rows, which runs until its longest row stops."""
    x = np.linspace(0.0, float(cap), 8193)
    f = 1.0 - self.cdf(x, cap) ** max(int(rows), 1)
    return float(np.sum((f[1:] + f[:-1]) / 2) * (x[1] - x[0]))

  def sample(self, rows: int, cap: int, seed=0) -> np.ndarray:
    """``rows`` lengths (int, in [1, cap]) at the quantiles (i + 1/2) / rows of the
    distribution, in a fixed shuffled order (``seed``: an int or a tuple of ints, as
    numpy's default_rng takes): the rows of one call."""
    mu, sigma = self._mu_sigma(cap)
    nd = statistics.NormalDist(mu, sigma) if sigma else None
    q = [(i + 0.5) / rows for i in range(int(rows))]
    raw = [math.exp(nd.inv_cdf(p)) if nd else math.exp(mu) for p in q]
    out = np.clip(np.ceil(raw), 1, cap).astype(np.int64)
    return np.random.default_rng(seed).permutation(out)

  def describe(self, cap: int) -> str:
    return (f"lognormal, median {self.median_fraction:g} x max_new_tokens = "
            f"{self.median_fraction * cap:,.0f}, p99 {self.p99_fraction:g} x max_new_tokens = "
            f"{self.p99_fraction * cap:,.0f}, capped at {cap:,}: mean {self.mean(cap):,.0f}")


# The roofline's assumption: median a quarter of the cap and 1% of rows at the cap
# (issue 22: at 8,192 new tokens the median stops near 2,000 and a row of every
# large call reaches the cap).
RESPONSE_LENGTHS = ResponseLengths(median_fraction=0.25, p99_fraction=1.0)


def engine_schedule(lengths, slots: int) -> tuple:
  """(steps, slot utilisation) of the continuous engine decoding rows of
  ``lengths`` (in order) through ``slots`` slots, a slot taking the next row as
  soon as its row stops (staged rows: no wait for a window to end). Utilisation
  = tokens / (slot-steps of min(slots, rows) slots)."""
  lengths = [int(x) for x in lengths]
  if not lengths:
    return 0, 0.0
  s = max(1, min(int(slots), len(lengths)))
  free = [0] * s
  end = 0
  for length in lengths:
    t = heapq.heappop(free) + length
    end = max(end, t)
    heapq.heappush(free, t)
  return end, sum(lengths) / (s * end)


# ----------------------------------------------------------------------------- roofline


# ASSUMED, to be replaced by a measurement on a TPU (the engine's decode window at
# a few rows, divided by its steps): what one decode step of an 8B-class model
# costs beyond the bytes it reads and the FLOPs it computes: kernel launches, the
# tensor-parallel all-reduces' latency (two per layer), sampling, the loop.
ASSUMED_DECODE_STEP_FIXED_S = 2e-3


@dataclasses.dataclass(frozen=True)
class DecodeCost:
  """What a decode step costs besides its HBM reads and FLOPs: ``fixed_s`` per step
  (e.g. :data:`ASSUMED_DECODE_STEP_FIXED_S`), and, with ``ici_bytes_per_s`` > 0
  (one direction, per device), the FSDP all-gather of the weights every step
  (:func:`decode_weight_bytes`). The default adds nothing: the roofline's
  lower bound."""
  fixed_s: float = 0.0
  ici_bytes_per_s: float = 0.0


def decode_weight_bytes(model_cfg, mesh_shape) -> tuple:
  """(HBM bytes, gathered bytes) of weights one device moves per decode step on a
  mesh of ``mesh_shape`` ({axis: size}, or a Mesh's ``.shape``): it reads its
  tensor-parallel share of all weights (1 / tensor of them), and, when they are
  FSDP-sharded, first receives the (fsdp - 1) / fsdp of that share it does not
  hold (the ``data`` axis replicates them: no gather)."""
  n = qwen.count_params(qwen.abstract_params(model_cfg))
  share = n * jnp.dtype(model_cfg.compute_dtype).itemsize / mesh_shape.get("tensor", 1)
  fsdp = mesh_shape.get("fsdp", 1)
  return share, share * (fsdp - 1) / fsdp


def kv_bytes_per_position(model_cfg) -> int:
  """Bytes of one position's keys and values over every layer (``compute_dtype``)."""
  per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
  return per_token * jnp.dtype(model_cfg.compute_dtype).itemsize


def decode_step_cost(model_cfg, chip: ChipSpec) -> tuple:
  """(fixed seconds per decode step, seconds per KV position read) of a
  memory-bound decode step of ``model_cfg`` on one ``chip`` at its HBM bandwidth:
  every weight read once per step, whatever its rows, then the keys and values of
  each position a generated token attends to. The per-step cost a schedule's
  critical-path counts (``EngineStats.decode_steps`` / ``kv_reads``) are priced
  with: an assumption (no launch overhead, no compute term, no
  tensor parallelism), not a measurement."""
  bw = chip.hbm_bandwidth / chip.devices_per_chip
  weights = qwen.count_params(qwen.abstract_params(model_cfg))
  weights *= jnp.dtype(model_cfg.compute_dtype).itemsize
  return weights / bw, kv_bytes_per_position(model_cfg) / bw


def _kv_bytes_per_device(model_cfg, mesh, rows: int, ctx: float) -> float:
  per_token = kv_bytes_per_position(model_cfg)
  shards = sh.batch_shard_count(mesh) * min(mesh.shape["tensor"], model_cfg.num_kv_heads)
  return rows * ctx * per_token / shards


def _step_time(model_cfg, mesh, chip, n_dev: int, computed_rows: float, live_rows: float,
               ctx: float, cost: DecodeCost = DecodeCost()) -> tuple:
  """(seconds, bound) of one decode step that computes ``computed_rows`` rows and
  reads the KV cache of ``live_rows`` rows of ``ctx`` keys each: ``cost.fixed_s``
  + the largest of its HBM reads (weights + KV) at HBM bandwidth, its FLOPs at the
  bf16 peak and (``cost.ici_bytes_per_s``) its weight gathers over ICI."""
  peak = chip.peak_bf16_flops / chip.devices_per_chip  # per JAX device
  bw = chip.hbm_bandwidth / chip.devices_per_chip
  weights, gathered = decode_weight_bytes(model_cfg, mesh.shape)
  times = {"memory": (weights + _kv_bytes_per_device(model_cfg, mesh, live_rows, ctx)) / bw,
           "compute": decode_flops(model_cfg, computed_rows, ctx) / n_dev / peak}
  if cost.ici_bytes_per_s:
    times["weight gather"] = gathered / cost.ici_bytes_per_s
  bound = max(times, key=times.get)
  return cost.fixed_s + times[bound], bound


def static_estimate(model_cfg, mesh, chip, shape, lengths: ResponseLengths) -> dict:
  """A static-sampler call (``shapes.SamplerShape``): every chunk prefills its
  prompts, then decodes all its rows until its longest row stops (E[max] steps),
  each step reading every row's cache (finished rows included)."""
  n_dev = mesh.size
  peak = chip.peak_bf16_flops / chip.devices_per_chip
  r, p = shape.max_new_tokens, shape.prompt_len
  out = {"calls": len(shape.chunks or (shape.prompts,)), "rows_per_call": shape.rows,
         "prefill_s": 0.0, "decode_s": 0.0, "steps": 0.0}
  for c in shape.chunks or (shape.prompts,):
    rows = c * shape.n
    steps = lengths.expected_max(rows, r)
    per, bound = _step_time(model_cfg, mesh, chip, n_dev, rows, rows, p + steps / 2)
    pre = analytic_flops(model_cfg, kind="sample", rows=c, prompts=c, prompt_len=p,
                         response_len=1)
    out["prefill_s"] += pre / (n_dev * peak)
    out["decode_s"] += steps * per
    out["steps"] += steps
    out.update(step_s=per, bound=bound)
  out["total_s"] = out["prefill_s"] + out["decode_s"]
  return out


def continuous_estimate(model_cfg, mesh, chip, shape, lengths: ResponseLengths, *,
                        cost: DecodeCost = DecodeCost(), slots: int = 0,
                        drain: bool = True) -> dict:
  """An engine call (``shapes.EngineShape``): the prompts prefilled once, then
  ``slots`` slots (default ``shape.slots``) decode the call's rows, refilled as
  rows stop; a step computes every slot and reads the caches of the live rows
  (slots x utilisation on average, each at the mean context of a generated
  token), at ``cost`` (:class:`DecodeCost`) per step.

  * ``drain=True``: the call ends when its last row stops (:func:`engine_schedule`
    over :meth:`ResponseLengths.sample`: the longest rows decide the tail);
  * ``drain=False``: generation that never drains (the rows of the next calls
    take the freed slots): every slot busy, the call's decode steps are its
    tokens over the slots."""
  n_dev = mesh.size
  peak = chip.peak_bf16_flops / chip.devices_per_chip
  r, p, rows = shape.max_new_tokens, shape.prompt_len, shape.rows
  slots = int(slots or shape.slots)
  lens = lengths.sample(rows, r)
  if drain:
    steps, util = engine_schedule(lens, slots)
  else:
    steps, util = float(np.sum(lens)) / slots, 1.0
  computed = min(slots, rows) if drain else slots
  ctx = p + float(np.sum(lens.astype(np.float64) ** 2) / (2 * np.sum(lens)))
  per, bound = _step_time(model_cfg, mesh, chip, n_dev, computed, computed * util, ctx, cost)
  pre = analytic_flops(model_cfg, kind="sample", rows=shape.prompts, prompts=shape.prompts,
                       prompt_len=p, response_len=1)
  out = {"slots": slots, "rows": rows, "steps": float(steps), "slot_util": util,
         "step_s": per, "bound": bound, "prefill_s": pre / (n_dev * peak),
         "decode_s": steps * per}
  out["total_s"] = out["prefill_s"] + out["decode_s"]
  return out


def roofline(model_cfg, mesh, chip: ChipSpec, sampler_shapes: dict, reports: dict, *,
             engine_shapes: dict | None = None, engine: str = "static",
             lengths: ResponseLengths = RESPONSE_LENGTHS) -> dict:
  """Lower bounds on time from the analytic FLOPs (at the chip's bf16 peak) and
  the bytes a decode step must read (at its HBM bandwidth), for the sampler
  calls ``sampler_shapes`` (``fbos_jax.rl.shapes.sampler_shapes``: the static
  sampler) and ``engine_shapes`` (``shapes.engine_shapes``: the continuous
  engine) under the response lengths ``lengths``, and the compiled update in
  ``reports``. Both samplers are estimated; the step uses ``engine`` (the run's
  ``sampling.engine``). Not a measurement."""
  n_dev = mesh.size
  peak = chip.peak_bf16_flops / chip.devices_per_chip  # per JAX device
  out: dict[str, Any] = {"chip": chip.name, "peak_bf16_flops_per_chip": chip.peak_bf16_flops,
                         "hbm_bandwidth_per_chip": chip.hbm_bandwidth, "engine": engine,
                         "lengths": dataclasses.asdict(lengths)}
  step = {"static": 0.0, "continuous": 0.0}
  useful = 0.0
  for name, s in sampler_shapes.items():
    est = {"static": static_estimate(model_cfg, mesh, chip, s, lengths),
           "max_new_tokens": s.max_new_tokens, "prompt_len": s.prompt_len,
           "rows": s.n * sum(s.chunks or (s.prompts,)),
           "mean_len": lengths.mean(s.max_new_tokens),
           "length_model": lengths.describe(s.max_new_tokens)}
    if engine_shapes and name in engine_shapes:
      est["continuous"] = continuous_estimate(model_cfg, mesh, chip, engine_shapes[name], lengths)
    chosen = est.get(engine, est["static"])
    est["total_s"] = chosen["total_s"]
    out[name] = est
    if name.startswith("sample"):
      for k in step:
        step[k] += est.get(k, est["static"])["total_s"]
      useful += decode_flops(model_cfg, est["rows"] * est["mean_len"],
                             s.prompt_len + est["mean_len"] / 2)
  upd = reports.get("update")
  if upd is not None:  # its FLOPs already count every epoch and mini-batch
    t = upd.flops / (n_dev * peak)
    out["update"] = {"total_s": t}
    layouts = getattr(upd, "flops_by_layout", None)
    if layouts:  # the padded and the packed update side by side
      out["update"].update(layouts, padded_s=layouts["padded"] / (n_dev * peak),
                           packed_s=layouts["packed"] / (n_dev * peak))
    for k in step:
      step[k] += t
    useful += upd.flops
  out["step_s"] = step.get(engine, step["static"])
  out["step_s_static"] = step["static"]
  out["step_s_continuous"] = step["continuous"] if engine_shapes else None
  out["mfu_bound"] = useful / (out["step_s"] * n_dev * peak) if out["step_s"] else 0.0
  if "padded_s" in out.get("update", {}):
    u = out["update"]
    out["step_s_by_update"] = {k: out["step_s"] - u["total_s"] + u[f"{k}_s"]
                               for k in ("padded", "packed")}
  return out
