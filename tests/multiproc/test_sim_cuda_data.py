"""Data, checkpoints and random numbers on simulated GPUs."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_pinned_loader_non_blocking_copies_streams_and_events(rank):
    dataset = TensorDataset(torch.arange(8.0)[:, None], torch.arange(8))
    seen = []
    for x, y in DataLoader(dataset, batch_size=4, pin_memory=True):
        x, y = x.to("cuda", non_blocking=True), y.cuda(non_blocking=True)
        assert x.device == y.device == torch.device("cuda", rank)
        seen.append(x.sum().item())
    torch.cuda.synchronize()
    assert seen == [6.0, 22.0]
    assert torch.ones(2).pin_memory().device.type == "cpu"
    # pinned host memory: a pinned copy, as on a GPU host; torch's C++ gets pinned memory too
    plain = torch.ones(2)
    pinned = plain.pin_memory()
    assert pinned.is_pinned() and not plain.is_pinned() and pinned.pin_memory() is pinned
    assert torch.equal(pinned, plain) and pinned.data_ptr() != plain.data_ptr()
    assert torch.empty(2, pin_memory=True).shape == (2,) and not torch.ones(2, device="cuda").is_pinned()
    assert next(iter(DataLoader(dataset, batch_size=4, pin_memory=True)))[0].is_pinned()

    side = torch.cuda.Stream()
    x = torch.ones(3, device="cuda")
    with torch.cuda.stream(side):
        y = x * 2
    torch.cuda.current_stream().wait_stream(side)
    y.record_stream(torch.cuda.current_stream())
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert done.query() and side.query() and y.tolist() == [2.0, 2.0, 2.0]
    assert torch.cuda.current_stream().device == torch.device("cuda", rank)


def _locations(path):
    """The storage locations a checkpoint file records (what a GPU host would read)."""
    seen = []
    torch.load(path, map_location=lambda storage, location: seen.append(location) or storage)
    return seen


@distributed_test(world_size=SIZES, device="cuda")
def test_checkpoints_record_and_restore_the_gpu(rank, world_size, tmp_path):
    model = torch.nn.Linear(3, 2).cuda()
    path = tmp_path / f"rank{rank}.pt"
    torch.save({"model": model.state_dict(), "step": torch.tensor(7, device="cuda"), "host": torch.ones(2)}, path)
    assert sorted(set(_locations(path))) == ["cpu", f"cuda:{rank}"]

    loaded = torch.load(path)
    assert loaded["model"]["weight"].device == torch.device("cuda", rank) and loaded["host"].device.type == "cpu"
    assert torch.equal(loaded["model"]["weight"].cpu(), model.weight.detach().cpu())
    assert loaded["step"].item() == 7

    on_host = torch.load(path, map_location="cpu")
    assert type(on_host["model"]["weight"]) is torch.Tensor and on_host["model"]["weight"].device.type == "cpu"
    other = (rank + 1) % world_size
    moved = torch.load(path, map_location={f"cuda:{rank}": f"cuda:{other}"})
    assert moved["model"]["bias"].device == torch.device("cuda", other)
    assert torch.load(path, map_location=torch.device("cuda", other))["step"].device.index == other

    fresh = torch.nn.Linear(3, 2).cuda()
    fresh.load_state_dict(torch.load(path, weights_only=True)["model"])
    assert torch.equal(fresh.weight.detach().cpu(), model.weight.detach().cpu())

    # a checkpoint naming a GPU this host does not have fails as on a GPU host
    with pytest.raises(RuntimeError) as info:
        torch.load(path, map_location={f"cuda:{rank}": f"cuda:{world_size + 1}"})
    assert str(info.value) == (
        f"Attempting to deserialize object on CUDA device {world_size + 1} but torch.cuda.device_count() is "
        f"{world_size}. Please use torch.load with map_location to map your storages to an existing device."
    )


@distributed_test(world_size=SIZES, device="cuda")
def test_plain_pickling_keeps_the_gpu_as_a_gpu_hosts_does(rank, world_size):
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.distributed as dist

    x = torch.arange(6.0, device="cuda").view(2, 3)[:, 1:]  # a view: its storage goes whole, offset kept
    back = pickle.loads(pickle.dumps(x))
    assert back.device == torch.device("cuda", rank) and torch.equal(back.cpu(), x.cpu())
    assert back.stride() == x.stride() and back.storage_offset() == 1
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump({"t": x})  # what a multiprocessing queue sends
    assert pickle.loads(buffer.getvalue())["t"].device == torch.device("cuda", rank)
    # object collectives pickle too: each rank's tensor comes back on the GPU it was on
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {"rank": rank, "t": torch.full((2,), float(rank), device="cuda")})
    assert [g["t"].device.index for g in gathered] == list(range(world_size))
    assert [g["t"][0].item() for g in gathered] == [float(r) for r in range(world_size)]


@distributed_test(world_size=SIZES, device="cuda")
def test_each_simulated_gpu_has_its_own_generator(rank, world_size):
    other = (rank + 1) % world_size
    cpu_state = torch.get_rng_state()
    torch.cuda.manual_seed(5)
    first = torch.randn(4, device="cuda")
    torch.cuda.manual_seed(5)
    assert torch.equal(torch.randn(4, device="cuda").cpu(), first.cpu())
    assert torch.equal(torch.get_rng_state(), cpu_state)  # GPU draws leave the CPU generator alone

    other_state = torch.cuda.get_rng_state(other)
    torch.rand(10, device="cuda")
    torch.nn.functional.dropout(torch.ones(10, device="cuda"), 0.5)
    assert torch.equal(torch.cuda.get_rng_state(other), other_state)  # and the other GPUs' generators

    snapshot = torch.cuda.get_rng_state()
    a = torch.rand(3, device="cuda")
    torch.cuda.set_rng_state(snapshot)
    assert torch.equal(torch.rand(3, device="cuda").cpu(), a.cpu())

    before = torch.cuda.get_rng_state()
    with torch.random.fork_rng(devices=[rank], device_type="cuda"):
        torch.cuda.manual_seed(99)
        torch.rand(3, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), before)

    torch.manual_seed(11)  # torch seeds every GPU's generator too, as on a GPU host
    assert all(torch.equal(s, torch.cuda.get_rng_state(0)) for s in torch.cuda.get_rng_state_all())
    assert torch.cuda.initial_seed() == 11


@distributed_test(world_size=SIZES, device="cuda")
def test_a_cpu_generator_is_refused_by_gpu_random_ops():
    generator = torch.Generator().manual_seed(0)
    message = "^Expected a 'cuda' device type for generator but found 'cpu'$"
    with pytest.raises(RuntimeError, match=message):
        torch.randn(3, device="cuda", generator=generator)
    with pytest.raises(RuntimeError, match=message):
        torch.empty(3, device="cuda").normal_(generator=generator)
    assert torch.randn(3, generator=generator).device.type == "cpu"  # CPU tensors still take it


@distributed_test(world_size=SIZES, device="cuda")
def test_gpu_generators_draw_for_their_gpu_and_are_torch_generators(rank):
    generator = torch.Generator(device="cuda").manual_seed(5)
    assert generator.device == torch.device("cuda", rank) and isinstance(generator, torch.Generator)
    assert isinstance(torch.default_generator, torch.Generator) and type(torch.Generator()) is torch._C.Generator
    first = torch.randn(4, device="cuda", generator=generator)
    assert torch.equal(first, torch.randn(4, device="cuda", generator=generator.manual_seed(5)))
    # the GPU's own generator is not moved by it, nor is the CPU's
    torch.cuda.manual_seed(1)
    torch.manual_seed(1)
    expected_gpu, expected_cpu = torch.cuda.get_rng_state(), torch.get_rng_state()
    torch.empty(8, device="cuda").uniform_(generator=generator).bernoulli_(0.5, generator=generator)
    torch.randperm(6, device="cuda", generator=generator)
    torch.multinomial(torch.ones(4, device="cuda"), 2, generator=generator)
    torch.nn.functional.dropout(torch.ones(4, device="cuda"))  # draws from the GPU's own
    assert not torch.equal(torch.cuda.get_rng_state(), expected_gpu)
    assert torch.equal(torch.get_rng_state(), expected_cpu)
    # state round trip; torch.cuda.default_generators are the GPUs' own generators
    state = generator.get_state()
    drawn = torch.rand(3, device="cuda", generator=generator)
    generator.set_state(state)
    assert torch.equal(drawn, torch.rand(3, device="cuda", generator=generator))
    defaults = torch.cuda.default_generators
    assert [g.device for g in defaults] == [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    torch.cuda.manual_seed(7)
    assert defaults[rank].initial_seed() == 7
    other = torch.Generator(f"cuda:{(rank + 1) % torch.cuda.device_count()}")
    assert other.device.index == (rank + 1) % torch.cuda.device_count()
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.Generator(device=f"cuda:{torch.cuda.device_count()}")
    # pickled and deep-copied as a GPU's generator, its state kept
    import copy
    import pickle

    copies = (pickle.loads(pickle.dumps(generator)), copy.deepcopy(generator))
    expected = torch.rand(3, device="cuda", generator=generator)
    for copied in copies:
        assert copied.device == generator.device and copied is not generator
        assert torch.equal(torch.rand(3, device="cuda", generator=copied), expected)


@distributed_test(world_size=2, device="cuda")
def test_loader_workers_start_as_under_torchrun(rank):
    # a rank has the platform's default start method, as a process torchrun starts has
    import multiprocessing
    import sys

    default = "fork" if sys.platform.startswith("linux") and sys.version_info < (3, 14) else None
    if default is not None:
        assert multiprocessing.get_start_method() == default
    dataset = TensorDataset(torch.arange(16.0))
    loader = DataLoader(dataset, batch_size=4, num_workers=2, pin_memory=True)
    batches = [b.to("cuda", non_blocking=True) for (b,) in loader]
    assert [b.sum().item() for b in batches] == [6.0, 22.0, 38.0, 54.0]
    assert batches[0].device == torch.device("cuda", rank)


@distributed_test(world_size=2, device="cuda")
def test_torch_looks_like_a_cuda_build():
    assert torch.version.cuda is not None and not torch.cuda._is_in_bad_fork()
    assert torch._C._cuda_isInBadFork() is False
