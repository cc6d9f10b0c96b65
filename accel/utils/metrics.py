"""`gather_for_metrics`: gather an evaluation's outputs from every process, each sample once.

Prepared loaders even out the end of the data by repeating samples from the start
(`even_batches=True`); gathering the last batch then returns those duplicates too.
The active loader tells `GradientState` how many samples of the last global batch are
padding (`remainder`), and they are dropped here, so that a whole evaluation gathers
exactly the dataset. With `even_batches=False` the processes may end with batches of
different sizes, and some with one batch fewer: every call then first exchanges the
sizes (and whether each process is on its last batch), and a process whose loop ends
early repeats its last step's calls, contributing nothing, until all have finished
(so nobody waits on a collective that would never come).
"""

from __future__ import annotations

from typing import Any

import torch

from accel.utils.operations import gather, gather_object, recursively_apply


def _tensors(data: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    recursively_apply(found.append, data)
    return found


def _replace_tensors(data: Any, tensors: list[torch.Tensor]) -> Any:
    it = iter(tensors)
    return recursively_apply(lambda _t: next(it), data)


def _only_tensors(data: Any) -> bool:
    try:
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def _drop_padding(gathered: Any, padding: int, per_sample_objects: bool) -> Any:
    if per_sample_objects:
        return gathered[: len(gathered) - padding] if isinstance(gathered, list) else gathered
    return recursively_apply(lambda t: t[: t.shape[0] - padding] if t.dim() else t, gathered)


def gather_for_metrics(data: Any, use_gather_object: bool = False) -> Any:
    """Gather `data` (tensors, or any picklable objects) from all processes, without padded duplicates.

    Call it on every process at each evaluation step, inside the loop over a prepared
    loader. Tensors are concatenated on dim 0 in process order; other data goes through
    `gather_object` (also when `use_gather_object=True`). On the last batch, the
    samples that the loader added to even out the data are removed.
    """
    from accel.state import GradientState, PartialState

    state = PartialState()
    if state.num_processes == 1:
        return data
    use_gather_object = use_gather_object or not _only_tensors(data)
    gradient_state = GradientState()
    loader = gradient_state.active_dataloader
    finished = gradient_state.end_of_dataloader
    if getattr(loader, "_may_be_uneven", False):
        return _gather_uneven(state, loader, data, finished, use_gather_object)
    gathered = gather_object(data) if use_gather_object else gather(data)
    padding = gradient_state.remainder if finished else 0
    if padding <= 0:  # none, or unknown (-1): nothing can be dropped
        return gathered
    return _drop_padding(gathered, padding, use_gather_object and isinstance(data, (list, tuple)))


def _gather_uneven(state: Any, loader: Any, data: Any, finished: bool, use_gather_object: bool) -> Any:
    """Gather when processes may hold different numbers of samples, or of batches."""
    round_ = _objects_round if use_gather_object else _tensors_round
    result, everyone_finished = round_(state, data, finished, True)
    if finished and not everyone_finished:
        # Others have batches left: this process owes them this call at each of their
        # remaining steps, paid once its loop is over (`settle_uneven_end`).
        loader.__dict__.setdefault("_owed_gathers", []).append((round_, data))
    return result


def settle_uneven_end(loader: Any) -> None:
    """After this process's last batch, join the gathers of the processes that still have batches.

    Called by the prepared loaders when their iteration ends. The calls made during
    the last step are repeated, contributing nothing, until every process reports its
    last step; only the processes that hold those later batches receive them (the main
    process always has the most batches, so its results are complete).
    """
    owed = loader.__dict__.pop("_owed_gathers", None)
    if not owed:
        return
    from accel.state import PartialState

    state = PartialState()
    everyone_finished = False
    while not everyone_finished:
        for round_, template in owed:
            _, everyone_finished = round_(state, template, True, False)


def _objects_round(state: Any, data: Any, finished: bool, contributing: bool) -> tuple[Any, bool]:
    everyone = state.hardware.all_gather_object((finished, contributing, data if contributing else None))
    payloads = [payload for _, gives, payload in everyone if gives]
    if not payloads:
        return None, all(done for done, _, _ in everyone)
    nested = all(isinstance(p, (list, tuple)) for p in payloads)
    joined = [item for p in payloads for item in p] if nested else payloads
    return joined, all(done for done, _, _ in everyone)


def _tensors_round(state: Any, data: Any, finished: bool, contributing: bool) -> tuple[Any, bool]:
    tensors = [t.reshape(1) if t.dim() == 0 else t for t in _tensors(data)]
    if not contributing:
        tensors = [t[:0] for t in tensors]
    world = state.num_processes
    header = torch.tensor([int(finished)] + [t.shape[0] for t in tensors], dtype=torch.int64, device=state.device)
    table = state.hardware.all_gather_into(header.new_empty(world * header.numel()), header).view(world, -1).tolist()
    everyone_finished = all(row[0] for row in table)
    sizes = [[row[1 + j] for row in table] for j in range(len(tensors))]
    padded = []
    for t, per_process in zip(tensors, sizes, strict=True):
        longest = max(per_process)
        if t.shape[0] < longest:
            grown = t.new_zeros((longest, *t.shape[1:]))
            grown[: t.shape[0]] = t
            t = grown
        padded.append(t)
    gathered = gather(padded)
    joined = []
    for g, per_process in zip(gathered, sizes, strict=True):
        rows = g.view(world, max(per_process), *g.shape[1:])
        joined.append(torch.cat([rows[r, :size] for r, size in enumerate(per_process)]))
    return _replace_tensors(data, joined), everyone_finished
