"""Kernel backends: one package per backend, each registering itself."""
