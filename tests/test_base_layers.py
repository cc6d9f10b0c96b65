"""The base of the library is layered (issue 34): lower modules import no higher ones, and names that moved
down stay importable from where users found them."""

import importlib

import pytest
from test_import_cycles import import_graph

#: each base module and the modules above it that it must not import (directly or through others)
BELOW = {
    "accel.utils.environment": {"accel.logging", "accel.state", "accel.utils.dataclasses"},
    "accel.utils.fsdp_plugin": {"accel.fsdp", "accel.state", "accel.utils.dataclasses"},
    "accel.utils.dataclasses": {"accel.fsdp", "accel.state", "accel.backends"},
    "accel.backends": {"accel.state", "accel.logging"},
    "accel.state": {"accel.fsdp", "accel.logging", "accel.hooks", "accel.utils.modeling", "accel.utils.operations"},
    "accel.utils.module_tensors": {"accel.hooks", "accel.utils.modeling", "accel.state"},
    "accel.hooks": {"accel.utils.modeling", "accel.fsdp"},
}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("module", sorted(BELOW))
def test_a_base_module_reaches_nothing_above_it(module):
    above = _reachable(import_graph(), module) & BELOW[module]
    assert not above, f"{module} imports, directly or through other modules: {sorted(above)}"


@pytest.mark.parametrize(
    ("old_place", "name", "home"),
    [
        ("accel.utils", "check_os_kernel", "accel.utils.other"),
        ("accel.utils.dataclasses", "FullyShardedDataParallelPlugin", "accel.utils.fsdp_plugin"),
        ("accel.fsdp", "check_version", "accel.utils.fsdp_plugin"),
        ("accel.fsdp", "layer_classes_to_wrap", "accel.utils.fsdp_plugin"),
        ("accel.fsdp", "FSDP1_REFUSED", "accel.utils.fsdp_plugin"),
        ("accel.utils.modeling", "set_module_tensor_to_device", "accel.utils.module_tensors"),
        ("accel.utils.modeling", "named_module_tensors", "accel.utils.module_tensors"),
        ("accel.utils.modeling", "get_non_persistent_buffers", "accel.utils.module_tensors"),
    ],
)
def test_a_moved_name_is_the_same_object_at_its_old_place(old_place, name, home):
    assert getattr(importlib.import_module(old_place), name) is getattr(importlib.import_module(home), name)
