"""The sm90 backend: CuTe DSL kernels for Hopper (compute capability 9.0).

Importing it registers the backend (`backend.SM90`: availability, helper kernels) and its
implementations of the built-in rules (`rules`, `moe`). It needs neither cutlass nor a GPU to import:
what is missing becomes the reason the backend does not run.
"""

from . import moe, rules
from .backend import SM90

__all__ = ["SM90", "moe", "rules"]
