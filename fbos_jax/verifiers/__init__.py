"""Verifiers: reward + natural-language feedback for each response.

Public API (see ``base.py`` for the protocol)::

  from fbos_jax import verifiers
  verify = verifiers.make_verifier(config.data)           # or get_verifier("math"),
                                                          # "ifeval", "code", "pkg.mod:attr"
  with verifiers.VerifierPool(verify, num_workers=8, timeout_s=10) as pool:
    verdicts, stats = pool.run(examples, responses)       # Verdict(reward, feedback, info, error)
  # or, from the config sections (workers, timeout_s, backend, reward_range):
  pool = verifiers.make_verifier_pool(config.data, config.verifier)
  errors = [v.is_error for v in verdicts]                 # leave these rows out of groups

The built-in verifier modules (``procedural``, ``math``, ``ifeval``, ``code``)
are imported lazily by ``get_verifier`` so that importing this package stays
cheap.
"""

from fbos_jax.verifiers.base import AUTO
from fbos_jax.verifiers.base import check_reward_range
from fbos_jax.verifiers.base import CORRECT_FEEDBACK
from fbos_jax.verifiers.base import coerce_verdict
from fbos_jax.verifiers.base import DispatchVerifier
from fbos_jax.verifiers.base import error_verdict
from fbos_jax.verifiers.base import get_verifier
from fbos_jax.verifiers.base import list_verifiers
from fbos_jax.verifiers.base import make_verifier
from fbos_jax.verifiers.base import make_verifier_pool
from fbos_jax.verifiers.base import register_verifier
from fbos_jax.verifiers.base import required_fields
from fbos_jax.verifiers.base import Verdict
from fbos_jax.verifiers.base import Verifier
from fbos_jax.verifiers.base import VerifierPool

__all__ = [
    "AUTO",
    "check_reward_range",
    "CORRECT_FEEDBACK",
    "coerce_verdict",
    "DispatchVerifier",
    "error_verdict",
    "get_verifier",
    "list_verifiers",
    "make_verifier",
    "make_verifier_pool",
    "register_verifier",
    "required_fields",
    "Verdict",
    "Verifier",
    "VerifierPool",
]
