"""The package layout: import graph without cycles or upward imports, and the public import paths (docs/architecture.md)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"shardsafe": "shardsafe", "adapters": "shardsafe.adapters", "kernels": "shardsafe.kernels"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in FOLDERS.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((pkg, *parts))
            out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = f
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the shardsafe modules it imports anywhere (module level and inside functions), except under
    ``if TYPE_CHECKING:``. A ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and "TYPE_CHECKING" in ast.dump(b.test)
                for n in ast.walk(b)}
        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        out = edges.setdefault(name, set())
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.ImportFrom) and n.module != "__future__":
                base = ".".join(pkg[: len(pkg) - n.level + 1] + ([n.module] if n.module else [])) if n.level \
                    else (n.module or "")
                for a in n.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                    if target in mods and target != name:
                        out.add(target)
            elif isinstance(n, ast.Import):
                out.update(a.name for a in n.names if a.name in mods and a.name != name)
    return edges


EDGES = _imports(_modules())


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        stack.pop()
        return []

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return []


def test_the_import_graph_has_no_cycle_also_counting_imports_inside_functions():
    assert len(EDGES) > 60, sorted(EDGES)   # the scan found the package
    assert _cycle(EDGES) == []


# Who may not import whom: each floor lists what lies above it. Entry points (cli, demo, export's command,
# runcheck) and adapters sit on top; the accounting beside everything, read through
# tor.events only.
_ABOVE_CORE = ("shardsafe.adapters", "shardsafe.cli", "shardsafe.demo", "shardsafe.demo_cli", "shardsafe.demo_shrink",
               "shardsafe.export", "shardsafe.runcheck")
RULES = {
    "shardsafe.env": ("*", ("shardsafe.errors",)),   # where the environment is read: the bottom, under everything (the hook imports it)
    "shardsafe.kernels": ("*", ("shardsafe.errors", "shardsafe.kernels", "shardsafe.env")),   # only these
    "shardsafe.errors": ("*", ()),
    "shardsafe.collectives": ("*", ()),
    "shardsafe.cliargs": ("*", ()),   # the launch commands parse with it before importing anything else
    "shardsafe.ordinals": ("*", ()),
    "shardsafe.payload": ("*", ("shardsafe.errors", "shardsafe.payload", "shardsafe.kernels", "shardsafe.env")),
    "shardsafe.faults": ("*", ("shardsafe.errors", "shardsafe.tor.events", "shardsafe.env")),
    "shardsafe.holder": ("*", ("shardsafe.errors", "shardsafe.holder", "shardsafe.payload", "shardsafe.persist",
                               "shardsafe.faults", "shardsafe.tor.events", "shardsafe.env")),
    "shardsafe.parity": ("not", ("shardsafe.snapshot", "shardsafe.runtime", "shardsafe.launch", "shardsafe.tor",
                                 *_ABOVE_CORE)),
    "shardsafe.snapshot": ("not", ("shardsafe.parity", "shardsafe.runtime", "shardsafe.launch", "shardsafe.tor",
                                   *_ABOVE_CORE)),
    "shardsafe.runtime": ("not", ("shardsafe.launch", *_ABOVE_CORE)),
    # beside the runtime: the agents import its notice and signal, and it drives the runtimes only inside functions
    "shardsafe.inplace": ("not", ("shardsafe.launch", "shardsafe.snapshot", "shardsafe.parity", *_ABOVE_CORE)),
    "shardsafe.launch": ("not", ("shardsafe.runtime", "shardsafe.snapshot", "shardsafe.parity", *_ABOVE_CORE)),
    "shardsafe.tor": ("not", ("shardsafe.holder", "shardsafe.snapshot", "shardsafe.parity", "shardsafe.runtime",
                              "shardsafe.launch", *_ABOVE_CORE)),
    "shardsafe.adapters": ("not", ("shardsafe.cli", "shardsafe.demo", "shardsafe.demo_cli", "shardsafe.demo_shrink",
                                   "shardsafe.launch", "shardsafe.export.replay")),
}


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("floor", sorted(RULES))
def test_no_upward_import(floor):
    kind, names = RULES[floor]
    bad = []
    for mod, targets in EDGES.items():
        if not _under(mod, (floor,)):
            continue
        for t in targets:
            if (kind == "*" and not _under(t, names)) or (kind == "not" and _under(t, names)):
                bad.append(f"{mod} -> {t}")
    assert not bad, f"{floor}: imports against the layering of docs/architecture.md: {sorted(bad)}"


@pytest.mark.parametrize("path", [
    "shardsafe.adapters.deepspeed:initialize", "shardsafe.adapters.deepspeed:DeepSpeedStateAdapter",
    "shardsafe.adapters.megatron:pretrain", "shardsafe.adapters.megatron:protect",
    "shardsafe.adapters.megatron:restore", "shardsafe.adapters.megatron:snapshot",
    "shardsafe.adapters.megatron:install_hooks", "shardsafe.adapters.megatron:add_arguments",
    "shardsafe.adapters.megatron:MegatronStateAdapter", "shardsafe.adapters.megatron:BaseRuntime",
    "shardsafe.parity:get_codec", "shardsafe.parity:InsufficientFragments",
    "shardsafe.export:apply_client_state", "shardsafe.export.sources:ExportError",
    "shardsafe.export.sources:open_source", "shardsafe.export.sources:open_holders",
    "shardsafe.launch.elastic:ElasticLauncher", "shardsafe.launch:LocalLauncher", "shardsafe.launch:LaunchConfig",
    "shardsafe.launch:preload_modules", "shardsafe.launch:PRELOAD_DEEPSPEED",
    "shardsafe.tor:compute_tor", "shardsafe.tor:EventLog", "shardsafe.tor:RunningTor", "shardsafe.tor:read_events",
])
def test_public_import_paths_keep_working(path):
    mod, name = path.split(":")
    assert getattr(importlib.import_module(mod), name) is not None


def test_compatibility_names_are_the_defining_modules_objects():
    from shardsafe import export
    from shardsafe.adapters.deepspeed import export as ds_export
    from shardsafe.errors import InsufficientFragments, ShardsafeError
    from shardsafe.parity import codec
    assert export.apply_client_state is ds_export.apply_client_state
    assert codec.InsufficientFragments is InsufficientFragments and issubclass(InsufficientFragments, ShardsafeError)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        export.nope  # noqa: B018
