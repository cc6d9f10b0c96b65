"""Inside a rank: import the test module as pytest did, and run the test body.

The pytest process sends the module's name and file, the test's qualified name and
the fixture and parametrize values; this side imports the module under the same name
(with pytest's assertion rewriting, so failed asserts explain themselves as they do
in pytest), finds the body behind the `@distributed_test` stand-in and calls it with
this rank's `rank` / `local_rank` added. The module is imported again when its file
changed (pytester writes many files of the same name), never otherwise.

Kept free of torch at import time: the pytest process imports it too, to name
`run_test` as the function ranks call.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Any

from accel.sim.runtime import serialize

#: module name -> (path, mtime, size) of the file it was last imported from, here
_imported: dict[str, tuple[str, int, int]] = {}


@dataclasses.dataclass(frozen=True)
class TestCall:
    """What a rank needs to run one test: where the body is and what to pass it."""

    __test__ = False  # not a pytest test class, despite its name

    module: str
    path: str
    qualname: str
    #: serialised dict of shared arguments (parametrize values, world_size, device,
    #: tmp_path), unpickled only once the test module is imported
    kwargs: bytes
    #: per-rank fixtures the body takes ("rank", "local_rank")
    rank_params: tuple[str, ...]
    #: for a hypothesis test, the seed every rank uses, so that all draw the same examples
    hypothesis_seed: int | None = None


def run_test(call: TestCall) -> None:
    """Run the body of `call` in this rank (any exception, skip included, propagates)."""
    from accel.sim.runtime.worker import hide_frames_of

    hide_frames_of(__file__)
    module = load_module(call.module, call.path)
    function = _find_body(module, call.qualname)
    kwargs = serialize.loads(call.kwargs)
    per_rank = {"rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"])}
    kwargs.update({name: per_rank[name] for name in call.rank_params})
    if call.hypothesis_seed is not None:
        _seed_hypothesis(getattr(function, "__func__", function), call.hypothesis_seed)
    function(**kwargs)


def _seed_hypothesis(test: Any, seed: int) -> None:
    # Unless the test pins its own seed (@seed, derandomize), every rank must draw the
    # same examples, or their collectives would not match.
    if getattr(test, "_hypothesis_internal_use_seed", None) is None or getattr(test, "_accel_seeded", False):
        import hypothesis

        hypothesis.seed(seed)(test)
        test._accel_seeded = True


def load_module(name: str, path: str) -> Any:
    """The test module `name` from `path`, imported with assertion rewriting (cached while unchanged)."""
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    module = sys.modules.get(name)
    if module is not None and _imported.get(name) == key:
        return module
    module = _import_rewritten(name, path)
    _imported[name] = key
    return module


def _import_rewritten(name: str, path: str) -> Any:
    from _pytest.assertion.rewrite import rewrite_asserts

    if "." in name:
        # A rootdir-relative name without packages on disk: the module alone will do.
        with contextlib.suppress(ImportError):
            importlib.import_module(name.rpartition(".")[0])
    with open(path, "rb") as handle:
        source = handle.read()
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path, None)
    code = compile(tree, path, "exec", dont_inherit=True)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot import {name} from {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
        raise
    return module


def _find_body(module: Any, qualname: str) -> Any:
    if "<locals>" in qualname:
        raise RuntimeError(
            f"{qualname} is defined inside a function: a @distributed_test must be defined at module level "
            "(or in a test class) so that ranks can import it"
        )
    owner: Any = None
    target: Any = module
    parts = qualname.split(".")
    for index, part in enumerate(parts):
        if index == len(parts) - 1 and isinstance(target, type):
            owner = target
        try:
            target = getattr(target, part)
        except AttributeError:
            raise RuntimeError(f"{module.__name__} ({module.__file__}) has no {qualname} in this rank") from None
    spec = getattr(target, "_accel_distributed", None)
    if spec is None:
        raise RuntimeError(f"{module.__name__}.{qualname} is not a @distributed_test in this rank")
    if owner is not None:
        return spec.body.__get__(owner())  # pytest also calls test methods on a fresh instance
    return spec.body
