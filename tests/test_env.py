"""Environment switches: validated at use time, one table in the README and in help(te_fused_ops)."""

import pathlib

import pytest
import torch

import te_fused_ops as tfo
from te_fused_ops import GroupedLinear, Sequential, SwiGLU, env
from te_fused_ops.backends import backend_names
from te_fused_ops.fusion import forced_backend, fusion_enabled_by_env
from te_fused_ops.splits import validation_enabled

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SPLITS = torch.tensor([3, 0, 2])


@pytest.mark.parametrize("raw, expected", [("", True), ("0", False), ("off", False), ("OFF", False),
                                           ("False", False), ("1", True), ("On", True), (" true ", True)])
def test_fusion_flag_values(monkeypatch, raw, expected):
    monkeypatch.setenv("TE_FUSED_OPS_FUSION", raw)
    assert fusion_enabled_by_env() is expected


def test_fusion_off_runs_unfused(monkeypatch):
    seq = Sequential(GroupedLinear(3, 8, 8), SwiGLU())
    monkeypatch.setenv("TE_FUSED_OPS_FUSION", "off")
    assert all(step.rule is None for step in seq.plan(torch.randn(5, 8), split_sizes=SPLITS).forward)


@pytest.mark.parametrize("name", ["TE_FUSED_OPS_FUSION", "TE_FUSED_OPS_COMPILE", "TE_FUSED_OPS_VALIDATE"])
def test_bad_flag_lists_accepted_values(monkeypatch, name):
    monkeypatch.setenv(name, "yes please")
    with pytest.raises(ValueError, match=rf"environment variable {name} must be one of 1, 0, true, false, on, off"):
        env.read(name)


def test_backend_typo_raises_on_call(monkeypatch):
    seq = Sequential(GroupedLinear(3, 8, 8), SwiGLU())
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torhc")
    with pytest.raises(ValueError, match=r"TE_FUSED_OPS_BACKEND must be one of sm90, torch, or empty, got 'torhc'"):
        seq(torch.randn(5, 8), split_sizes=SPLITS)
    for name in backend_names():
        monkeypatch.setenv("TE_FUSED_OPS_BACKEND", name)
        assert forced_backend() == name
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", " ")
    assert forced_backend() is None


def test_validate_switch(monkeypatch):
    monkeypatch.setenv("TE_FUSED_OPS_VALIDATE", "ON")
    assert validation_enabled()
    monkeypatch.setenv("TE_FUSED_OPS_VALIDATE", "2")
    with pytest.raises(ValueError, match="TE_FUSED_OPS_VALIDATE must be one of"):
        validation_enabled()
    monkeypatch.delenv("TE_FUSED_OPS_VALIDATE")
    assert not validation_enabled()


@pytest.mark.parametrize("raw, expected", [("", 0), ("4", 4), ("-1", None), ("two", None)])
def test_sm_margin_values(monkeypatch, raw, expected):
    monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", raw)
    if expected is None:
        with pytest.raises(ValueError, match=r"fn: environment variable TE_FUSED_OPS_SM_MARGIN must be an integer >= 0"):
            env.read("TE_FUSED_OPS_SM_MARGIN", "fn")
    else:
        assert env.read("TE_FUSED_OPS_SM_MARGIN") == expected


def test_unknown_variable_or_bad_value_warns_at_import(monkeypatch):
    monkeypatch.setenv("TE_FUSED_OPS_BACKENDS", "torch")
    with pytest.warns(UserWarning, match="unknown environment variable.*TE_FUSED_OPS_BACKENDS"):
        env.warn_about_environment()
    monkeypatch.delenv("TE_FUSED_OPS_BACKENDS")
    monkeypatch.setenv("TE_FUSED_OPS_COMPILE", "bogus")  # read on CUDA paths alone: named at import
    with pytest.warns(UserWarning, match="environment variable TE_FUSED_OPS_COMPILE must be one of 1, 0"):
        env.warn_about_environment()


def test_every_switch_documented_in_readme_and_help():
    """help(te_fused_ops) carries the full table; the README names every switch."""
    table = env.markdown_table()
    assert table in tfo.__doc__
    readme = README.read_text()
    for name in env.SWITCHES:
        assert f"`{name}`" in table
        assert f"`{name}" in readme, f"README does not mention {name}"


def test_library_reads_only_known_switches():
    """Every TE_FUSED_OPS_ variable named in the package source is a switch of the env table."""
    import re

    root = pathlib.Path(tfo.__file__).parent
    named = set()
    for path in root.rglob("*.py"):
        named |= set(re.findall(r"TE_FUSED_OPS_[A-Z_]+[A-Z]", path.read_text()))
    assert named <= set(env.SWITCHES), named - set(env.SWITCHES)


def test_sm90_sm_margin_follows_os_environ(monkeypatch):
    # the sm90 backend reads the switch at every call and hands it to the kernels (which read no
    # environment): every change through os.environ must show
    from te_fused_ops.backends.sm90.backend import sm_margin

    monkeypatch.delenv("TE_FUSED_OPS_SM_MARGIN", raising=False)
    assert sm_margin() == 0
    monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", "8")
    assert sm_margin() == 8
    monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", "16")
    assert sm_margin() == 16
    monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", "-1")
    with pytest.raises(ValueError, match="TE_FUSED_OPS_SM_MARGIN must be an integer >= 0"):
        sm_margin()
    monkeypatch.delenv("TE_FUSED_OPS_SM_MARGIN")
    assert sm_margin() == 0


def test_settings_of_plan_override_the_environment_within(monkeypatch):
    """Inside `settings_of_plan` the plan switches read as the plan's settings (both `read` and
    the hot switches), other switches and everything after it as the environment says."""
    monkeypatch.delenv("TE_FUSED_OPS_SM_MARGIN", raising=False)
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "0")
    made_under = env.plan_settings()
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "wgrad")
    assert env.plan_settings() == ("wgrad",)
    with env.settings_of_plan(made_under):
        assert env.read("TE_FUSED_OPS_GATHER_ROWS") is False
        assert env.plan_settings() == (False,)
        assert env.read("TE_FUSED_OPS_SM_MARGIN") == env.SWITCHES["TE_FUSED_OPS_SM_MARGIN"].default
        with env.settings_of_plan(()):
            assert env.read("TE_FUSED_OPS_GATHER_ROWS") == "wgrad"
    assert env.read("TE_FUSED_OPS_GATHER_ROWS") == "wgrad" and env.plan_settings() == ("wgrad",)

