"""Layering (docs/architecture.md): every module of the package imports on its own in a fresh
interpreter, no module-level import cycle exists, the engine (scheduler/) never imports the user
surface, and importing one engine module loads only what it imports."""

import ast
import subprocess
import sys
from pathlib import Path

import infini_dist

ROOTS = {"infini_dist": Path(infini_dist.__file__).parent,
         "infini_dist.scheduler": Path(infini_dist.__file__).parent.parent / "scheduler",
         "infini_dist.kernels": Path(infini_dist.__file__).parent.parent / "kernels",
         "infini_dist.launch": Path(infini_dist.__file__).parent.parent / "launch"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "infini_dist" and parts and parts[0] in ("scheduler", "kernels",
                                                                   "launch"):
                continue
            found[".".join((package,) + parts)] = path
    return found


def _top_level_imports(name: str, path: Path, known) -> set[str]:
    """The package's modules `name` imports when it is imported (not inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                edges.add(target if target in known else base)
    # Importing pkg.sub runs pkg/__init__.py first: a cycle through a package's __init__ counts
    # (a module inside the package finds its package already initialised).
    for target in list(edges):
        parts = target.split(".")
        edges |= {".".join(parts[:i]) for i in range(2, len(parts))
                  if not name.startswith(".".join(parts[:i]) + ".")}
    return {e for e in edges if e in known and e != name}


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _top_level_imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_engine_never_imports_the_user_surface():
    modules = _modules()
    surface = ("infini_dist.config", "infini_dist.ops", "infini_dist.ops_autograd",
               "infini_dist.compile", "infini_dist.fusion", "infini_dist.serving",
               "infini_dist.launch")
    wrong = []
    for name, path in modules.items():
        if not name.startswith("infini_dist.scheduler"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports too
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names])
                wrong += [(name, n) for n in names if n.startswith(surface)]
    assert not wrong, wrong


_CHILD = r"""
import importlib, os, sys
import torch  # once, before the forks: every child starts from the same clean state
# torch's own compiler stack too (not the package's: `torch._dynamo` and `torch._inductor` load
# lazily on first use of the attribute anyway): importing it was ~5 s of each child's import
import torch._dynamo, torch._inductor
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            importlib.import_module(name)
        except BaseException as error:
            print(f"{name}: {type(error).__name__}: {error}", file=sys.stderr)
            code = 2
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append((name, os.waitstatus_to_exitcode(status)))
print(failed)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_on_its_own():
    """Each in a fresh child (forked after importing torch and its compiler stack): a module
    that needs another of the package to be imported first, or that sits in a cycle broken by
    import order, fails here."""
    names = [n for n in _modules() if not n.endswith("__main__")]
    run = subprocess.run([sys.executable, "-c", _CHILD, *names], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]


def test_one_engine_module_loads_alone():
    """scheduler/__init__.py imports nothing: the IR does not bring the engine or a backend."""
    code = ("import sys, infini_dist.scheduler.ir, infini_dist.scheduler.buckets; "
            "print(sorted(m for m in sys.modules if m.startswith('infini_dist.scheduler')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "engine" not in out and "torch_fused" not in out and "backends" not in out, out
