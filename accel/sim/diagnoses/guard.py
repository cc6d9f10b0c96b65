"""The classic cause of ranks dying at start: a script without ``if __name__ == "__main__":``.

Ranks are started as multiprocessing does: each imports the main script again (as
``__mp_main__``). A script that calls `accel.sim.launch` at its top level then calls it
again in every rank while the rank is still starting, and the rank dies there, before
the simulator can capture what it printed.
"""

from __future__ import annotations

import ast
import sys


def has_main_guard(source: str) -> bool:
    """Whether module source has a top-level ``if __name__ == "__main__":``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # not ours to judge
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = [node.test.left, *node.test.comparators]
            if any(isinstance(n, ast.Name) and n.id == "__name__" for n in names) and any(
                isinstance(n, ast.Constant) and n.value == "__main__" for n in names
            ):
                return True
    return False


def main_guard_hint() -> str:
    """A hint when this process's main script lacks the guard ("" when it has one or is not a file)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not path.endswith(".py"):
        return ""
    try:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
    except OSError:
        return ""
    if has_main_guard(source):
        return ""
    return (
        f'{path} has no `if __name__ == "__main__":` guard. Every rank imports the main script again while it '
        "starts, so a top-level call to accel.sim.launch runs again in each rank and kills it; put that call "
        'under `if __name__ == "__main__":`'
    )
