"""The torch backend: each rule's reference implementation and the basic ops' own forward and
backward, in torch, on every device. The least preferred backend, and the yardstick of the others."""

from .. import Backend, register_backend

TORCH = register_backend(Backend("torch", unavailable_reason=lambda info: None, preference=100, runs_reference=True))
