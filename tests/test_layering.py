"""The package's layering: folders follow the data flow, each layer imports only the layers below
it, no module or folder cycle (imports inside functions counted), and the planning half loads
neither torch nor transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "hf_cp"

# Lowest first. A unit is a top-level module or sub-package of hf_cp; the root utilities import
# nothing of hf_cp at module level.
LAYERS: List[Tuple[str, ...]] = [
    ("resources", "figures", "registration", "readers"),
    ("samples",),
    ("modes",),
    ("plan",),
    ("cost",),
    ("balance",),
    ("planning",),
    ("attention",),
    ("profiling",),
    ("data_prep",),
    ("data",),
    ("train",),
    ("report",),
    ("cli", "recipes"),  # recipes: the scripts shipped beside the accelerate configs (trl_sft.py)
    ("__init__", "__main__"),
]
# hf_cp/train/'s rooms (and its top-level modules), lowest first: the same rule inside train/
TRAIN_LAYERS: List[Tuple[str, ...]] = [
    ("checks",),  # what is refused at set-up
    ("checkpoint",),
    ("data",),
    ("step",),
    ("measure",),
    ("setup",),
    ("runtime",),
    ("trainer",),
    ("objectives",),
    ("launch",),
    ("__init__", "__main__"),
]
PLANNING_HALF = ("samples", "modes", "plan", "cost", "balance", "planning")
# An import inside a function defers one of these (named in a comment on its line); never a cycle.
HEAVY = (
    "torch",
    "transformers",
    "datasets",
    "deepspeed",
    "accelerate",
    "matplotlib",
    "trl",
    "megatron",
    "mtkahypar",
    "highspy",
)


def _modules(root: Path) -> Dict[str, Tuple[Path, bool]]:
    out = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for sub in node.body:
                skip.update(id(n) for n in ast.walk(sub))
    return skip


def _resolve(target: str, mods) -> str:
    while target not in mods and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def import_graph(root: Path = PACKAGE):
    """module -> {imported hf_cp modules}, and the in-function imports as (module, line, source line)."""
    mods = _modules(root)
    edges: Dict[str, Set[str]] = defaultdict(set)
    deferred = []
    for name, (path, is_pkg) in mods.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text)
        skip = _type_checking_nodes(tree)
        in_function = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(node) if n is not node)
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = base[: len(base) - node.level + 1]
                    module = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from package import submodule` names the submodule, anything else the module
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            ours = {_resolve(t, mods) for t in targets if t.split(".")[0] == root.name}
            ours.discard(name)
            edges[name].update(ours)
            if ours and id(node) in in_function:
                deferred.append((name, node.lineno, lines[node.lineno - 1].strip()))
    return mods, edges, deferred


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def strongly_connected(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's components with more than one member."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def room_of(module: str) -> str:
    """The room of a module of hf_cp.train (its sub-package, or its own name at train/'s top)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def _unit_problems(edges, modules, layers, unit, what: str) -> List[str]:
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    problems = [f"unit {u} is in no layer of {what}" for u in sorted({unit(m) for m in modules} - set(rank))]
    unit_edges: Dict[str, Set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if a not in modules or b not in modules:
                continue
            ua, ub = unit(a), unit(b)
            if ua != ub:
                unit_edges[ua].add(ub)
                if ua in rank and ub in rank and rank[ub] > rank[ua]:
                    problems.append(f"upward import: {a} ({ua}) imports {b} ({ub}), a higher layer")
    for comp in strongly_connected(unit_edges):
        problems.append(f"folder cycle: {' -> '.join(comp)}")
    return problems


def layering_problems(root: Path = PACKAGE) -> List[str]:
    mods, edges, deferred = import_graph(root)
    problems = []
    for comp in strongly_connected(edges):
        problems.append(f"module cycle: {' -> '.join(comp)}")
    problems += _unit_problems(edges, set(mods), LAYERS, unit_of, "LAYERS")
    train = {m for m in mods if m.startswith(f"{root.name}.train.")}
    problems += _unit_problems(edges, train, TRAIN_LAYERS, room_of, "TRAIN_LAYERS")
    for module, line, source in deferred:
        comment = source.partition("#")[2]
        if not any(h in comment for h in HEAVY):
            problems.append(
                f"{module}:{line}: an import inside a function must defer a heavy dependency named in a comment "
                f"({', '.join(HEAVY)}): {source}"
            )
    return problems


def test_layers_import_only_layers_below_and_no_cycles():
    problems = layering_problems()
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_upward_import_and_a_cycle(tmp_path):
    # a copy of the package with one upward import added (plan -> balance) must fail
    import shutil

    copy = tmp_path / "hf_cp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    target = copy / "plan" / "cluster.py"
    target.write_text(target.read_text() + "\nfrom hf_cp.balance.registry import get_balancer  # noqa: E402\n")
    problems = layering_problems(copy)
    assert any("upward import: hf_cp.plan.cluster (plan) imports hf_cp.balance.registry" in p for p in problems), (
        problems
    )
    assert any(p.startswith("folder cycle") for p in problems), problems
    # and an import hidden in a function, without a heavy dependency to defer, is named
    target.write_text(target.read_text() + "\n\ndef f():\n    from hf_cp.samples import masks\n")
    assert any("import inside a function" in p for p in layering_problems(copy))


def test_the_planning_half_loads_neither_torch_nor_transformers():
    mods = sorted(m for m in _modules(PACKAGE) if unit_of(m) in PLANNING_HALF)
    assert len(mods) > 40, mods
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers'))\n"
        "print(len(bad)); print(bad[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0] == "0", out.stdout


def test_every_entry_point_registers_the_attention_with_transformers():
    code = (
        "import {first}\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "cfg = AutoConfig.for_model('llama', vocab_size=64, hidden_size=32, intermediate_size=64,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        "m = AutoModelForCausalLM.from_config(cfg, attn_implementation='hf_cp')\n"
        "print(m.config._attn_implementation)\n"
    )
    firsts = ("hf_cp", "hf_cp.train", "hf_cp.attention", "transformers, hf_cp.planning")
    # one fresh interpreter each, run side by side (each spends seconds importing torch)
    procs = {
        first: subprocess.Popen(
            [sys.executable, "-W", "error::UserWarning:hf_cp.registration", "-c", code.format(first=first)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for first in firsts
    }
    for first, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and out.strip().endswith("hf_cp"), (first, err[-2000:])


def test_the_check_catches_an_upward_import_between_train_rooms(tmp_path):
    # checks/ is train/'s lowest room: an import of the step executor from it must fail
    import shutil

    copy = tmp_path / "hf_cp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    assert layering_problems(copy) == []
    target = copy / "train" / "checks" / "setup.py"
    target.write_text(target.read_text() + "\nfrom hf_cp.train.step.executor import StepExecutor  # noqa: E402\n")
    problems = layering_problems(copy)
    assert any(
        "upward import: hf_cp.train.checks.setup (checks) imports hf_cp.train.step.executor (step)" in p
        for p in problems
    ), problems
    # a module in no room of TRAIN_LAYERS is named too
    (copy / "train" / "stray.py").write_text("")
    assert "unit stray is in no layer of TRAIN_LAYERS" in layering_problems(copy)
