"""cudelta: delta-rule linear-attention decode kernels (Gated DeltaNet, Kimi Delta Attention).

The native library loads on first use of a CUDA op; `python -m cudelta` reports what runs where.
"""

from importlib.metadata import PackageNotFoundError, version as _version

from .fla_compat import fused_recurrent_gated_delta_rule
from .ops import NotSupportedOnCUDAError, gdn_decode, kda_decode
from .reference import gdn_decode_reference, gdn_gate, kda_decode_reference, kda_gate

try:
    __version__ = _version("cudelta")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+source"

__all__ = ["gdn_decode", "kda_decode", "NotSupportedOnCUDAError", "fused_recurrent_gated_delta_rule", "gdn_decode_reference", "kda_decode_reference", "gdn_gate", "kda_gate", "__version__"]
