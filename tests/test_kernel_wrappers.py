"""CPU checks of the sm90 kernel wrappers' pure-python parts: activation registry, SM margin,
the launch that reruns the checks when the compiled entry rejects an argument."""

import pytest
import torch

from te_fused_ops import activations
from te_fused_ops.backends.sm90.kernels import grouped_gemm
from te_fused_ops.backends.sm90.kernels.grouped_gemm import max_clusters
from te_fused_ops.backends.sm90.kernels.launch import resolve_sm_margin


def test_one_activation_registry():
    reg = activations.ACTIVATIONS
    assert set(reg) == {"swiglu", "geglu", "srelu", "clamped_swiglu", "scaled_swiglu"}
    assert [n for n, s in reg.items() if not s.glu] == ["srelu"]
    assert [n for n, s in reg.items() if s.takes_probs] == ["scaled_swiglu"]
    assert reg["clamped_swiglu"].constants == ("limit", "alpha")
    assert all(name == spec.name for name, spec in reg.items())
    # the wrapper module keeps no activation list of its own
    assert not hasattr(grouped_gemm, "GLU_ACTIVATIONS")
    assert grouped_gemm.ACTIVATIONS is reg
    assert activations.activation_spec(None, "f") is None
    with pytest.raises(ValueError, match="f: activation must be None or one of"):
        activations.activation_spec("relu", "f")


def test_sm_margin(monkeypatch):
    """The wrappers read no environment: None is 0 (the sm90 backend passes TE_FUSED_OPS_SM_MARGIN)."""
    monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", "8")
    assert resolve_sm_margin(None, "fn") == 0
    assert resolve_sm_margin(16, "fn") == 16
    with pytest.raises(ValueError, match="fn: sm_margin must be >= 0"):
        resolve_sm_margin(-2, "fn")
    with pytest.raises(TypeError, match="fn: sm_margin must be an int"):
        resolve_sm_margin(1.0, "fn")
    with pytest.raises(TypeError, match="fn: sm_margin must be an int"):
        resolve_sm_margin(True, "fn")


def test_max_clusters():
    assert max_clusters(132, 0, 2) == 66
    assert max_clusters(132, 16, 2) == 58
    assert max_clusters(132, 17, 2) == 57
    assert max_clusters(132, 16, 1) == 116
    assert max_clusters(132, 200, 2) == 1  # at least one cluster


def test_a_rejected_launch_reruns_the_checks_for_a_named_error():
    def rejecting_entry(*args):
        raise RuntimeError("Mismatched type on argument #3")

    def named_checks(arg):
        raise ValueError(f"grouped_gemm_sm90: {arg} must be contiguous")

    x = torch.zeros(2)
    # the compiled entries take the activation constants as one structure (registry order)
    constants = activations.activation_constants("grouped_gemm_sm90", {"limit": 7, "alpha": 1})
    with pytest.raises(ValueError, match="grouped_gemm_sm90: out must be contiguous"):
        grouped_gemm._run(rejecting_entry, True, named_checks, ("out",), (x, None), constants, 132)
    with pytest.raises(RuntimeError, match="argument #3"):  # checks pass: the entry's own error
        grouped_gemm._run(rejecting_entry, True, lambda: None, (), (x, None), constants, 132)
    launched = []
    grouped_gemm._run(lambda *args: launched.append(args), True, named_checks, ("x",), (x, None), constants, 132)
    grouped_gemm._run(None, True, named_checks, ("x",), (x,), constants, 132)  # M == 0: nothing launched or checked
    assert launched == [(x, None, (7.0, 1.0), 132)]
    assert all(isinstance(c, float) for c in launched[0][2])
