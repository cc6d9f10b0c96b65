"""A script's own `init_process_group` in a simulated rank, where the simulator made one already.

A simulated rank creates its default process group before the user's code runs (ranks
are kept warm, and accel's state is set up as on the hardware). A script written for
torchrun then calls `dist.init_process_group("nccl")` (or `()`, `("gloo")`,
`init_method="env://"`), which torch refuses: "trying to initialize the default process
group twice". `install()` wraps `init_process_group` in this rank so that the script runs
unchanged:

* a request the simulator's group already answers (same backend, same world) is
  adopted: nothing is created, the call returns as torch's does;
* another backend this device could have (`"gloo"` on simulated GPUs, `"nccl"` where the
  simulator chose a permissive group) replaces the simulator's group by the one asked
  for, so that the script gets exactly the group it would get on the hardware;
* a request the hardware could not serve (`"nccl"` without GPUs, another world size or
  rank) fails with torch's words and what to do instead;
* after the script's own `destroy_process_group()`, a new `init_process_group` creates a
  fresh group (each group of a rank rendezvouses under a key prefix of its own, so
  nothing of an earlier group is read again).

An adopted group keeps the simulator's timeout: a `timeout=` given to the adopting call
is not applied (the launch's own timeout still bounds every wait).

`restore()` (run before every task, from `accel.sim.devices.reset_rank`) puts the
simulator's group back if the previous task replaced it. `dist.get_backend()` names a
group by what the script asked for. Installed in simulated ranks only.
"""

from __future__ import annotations

import datetime
import functools
import os
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import constants, distributed_c10d

_device: str | None = None
#: the device's hooks, `accel.sim.<device>.rank` (None: the CPU's defaults; see `accel.sim.devices`)
_rank: ModuleType | None = None
_original_init: Any = None
_original_get_backend: Any = None
#: what each group created here was asked for (what `get_backend` answers)
_labels: dict[Any, str] = {}
#: the simulator's own default group and its backend (None until it exists)
_simulator: dict[str, Any] = {}
#: groups created in this process: each rendezvouses under its own store prefix
_generation = [0]
#: what makes the store of each default group created here (empty: a client of the launcher's
#: rendezvous store); a rank standing in for absent ones has one of its own (`accel.sim.cuda.nccl.stand_in`)
_store_makers: list[Any] = []
#: a process on a simulated node (`accel.sim.node`): no launcher, the script's group is its own;
#: each callable is told when a default group has been created
_node: list[Any] = []


class IncompatibleProcessGroupRequest(RuntimeError):
    """`init_process_group` asked for a group this simulated rank cannot give."""


def install(device: str, rank: ModuleType | None = None) -> None:
    """Wrap `init_process_group` and `get_backend` in this simulated rank (idempotent)."""
    global _device, _rank, _original_init, _original_get_backend
    _device, _rank = device, rank
    if _original_init is not None:
        return
    _original_init = distributed_c10d.init_process_group
    _original_get_backend = dist.get_backend

    @functools.wraps(_original_init)
    def init_process_group_in_simulated_rank(*args: Any, **kwargs: Any) -> None:
        return init_process_group(*args, **kwargs)

    @functools.wraps(_original_get_backend)
    def get_backend_in_simulated_rank(group: Any = None) -> str:
        return get_backend(group)

    for module in (dist, distributed_c10d):
        module.init_process_group = init_process_group_in_simulated_rank  # type: ignore[attr-defined]  # same signature
    # only the public name: torch's own code must keep reading the backends it created
    dist.get_backend = get_backend_in_simulated_rank  # type: ignore[assignment]  # same signature


def get_backend(group: Any = None) -> str:
    """`dist.get_backend`, naming a group created here by what its creator asked for."""
    label = _labels.get(group if group is not None else dist.group.WORLD)
    if label is not None:
        return _equivalents().get(label, label)
    return getattr(_rank, "to_user", _unchanged)(_original_get_backend(group))


def _unchanged(backend: Any) -> Any:
    return backend


def _normalise(backend: Any) -> str:
    text = str(backend).lower() if backend is not None else "undefined"
    if text == "undefined":
        # the accelerator's own (torch >= 2.6 asks `torch._C._get_accelerator()`)
        return str(getattr(_rank, "DEFAULT_BACKEND", "gloo"))
    if ":" in text:
        return ",".join(sorted(pair.strip() for pair in text.split(",")))
    return text


def _equivalents() -> dict[str, str]:
    """Backends the simulator uses under names of its own -> the request each answers exactly."""
    return getattr(_rank, "EQUIVALENTS", {})


def _check_possible(wanted: str, world_size: int, rank: int) -> None:
    if "nccl" in wanted and not getattr(_rank, "HAS_NCCL", False):
        raise IncompatibleProcessGroupRequest(
            f"Distributed package doesn't have NCCL built in (accel.sim: this rank simulates {_device!r}, where "
            "NCCL has no GPU to run on, as on a machine without GPUs; use backend 'gloo', or simulate GPUs with "
            "--simulate cuda / device='cuda')"
        )
    expected = (int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))
    for name, given, have in (("world_size", world_size, expected[0]), ("rank", rank, expected[1])):
        if given not in (-1, None) and int(given) != have:
            raise IncompatibleProcessGroupRequest(
                f"init_process_group({name}={given}) in a simulated rank whose launcher set {name.upper()}={have}: "
                f"the simulator started WORLD_SIZE={expected[0]} ranks; drop the argument (torchrun's environment "
                "gives it) or launch with that many processes"
            )


