"""torch.distributed.checkpoint (DCP) on simulated GPUs, written as PyTorch's DCP recipes write it.

An FSDP2 (`fully_shard`) model and its Adam optimizer are checkpointed with
`get_state_dict` / `set_state_dict` and `dcp.save` / `dcp.load`, or through the recipe's
`AppState` (DCP's `Stateful` protocol): saved on 4 simulated GPUs and loaded on 2
(resharding), training resumed from a checkpoint with the same losses, and
`dcp.async_save` as the async recipe runs it. The files are those a GPU run writes:
the `.metadata` describes the same tensors and shards, the tensor data was copied to
the host, objects saved with CUDA tensors in them record their GPU, and nothing names
the simulator's hidden device.
"""

import concurrent.futures
import io
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from accel.sim import launch
from harness import distributed_test

#: what C++ calls a simulated GPU: no file may say it
HIDDEN = (b"simcuda", b"SimCuda", b"accel.sim")
#: the full shapes of the recipe's model
SHAPES = {"net1.weight": (16, 16), "net1.bias": (16,), "net2.weight": (8, 16), "net2.bias": (8,)}
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


class ToyModel(torch.nn.Module):
    """The DCP recipe's model."""

    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(16, 16)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class AppState(Stateful):
    """The recipe's wrapper: DCP calls `state_dict` in `dcp.save` and `load_state_dict` in `dcp.load`."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer
        self.calls = []

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.calls.append("state_dict")
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.calls.append("load_state_dict")
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


def _sharded_model(seed):
    """The recipe's model on this rank's GPU, each layer and the root sharded by FSDP2, with Adam."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(seed)
    model = ToyModel().to(torch.device("cuda", dist.get_rank()))
    fully_shard(model.net1)
    fully_shard(model.net2)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _train_step(model, optimizer, step):
    """One step on this rank's batch of `step` (the same batch in every run); the loss."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    inputs, targets = torch.rand(8, 16, generator=generator), torch.rand(8, 8, generator=generator)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs.cuda()), targets.cuda())
    loss.backward()
    optimizer.step()
    return loss.item()


def _full_state(model, optimizer):
    """Model and optimizer state gathered in full, offloaded to the host: rank 0's (others get empty dicts).

    Copied: Adam's `step` is a host tensor already, which the offloaded dict holds itself
    (the next step would change it).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_map

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)
    return tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, state)


def _probe_input():
    return torch.linspace(-1, 1, 4 * 16).reshape(4, 16)


def _shards(model, optimizer):
    """How this rank holds each parameter: type, device, placements, mesh size, local shape, and its Adam moment's."""
    out = {}
    for name, param in model.named_parameters():
        local = param.to_local()
        moment = optimizer.state[param]["exp_avg"]
        out[name] = (
            type(param).__name__,
            str(local.device),
            str(param.placements),
            param.device_mesh.size(),
            tuple(local.shape),
            (type(moment).__name__, str(moment.to_local().device), tuple(moment.to_local().shape)),
        )
    return out


def save_on_gpus(path):
    """The recipe's save: train 2 steps, then `dcp.save` of `get_state_dict(model, optimizer)`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _sharded_model(seed=0)
    for step in range(2):
        _train_step(model, optimizer, step)
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    assert all(type(t).__name__ == "DTensor" for t in model_state_dict.values())
    dcp.save({"model": model_state_dict, "optim": optimizer_state_dict}, checkpoint_id=path)
    with torch.no_grad():
        output = model(_probe_input().cuda()).cpu()
    return _full_state(model, optimizer), output, _shards(model, optimizer)


def load_on_gpus(path):
    """The recipe's load into a fresh model: `dcp.load` in place, then `set_state_dict`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _sharded_model(seed=1)  # another initialisation: what is loaded must replace it
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    state = {"model": model_state_dict, "optim": optimizer_state_dict}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with torch.no_grad():
        output = model(_probe_input().cuda()).cpu()
    return _full_state(model, optimizer), output, _shards(model, optimizer)


@pytest.fixture(scope="module")
def saved_on_4_gpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "checkpoint"
    return path, launch(save_on_gpus, (str(path),), world_size=4, device="cuda", timeout=120)


