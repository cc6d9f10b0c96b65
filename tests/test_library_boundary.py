"""The library never imports the simulator (DESIGN.md: `harness -> accel.sim -> accel`).

Two checks: no source file of `accel` outside `accel/sim` names `accel.sim` in an import
statement (at top level or inside a function), and importing every library module leaves
`accel.sim` out of `sys.modules`. The only exceptions are the entry points whose job is to
start the simulator: the launchers (`debug_launcher`, `notebook_launcher(simulate=...)`)
and the `accel` CLI (`accel launch --simulate`).
"""

import ast
import pathlib
import subprocess
import sys

import accel

ROOT = pathlib.Path(accel.__file__).parent

#: the entry points that start the simulator, and why (paths relative to accel/)
ENTRY_POINTS = {
    "launchers.py": "debug_launcher and notebook_launcher(simulate=...) run the function on simulated ranks",
    "commands": "`accel launch --simulate` runs a script on simulated ranks",
}


def _library_files() -> list[pathlib.Path]:
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "sim" or rel.parts[0] in ENTRY_POINTS:
            continue
        files.append(path)
    return files


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file, wherever it sits."""
    package = ".".join(("accel", *path.relative_to(ROOT).with_suffix("").parts))
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _is_sim(name: str) -> bool:
    return name == "accel.sim" or name.startswith("accel.sim.")


def test_the_checks_see_the_imports_they_look_for():
    files = _library_files()
    assert ROOT / "hooks.py" in files and ROOT / "launchers.py" not in files
    assert not any(p.relative_to(ROOT).parts[0] == "sim" for p in files)
    # the entry points do import the simulator: the scan would find it there
    assert any(_is_sim(name) for _, name in _imported_modules(ROOT / "launchers.py"))


def test_no_library_source_imports_the_simulator():
    offenders = [
        f"accel/{path.relative_to(ROOT)}:{line}: {name}"
        for path in _library_files()
        for line, name in _imported_modules(path)
        if _is_sim(name)
    ]
    assert not offenders, "the library imports accel.sim (DESIGN.md: it never does):\n" + "\n".join(offenders)


def test_importing_every_library_module_leaves_the_simulator_out():
    modules = []
    for path in _library_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules.append(".".join(("accel", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'accel.sim' or m.startswith('accel.sim.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