def init_process_group(
    backend: Any = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """`dist.init_process_group` in a simulated rank: adopt, replace or create (module docstring)."""
    wanted = _normalise(backend)
    if wanted == "fake":
        _init_fake(init_method, timeout, world_size, rank, store, group_name, pg_options, device_id)
        return
    if _node:
        _init_on_node(wanted, init_method, timeout, world_size, rank, store, group_name, pg_options, device_id)
        return
    _check_possible(wanted, world_size, rank)
    if dist.is_initialized():
        world = dist.GroupMember.WORLD
        if world is not _simulator.get("group") or _simulator.get("claimed"):
            # The user's code made (or adopted) this one: torch's own error, as on the hardware.
            _original_init(backend, init_method, timeout, world_size, rank, store, group_name, pg_options, device_id)
            return
        have = _labels.get(world, "")
        if wanted in (have, _equivalents().get(have)):
            _simulator["claimed"] = True  # from now on it is the script's group
            _bind_eagerly(device_id)
            return
        dist.destroy_process_group()
    create(wanted, timeout, pg_options)
    _bind_eagerly(device_id)


def _init_fake(*args: Any) -> None:
    """torch's "fake" group (one process standing for a world of any size, no rendezvous: LocalTensor tests,
    tracing): torch's own, as on a GPU host, in place of the simulator's group if that is the default one."""
    if dist.is_initialized() and dist.GroupMember.WORLD is _simulator.get("group") and not _simulator.get("claimed"):
        dist.destroy_process_group()  # `restore()` makes it again before the next task
    _original_init("fake", *args)
    _labels.clear()


def on_node(created: Any) -> None:
    """This process is on a simulated node: groups are made as the script asks; `created()` follows each."""
    _node.append(created)


def _init_on_node(wanted: str, init_method: Any, timeout: Any, world_size: int, rank: int, *rest: Any) -> None:
    """A script's own group on a simulated node: torch's, with "nccl" the simulated NCCL group."""
    store, group_name, pg_options, device_id = rest
    if "nccl" in wanted and not getattr(_rank, "HAS_NCCL", False):
        _check_possible(wanted, world_size, rank)  # refused in NCCL's words
    backend = getattr(_rank, "to_torch", _unchanged)(wanted)
    if store is None:
        # torch's own rendezvous, done here so that the node's collective check can share the store
        # NCCL's default (10 minutes) where asked for it; torch leaves that constant None on a CPU build
        nccl_default = constants.default_pg_nccl_timeout or datetime.timedelta(minutes=10)
        timeout = timeout or (nccl_default if "nccl" in wanted else constants.default_pg_timeout)
        store, rank, world_size = next(dist.rendezvous(init_method or "env://", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore("default_pg", store)
    # device_id binds the group eagerly below, as NCCL's communicator is (torch binds C++ NCCL only)
    _original_init(backend, None, timeout, world_size, rank, store, group_name, pg_options)
    _labels.clear()
    _labels[dist.GroupMember.WORLD] = wanted
    _bind_eagerly(device_id)
    for created in _node:
        created(store)


def _bind_eagerly(device_id: Any) -> None:
    # `device_id` makes NCCL set up its communicator at once, on that GPU (torch >= 2.3).
    bind = getattr(dist.GroupMember.WORLD, "bind", None)
    if device_id is not None and bind is not None:
        bind(torch.device(device_id).index or 0)


def create(label: str, timeout: datetime.timedelta | None = None, pg_options: Any = None) -> None:
    """Create the default group for backend `label` from the launcher's environment."""
    backend = getattr(_rank, "to_torch", _unchanged)(label)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    options: dict[str, Any] = {}
    if timeout is not None:
        options["timeout"] = timeout
    if pg_options is not None:
        options["pg_options"] = pg_options
    rank = int(os.environ.get("RANK", "0"))
    _original_init(backend, store=_fresh_store(world_size, timeout), world_size=world_size, rank=rank, **options)
    _labels.clear()  # only default groups have labels, and the earlier one is gone
    _labels[dist.GroupMember.WORLD] = label
    if not _simulator:
        # The first group of a rank is the simulator's own (made before any task runs).
        _simulator.update(group=dist.GroupMember.WORLD, label=label, timeout=timeout)


def use_stores(make: Any) -> None:
    """Default groups created from now on get their store from `make()` (None: the launcher's rendezvous store)."""
    _store_makers[:] = [make] if make is not None else []


def _fresh_store(world_size: int, timeout: datetime.timedelta | None) -> Any:
    # Rank 0 already hosts the rendezvous server on MASTER_PORT (accel.sim.runtime.worker): every
    # rank, rank 0 included, connects to it as a client.
    _generation[0] += 1
    if _store_makers:
        return dist.PrefixStore(f"accel-sim-group/{_generation[0]}", _store_makers[0]())
    client = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=5),
    )
    return dist.PrefixStore(f"accel-sim-group/{_generation[0]}", client)


def restore() -> None:
    """Before a task: the simulator's group is the default group again, if a task replaced it."""
    if not _simulator or _original_init is None:
        return
    _simulator["claimed"] = False
    world = dist.GroupMember.WORLD if dist.is_initialized() else None
    if world is _simulator["group"]:
        unbind = getattr(world, "unbind", None)  # the simulated NCCL group: a fresh communicator
        if unbind is not None:
            unbind()
        return
    if world is not None:
        dist.destroy_process_group()
    create(_simulator["label"], _simulator["timeout"])
    _simulator["group"] = dist.GroupMember.WORLD
