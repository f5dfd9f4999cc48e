"""The sm90 backend: CuTe DSL kernels for Hopper."""
