"""The `xla` process-group backend and the `xla://` init method, both on Gloo.

Importing this module registers them, as importing the real one does, so that
`torch.distributed.init_process_group("xla", init_method="xla://")` works in a simulated
rank and `dist.get_backend()` answers "xla". The process group is a plain Gloo group
over CPU tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

# The module, not the function `torch.distributed.rendezvous` that shadows its name.
_rendezvous = importlib.import_module("torch.distributed.rendezvous")

import torch_xla.runtime as xr  # noqa: E402  (after the rendezvous module is bound, as documented above)

BACKEND_NAME = "xla"


def _create_xla_process_group(store: Any, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    group: dist.ProcessGroup = dist.ProcessGroupGloo(store, rank, size, timeout)  # type: ignore[assignment]  # a Backend, which torch accepts here
    return group


def _xla_rendezvous_handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any) -> Iterator[Any]:
    # Ranks come from the runtime (the launcher's environment); the store from
    # MASTER_ADDR/MASTER_PORT, exactly as env:// does.
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query).items()}
    rank = int(query.get("rank", xr.global_ordinal()))
    world_size = int(query.get("world_size", xr.world_size()))
    yield from _rendezvous.rendezvous("env://", rank, world_size, timeout=timeout)


def _register() -> None:
    # Registration is process-wide and torch refuses a second one; importing twice is fine.
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create_xla_process_group, devices=["cpu"])
    if BACKEND_NAME not in _rendezvous._rendezvous_handlers:
        _rendezvous.register_rendezvous_handler(BACKEND_NAME, _xla_rendezvous_handler)


_register()