def _assert_same_state(got, expected):
    (got_model, got_optim), (model, optim) = got, expected
    assert list(got_model) == list(model) == list(SHAPES)
    for name, tensor in model.items():
        assert type(got_model[name]) is torch.Tensor and got_model[name].device.type == "cpu"
        assert tuple(tensor.shape) == SHAPES[name] and torch.equal(got_model[name], tensor), name
    assert sorted(got_optim["state"]) == sorted(optim["state"]) == sorted(SHAPES)
    for name, state in optim["state"].items():
        assert sorted(got_optim["state"][name]) == sorted(state) == sorted(ADAM_STATE)
        for key, value in state.items():
            assert type(got_optim["state"][name][key]) is torch.Tensor, (name, key)
            assert torch.equal(got_optim["state"][name][key], value), (name, key)
    assert got_optim["param_groups"] == optim["param_groups"]


def test_fsdp2_checkpoint_saved_on_4_gpus_loads_on_2_with_equal_model_and_optimizer(saved_on_4_gpus):
    path, saved = saved_on_4_gpus
    loaded = launch(load_on_gpus, (str(path),), world_size=2, device="cuda", timeout=120)

    (model_state, optim_state), output, shards = saved[0]
    assert optim_state["state"]["net1.weight"]["step"].item() == 2.0  # two Adam steps were taken
    _assert_same_state(loaded[0][0], (model_state, optim_state))
    # with cpu_offload, the full state is rank 0's only, on 4 GPUs as on 2
    assert all(state == ({}, {}) for state, _, _ in saved[1:] + loaded[1:])
    # the same function: the 2 GPUs compute what the 4 did
    assert all(torch.equal(out, output) for _, out, _ in saved + loaded)

    # sharded over 4 GPUs, then over 2: FSDP2's row shards of DTensors on each rank's GPU
    for world, results in ((4, saved), (2, loaded)):
        for rank, (_, _, shards) in enumerate(results):
            for name, shape in SHAPES.items():
                local = (shape[0] // world, *shape[1:])
                moment = ("DTensor", f"cuda:{rank}", local)
                assert shards[name] == ("DTensor", f"cuda:{rank}", "(Shard(dim=0),)", world, local, moment)


def _pickled_modules(data):
    """The modules whose classes and functions a pickle refers to."""
    modules = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            modules.add(module)
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return modules


def _locations(data):
    seen = []
    torch.load(io.BytesIO(data), map_location=lambda storage, location: seen.append(location) or storage)
    return seen


def test_the_checkpoint_files_are_those_a_gpu_run_writes(saved_on_4_gpus, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    path, saved = saved_on_4_gpus
    (model_state, optim_state), _, _ = saved[0]
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]

    tensors = {f"model.{name}": model_state[name] for name in SHAPES}
    tensors.update({f"optim.state.{n}.{k}": optim_state["state"][n][k] for n in SHAPES for k in ADAM_STATE})
    described = metadata.state_dict_metadata
    assert {name for name, meta in described.items() if isinstance(meta, TensorStorageMetadata)} == set(tensors)
    assert all(isinstance(meta, BytesStorageMetadata) for name, meta in described.items() if name not in tensors)
    assert "optim.param_groups.0.lr" in described
    for name, tensor in tensors.items():
        meta = described[name]
        assert meta.size == tensor.shape and meta.properties.dtype == torch.float32, name
        assert meta.properties.layout == torch.strided and meta.properties.memory_format == torch.contiguous_format
        assert not meta.properties.pin_memory and not meta.properties.requires_grad
        if name.endswith(".step"):  # Adam's step: a host scalar, saved once
            assert [(c.offsets, c.sizes) for c in meta.chunks] == [((), ())], name
            continue
        rows = tensor.shape[0] // 4  # FSDP2's Shard(0) over 4 GPUs: a block of rows from each
        expected = [((r * rows, *[0] * (tensor.dim() - 1)), (rows, *tensor.shape[1:])) for r in range(4)]
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks] == expected, name

    # each tensor item is a torch.save of host memory (DCP copies GPU data to the host first, as
    # on a GPU), and the shards put together are the saved state
    pieces = {}
    for index, info in metadata.storage_data.items():
        with open(path / info.relative_path, "rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        if isinstance(described[index.fqn], TensorStorageMetadata):
            assert _locations(data) == ["cpu"], index.fqn
            pieces.setdefault(index.fqn, []).append((tuple(index.offset), torch.load(io.BytesIO(data))))
    for name, tensor in tensors.items():
        parts = [piece for _, piece in sorted(pieces[name], key=lambda item: item[0])]
        assert torch.equal(torch.cat(parts) if tensor.dim() else parts[0], tensor), name

    # nothing in any file names the simulator's device, nor imports anything but torch's and Python's own
    for name in os.listdir(path):
        data = (path / name).read_bytes()
        assert not [word for word in HIDDEN if word in data], name
    modules = _pickled_modules((path / ".metadata").read_bytes())
    assert "torch.distributed.checkpoint.metadata" in modules
    assert all(module.split(".")[0] in ("torch", "builtins", "collections", "pathlib") for module in modules)

    # and a host without GPUs (this process) reads them: DCP's conversion to one torch.save file
    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt")
    assert sorted(whole) == ["model", "optim"] and whole["optim"]["param_groups"] == optim_state["param_groups"]
    _assert_same_state((whole["model"], whole["optim"]), (model_state, optim_state))


@distributed_test(world_size=2, device="cuda")
def test_gpu_tensors_in_dcp_state_record_their_gpu(rank, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # an object DCP pickles whole (a tuple holding a GPU tensor): its bytes name the GPU of the
    # rank that wrote them, and every rank loads it there, as torch.load does on a GPU host
    here = torch.device("cuda", rank)
    state = {"pair": (torch.full((2,), 3.0, device="cuda"), "tag"), "plain": torch.arange(3.0, device="cuda")}
    dcp.save(state, checkpoint_id=tmp_path / "objects")
    metadata = dcp.FileSystemReader(str(tmp_path / "objects")).read_metadata()
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == "pair"]
    writer = torch.device("cuda", int(info.relative_path.removeprefix("__").split("_")[0]))  # __<rank>_0.distcp
    with open(tmp_path / "objects" / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        assert _locations(handle.read(info.length)) == [str(writer)]
    back = {"pair": None, "plain": torch.zeros(3, device="cuda")}
    dcp.load(back, checkpoint_id=tmp_path / "objects")
    assert back["pair"][0].device == writer and back["pair"][1] == "tag" and back["pair"][0].tolist() == [3.0, 3.0]
    assert back["plain"].device == here and back["plain"].tolist() == [0.0, 1.0, 2.0]  # loaded in place

    # a full state dict gathered without cpu_offload stays on each rank's GPU: torch.save says so
    model, _ = _sharded_model(seed=0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert sorted(full) == sorted(SHAPES) and all(t.device == here and t.is_cuda for t in full.values())
    torch.save(full, tmp_path / f"full{rank}.pt")
    assert set(_locations((tmp_path / f"full{rank}.pt").read_bytes())) == {f"cuda:{rank}"}
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save(offloaded, tmp_path / f"offloaded{rank}.pt")
    assert set(_locations((tmp_path / f"offloaded{rank}.pt").read_bytes())) == ({"cpu"} if rank == 0 else set())
    for name in (f"full{rank}.pt", f"offloaded{rank}.pt"):
        assert not [word for word in HIDDEN if word in (tmp_path / name).read_bytes()]


def train_and_save(path):
    """Train 2 steps, save through the recipe's AppState, train 2 more: their losses."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _sharded_model(seed=0)
    for step in range(2):
        _train_step(model, optimizer, step)
    app = AppState(model, optimizer)
    dcp.save({"app": app}, checkpoint_id=path)
    assert app.calls == ["state_dict"]
    return [_train_step(model, optimizer, step) for step in (2, 3)]


def resume(path):
    """A fresh run: another initialisation, the checkpoint loaded through AppState, the same 2 steps."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _sharded_model(seed=1)
    before = model.net1.weight.full_tensor().cpu()
    app = AppState(model, optimizer)
    dcp.load({"app": app}, checkpoint_id=path)
    assert app.calls == ["state_dict", "load_state_dict"]  # DCP asks for the layout, then hands the state back
    assert not torch.equal(model.net1.weight.full_tensor().cpu(), before)
    assert optimizer.state[model.net1.weight]["step"].item() == 2.0
    return [_train_step(model, optimizer, step) for step in (2, 3)]


def test_training_resumes_from_a_dcp_checkpoint_with_identical_losses(tmp_path):
    path = str(tmp_path / "checkpoint")
    first = launch(train_and_save, (path,), world_size=2, device="cuda", timeout=120)
    resumed = launch(resume, (path,), world_size=2, device="cuda", timeout=120)
    assert len(first) == 2 and all(len(losses) == 2 for losses in first)
    assert first[0] != first[1]  # each rank trained on its own batches
    assert resumed == first  # bitwise: the same state, the same steps


@distributed_test(world_size=2, device="cuda")
def test_async_save_needs_a_cpu_backend_as_on_gpus(tmp_path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    # an "nccl" group has no CPU backend: torch refuses async_save on GPUs as here
    assert dist.get_backend() == "nccl"
    model, optimizer = _sharded_model(seed=0)
    with pytest.raises(AssertionError, match="^A CPU backend must be enabled for async save; try initializing"):
        dcp.async_save({"app": AppState(model, optimizer)}, checkpoint_id=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def _recipe_group():
    """The async recipe's group: Gloo for CPU tensors (async_save's own collectives), NCCL for the GPUs."""
    import torch.distributed as dist

    dist.destroy_process_group()
    dist.init_process_group("cpu:gloo,cuda:nccl")
    assert dist.get_backend() == "cpu:gloo,cuda:nccl"


def _assert_checkpoint_holds(rank, path, snapshot):
    """A fresh model and optimizer loaded from `path` (through AppState) hold `snapshot`."""
    import torch.distributed.checkpoint as dcp

    fresh, fresh_optimizer = _sharded_model(seed=1)
    dcp.load({"app": AppState(fresh, fresh_optimizer)}, checkpoint_id=path)
    loaded = _full_state(fresh, fresh_optimizer)
    if rank == 0:
        _assert_same_state(loaded, snapshot)


@distributed_test(world_size=2, device="cuda", timeout=30)
def test_async_save_with_a_cpu_backend_writes_the_state_it_was_given(rank, tmp_path):
    import torch.distributed.checkpoint as dcp

    _recipe_group()
    model, optimizer = _sharded_model(seed=0)
    _train_step(model, optimizer, 0)
    snapshot = _full_state(model, optimizer)
    checkpoint_future = dcp.async_save({"app": AppState(model, optimizer)}, checkpoint_id=tmp_path / "step0")
    assert isinstance(checkpoint_future, concurrent.futures.Future)
    assert checkpoint_future.result().state_dict_metadata.keys() == (
        dcp.FileSystemReader(str(tmp_path / "step0")).read_metadata().state_dict_metadata.keys()
    )
    _assert_checkpoint_holds(rank, tmp_path / "step0", snapshot)


# On a GPU node the two backends are two communicators: the checkpoint's collectives (Gloo,
# in async_save's thread) run while the training step's (NCCL) do. A hang here (the
# timeout), a Gloo abort or a collective mismatch means the simulator ran or counted both
# as one stream of collectives.
@distributed_test(world_size=2, device="cuda", timeout=30)
def test_async_save_as_the_async_recipe_runs_it_beside_training(rank, tmp_path):
    import torch.distributed.checkpoint as dcp

    _recipe_group()
    model, optimizer = _sharded_model(seed=0)
    snapshots, checkpoint_future = [], None
    for step in range(3):
        _train_step(model, optimizer, step)
        # waits for checkpointing to finish if one exists, as the recipe does
        if checkpoint_future is not None:
            checkpoint_future.result()
        snapshots.append(_full_state(model, optimizer))
        checkpoint_future = dcp.async_save({"app": AppState(model, optimizer)}, checkpoint_id=tmp_path / f"step{step}")
    _train_step(model, optimizer, 3)  # trains on while the last checkpoint is written
    checkpoint_future.result()

    for step in (0, 2):  # each checkpoint holds the state of its step, not of a later one
        _assert_checkpoint_holds(rank, tmp_path / f"step{step}", snapshots[step])
