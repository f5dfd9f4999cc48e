"""The package's structure: no import cycles (lazy imports included), no backend named in the
planner or the rules, built-in rules that a user's own `fusion_rules` module cannot shadow."""

import ast
import pathlib
import subprocess
import sys

import te_fused_ops as tfo

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "te_fused_ops"
RULES = ROOT / "fusion_rules"


def _modules() -> dict:
    """Module name -> source path, the rules under their installed name."""
    found = {}
    for base, prefix in ((PACKAGE, "te_fused_ops"), (RULES, "te_fused_ops.fusion_rules")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """Modules of the package that ``name`` imports anywhere in its source (functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & set(modules)
            targets.update(submodules)
            if len(submodules) < len(node.names):  # some names are attributes of ``base`` itself
                targets.add(base)
    return {t for t in targets if t in modules and t != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_planner_runner_and_rules_name_no_backend():
    names = set(tfo.backend_names())
    paths = [PACKAGE / f for f in ("fusion.py", "runner.py", "call.py", "sequential.py", "custom_ops.py")]
    paths += sorted(RULES.glob("*.py"))
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                words = set(node.value.replace("'", " ").replace('"', " ").replace("`", " ").split())
                # "torch" is also the library's name in prose: only a string that is exactly it counts
                assert node.value not in names and not words & (names - {"torch"}), (
                    f"{path.name}: backend name in {node.value!r}")


def test_every_builtin_rule_has_a_reference_and_no_backend_guard():
    for rule in tfo.list_rules():
        assert rule.reference is not None, rule.name
        assert not rule.implementations, f"{rule.name}: backend implementations belong to the backend packages"


def test_user_fusion_rules_module_does_not_shadow_the_builtin_rules(tmp_path):
    (tmp_path / "fusion_rules.py").write_text("raise RuntimeError('the user module was imported')\n")
    expected = sorted(rule.name for rule in tfo.list_rules())
    code = ("import sys, te_fused_ops as t\n"
            "assert 'fusion_rules' not in sys.modules\n"
            "print(sorted(r.name for r in t.list_rules()))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(expected)
    assert len(expected) == 14


def test_a_new_backend_is_a_package_and_its_implementations(monkeypatch):
    """A backend registered from outside (here: a test 'package') is planned, explained and
    forced by name with no edit to the planner or the rules; removing it restores the plan."""
    import torch

    from te_fused_ops.backends import Backend, register_backend, unregister_backend
    from te_fused_ops.fusion import get_rule

    calls = []
    fake = Backend("fake", unavailable_reason=lambda info: None if info.device_type == "cpu" else "cpu only",
                   preference=5)

    @fake.implement("grouped_linear+activation", supports=lambda ops, info: None if ops[1].glu else "GLU only")
    def _forward(ops, ctxs, x):
        calls.append(len(ops))
        return get_rule("grouped_linear+activation").reference(ops, ctxs, x)

    register_backend(fake)
    try:
        assert "fake" in tfo.backend_names() and "fake" in tfo.env.markdown_table()
        seq = tfo.Sequential(tfo.GroupedLinear(2, 8, 16), tfo.SwiGLU(), tfo.GroupedLinear(2, 8, 8))
        x, split_sizes = torch.randn(6, 8), torch.tensor([2, 3])
        text = seq.explain(x, split_sizes=split_sizes)
        assert "[0:2] GroupedLinear, SwiGLU -> rule 'grouped_linear+activation' (backend fake)" in text, text
        assert "[2] GroupedLinear -> rule 'grouped_linear' (backend torch)" in text, text
        seq(x, split_sizes=split_sizes)
        assert calls == [2]
        srelu = tfo.Sequential(tfo.GroupedLinear(2, 8, 8), tfo.SReLU())
        assert "fake backend: GLU only" in srelu.explain(x, split_sizes=split_sizes)
        monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "fake")  # forced: rules without a fake implementation don't run
        text = seq.explain(x, split_sizes=split_sizes)
        assert "[0:2] GroupedLinear, SwiGLU -> rule 'grouped_linear+activation' (backend fake)" in text, text
        assert "[2] GroupedLinear -> basic op" in text, text
        monkeypatch.delenv("TE_FUSED_OPS_BACKEND")
    finally:
        unregister_backend("fake")
    assert "fake" not in tfo.backend_names()
    text = seq.explain(x, split_sizes=split_sizes)  # the cached plan is not reused
    assert "[0:2] GroupedLinear, SwiGLU -> rule 'grouped_linear+activation' (backend torch)" in text, text


def test_a_backends_helper_kernels_serve_the_library_bookkeeping():
    """A backend's helper kernels (by name in ``helpers``) take the split offsets, the routing and
    the router probabilities' moves to the expert rows and back where they return a value; one
    returning None leaves the next backend's or the torch ops. The routed ScaledSwiGLU layer gives
    the same output and gradients either way (here the helpers wrap the torch ops, in float32)."""
    import torch

    from te_fused_ops import routing
    from te_fused_ops.backends import Backend, register_backend, unregister_backend

    calls = []

    def helper(name, fn):
        def run(*args):
            calls.append(name)
            return fn(*args)
        return run

    def layer_step():
        torch.manual_seed(0)
        seq = tfo.Sequential(tfo.Permute(4), tfo.GroupedLinear(4, 8, 16), tfo.ScaledSwiGLU(),
                             tfo.GroupedLinear(4, 8, 8), tfo.Unpermute())
        x = torch.randn(10, 8, requires_grad=True)
        indices = torch.randint(0, 4, (10, 2))
        indices[::3, 1] = -1
        probs = torch.rand(10, 2, dtype=torch.bfloat16, requires_grad=True)
        y = seq(x, indices=indices, probs=probs)
        y.backward(torch.randn_like(y))
        return [y.detach(), x.grad, probs.grad, *(p.grad for p in seq.parameters())]

    plain = layer_step()
    fake = Backend("fake", unavailable_reason=lambda info: "helpers only", preference=5, helpers={
        "split_offsets": helper("split_offsets", lambda sizes, num_rows: None),  # declines: torch ops
        "route": helper("route", lambda indices, e: tuple(vars(routing.route_torch(indices, e)).values())),
        "slots_to_rows": helper("slots_to_rows", routing.slots_to_rows_torch),
        "rows_to_slots": helper("rows_to_slots", routing.rows_to_slots_torch),
    })
    register_backend(fake)
    try:
        got = layer_step()
        assert {"route", "slots_to_rows", "rows_to_slots"} <= set(calls), calls
        assert got[2].dtype == torch.bfloat16
        for a, b in zip(got, plain):
            assert torch.equal(a, b)
        calls.clear()
        assert tfo.splits.split_offsets(torch.tensor([2, 3]), 6).tolist() == [0, 2, 5]
        assert calls == ["split_offsets"]
    finally:
        unregister_backend("fake")
