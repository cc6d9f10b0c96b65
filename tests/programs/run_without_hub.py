"""Run one of Accelerate's scripts that import `datasets` and `evaluate` (Hub packages, not installed here) with
stand-ins that refuse to download: the script's parts that need no Hub data run, a part that needs it fails
naming what it asked for. Usage: run_without_hub.py SCRIPT [ARGS...] (SCRIPT's folder goes first on sys.path)."""

import importlib.util
import runpy
import sys
import types
from pathlib import Path


def _refusal(what: str):
    def refused(*args, **kwargs):
        raise RuntimeError(f"{what}{args!r}: nothing is downloaded from the Hub in accel's tests")

    return refused


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def install_stand_ins() -> None:
    if importlib.util.find_spec("datasets") is None:
        quiet = {"set_verbosity_warning": lambda: None, "set_verbosity_error": lambda: None}
        logging = _module("datasets.utils.logging", **quiet)
        utils = _module("datasets.utils", logging=logging)
        _module("datasets", load_dataset=_refusal("datasets.load_dataset"), utils=utils)
    if importlib.util.find_spec("evaluate") is None:
        _module("evaluate", load=_refusal("evaluate.load"))


if __name__ == "__main__":
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))
    install_stand_ins()
    runpy.run_path(str(script), run_name="__main__")
