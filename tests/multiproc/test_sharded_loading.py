"""Data loading across real ranks, on simulated CPU, CUDA and XLA hardware."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from harness import distributed_test

SIZES = [2, 4]
DEVICES = ["cpu", "cuda", "xla"]


class Stream(IterableDataset):
    """Items 0..length-1 as float 0-d tensors, the same on every rank."""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        return iter(torch.arange(self.length, dtype=torch.float32))

    def __len__(self):
        return self.length


class Records(IterableDataset):
    """Nested samples of two dtypes, to check the dispatcher's structure and slicing."""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        for i in range(self.length):
            yield {"x": torch.full((3,), float(i)), "pair": (torch.tensor(i), torch.tensor([i, -i]))}

    def __len__(self):
        return self.length


def _values(batch):
    return batch.tolist()


@distributed_test(world_size=SIZES, device=DEVICES)
def test_dispatcher_broadcasts_one_collective_per_dtype_and_slices(rank, world_size):
    from accel.data_loader import prepare_data_loader
    from accel.state import PartialState

    hardware = PartialState().hardware
    calls = []
    original = hardware.broadcast
    hardware.broadcast = lambda t, src=0: calls.append(t.dtype) or original(t, src)
    loader = prepare_data_loader(DataLoader(Records(4 * world_size), batch_size=2), put_on_device=True)
    batches = list(loader)
    assert len(batches) == 2 and len(loader) == 2
    for step, batch in enumerate(batches):
        first = step * 2 * world_size + 2 * rank
        assert batch["pair"][0].tolist() == [first, first + 1]
        assert batch["x"].tolist() == [[float(first)] * 3, [float(first + 1)] * 3]
        assert batch["pair"][1].tolist() == [[first, -first], [first + 1, -first - 1]]
        assert batch["x"].dtype == torch.float32 and batch["pair"][0].dtype == torch.int64
    assert sorted(calls, key=str) == [torch.float32, torch.float32, torch.int64, torch.int64]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_dispatcher_split_batches_and_padding(rank, world_size):
    from accel.data_loader import prepare_data_loader

    loader = prepare_data_loader(
        DataLoader(Stream(2 * world_size + 1), batch_size=2 * world_size), split_batches=True, dispatch_batches=True
    )
    batches = [_values(b) for b in loader]
    assert batches[0] == [2.0 * rank, 2.0 * rank + 1]
    padded = [2.0 * world_size] + [float(i) for i in range(2 * world_size - 1)]
    assert batches[1] == padded[2 * rank : 2 * rank + 2]
    assert loader.remainder == 2 * world_size - 1


def _tenfold_slice(data, part, process_index=None, num_processes=None):
    from accel.utils.operations import slice_tensors

    return slice_tensors(data, part) * 10


@distributed_test(world_size=SIZES, device=DEVICES)
def test_dispatcher_uses_the_given_slice_function(rank, world_size):
    from accel.data_loader import prepare_data_loader

    loader = prepare_data_loader(
        DataLoader(Stream(2 * world_size), batch_size=2), slice_fn_for_dispatch=_tenfold_slice, dispatch_batches=True
    )
    assert [_values(b) for b in loader] == [[20.0 * rank, 20.0 * rank + 10]]


@pytest.mark.parametrize(
    "options", [{"rng_types": ["generator"]}, {"use_seedable_sampler": True}, {"rng_types": []}], ids=str
)
@distributed_test(world_size=SIZES, device=DEVICES)
def test_shuffling_is_identical_across_ranks(rank, world_size, options):
    from accel.data_loader import prepare_data_loader
    from accel.utils import gather_object

    length = 6 * world_size
    torch.manual_seed(100 + rank)  # different global seeds: the loader must still agree with itself
    loader = prepare_data_loader(DataLoader(list(range(length)), batch_size=3, shuffle=True), **options)
    orders = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        mine = [i for batch in loader for i in _values(batch)]
        everyone = gather_object([mine])
        assert sorted(i for part in everyone for i in part) == list(range(length))
        orders.append(everyone)
    assert orders[0] != orders[1]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_torch_rng_is_synchronised_at_each_iteration(rank, world_size):
    from accel.data_loader import prepare_data_loader
    from accel.utils import gather_object

    torch.manual_seed(rank)
    loader = prepare_data_loader(DataLoader(list(range(4 * world_size)), batch_size=2), rng_types=["torch"])
    for _ in loader:
        draws = gather_object([torch.rand(1).item()])
        assert len(set(draws)) == 1
        break


def _source(iterable, length, batch, drop):
    dataset = Stream(length) if iterable else torch.arange(length, dtype=torch.float32)
    return DataLoader(dataset, batch_size=batch, drop_last=drop)


def _expected(length, global_batch, drop):
    return [float(i) for i in range(length // global_batch * global_batch if drop else length)]


def _check_gathered(rank, gathered, expected, case):
    """Everything once on the main process; a process whose batches ran out first has a prefix of it."""
    if rank == 0:
        assert gathered == expected, case
    else:
        assert gathered == expected[: len(gathered)] and len(gathered) >= len(expected) - 2 * len(expected) // 3, case


#: every combination of (iterable, dispatch, split, even, drop), one test case each
LOADER_CONFIGURATIONS = list(itertools.product([False, True], repeat=5))


def _configuration_id(flags):
    names = ("iterable", "dispatch", "split", "even", "drop")
    return "-".join(name if on else f"no_{name}" for name, on in zip(names, flags, strict=True))


@pytest.mark.parametrize("configuration", LOADER_CONFIGURATIONS, ids=_configuration_id)
@distributed_test(world_size=SIZES, device=DEVICES)
def test_gather_for_metrics_is_exact_in_every_configuration(rank, world_size, configuration):
    from accel.data_loader import prepare_data_loader
    from accel.utils.metrics import gather_for_metrics

    iterable, dispatch, split, even, drop = configuration
    batch = 2
    per_batch = batch * world_size if split else batch
    global_batch = batch * world_size
    for length in (2 * global_batch, 2 * global_batch + 1, 3 * global_batch - 1):
        loader = prepare_data_loader(
            _source(iterable, length, per_batch, drop),
            split_batches=split,
            dispatch_batches=dispatch,
            even_batches=even,
            put_on_device=True,
        )
        tensors, objects = [], []
        for values in loader:
            tensors.append(gather_for_metrics({"v": values})["v"])
            objects.extend(gather_for_metrics([int(v) for v in values.tolist()], use_gather_object=True))
        expected = _expected(length, global_batch, drop)
        _check_gathered(rank, torch.cat(tensors).tolist(), expected, length)
        _check_gathered(rank, objects, [int(v) for v in expected], length)


@distributed_test(world_size=SIZES, device=DEVICES)
def test_uneven_last_batches_with_even_batches_off(rank, world_size):
    from accel.data_loader import prepare_data_loader
    from accel.utils import gather_object
    from accel.utils.metrics import gather_for_metrics

    length = 2 * world_size * 3 + 4  # two full rounds of batch 3, then 4 samples
    # on the device: the gathers below run on NCCL under simulated cuda, which refuses CPU tensors
    loader = prepare_data_loader(DataLoader(list(range(length)), batch_size=3), even_batches=False, put_on_device=True)
    sizes = gather_object([[len(b) for b in loader]])
    expected_last = {0: [3], 1: [1]}
    assert sizes[0] == [3, 3] + expected_last[0] and sizes[1] == [3, 3] + expected_last[1]
    assert all(s == [3, 3] for s in sizes[2:])
    gathered = [gather_for_metrics(b) for b in loader]
    _check_gathered(rank, torch.cat(gathered).tolist(), list(range(length)), "uneven")
    split = prepare_data_loader(
        DataLoader(list(range(2 * world_size + 1)), batch_size=2 * world_size), split_batches=True, even_batches=False
    )
    shares = gather_object([[_values(b) for b in split]])
    assert shares[0] == [[0, 1], [2 * world_size]] and all(len(s) == 1 for s in shares[1:])


@pytest.mark.parametrize("even", [True, False])
@distributed_test(world_size=SIZES, device=DEVICES)
def test_accelerator_gather_for_metrics_with_uneven_ends(rank, world_size, even):
    from accel import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=even))
    loader = accelerator.prepare(DataLoader(torch.arange(5 * world_size + 1), batch_size=2))
    gathered = [accelerator.gather_for_metrics(b) for b in loader]
    _check_gathered(rank, torch.cat(gathered).tolist(), list(range(5 * world_size + 1)), even)
    if even:
        assert torch.cat(gathered).tolist() == list(range(5 * world_size + 1))


@pytest.mark.parametrize("dispatch", [False, True])
@distributed_test(world_size=SIZES, device=DEVICES)
def test_skip_first_batches_lands_on_the_right_batch(rank, world_size, dispatch):
    from accel.data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader, skip_first_batches

    loader = prepare_data_loader(DataLoader(list(range(10 * world_size)), batch_size=2), dispatch_batches=dispatch)
    full = [_values(b) for b in loader]
    skipped = skip_first_batches(loader, 3)
    assert isinstance(skipped, DataLoaderDispatcher if dispatch else DataLoaderShard)
    assert [_values(b) for b in skipped] == full[3:]


@pytest.mark.parametrize("dispatch", [False, True])
@pytest.mark.parametrize("iterable", [False, True])
@distributed_test(world_size=SIZES, device=DEVICES)
def test_state_dict_resumes_on_the_next_batch(rank, world_size, dispatch, iterable):
    from accel.data_loader import prepare_data_loader

    def make():
        data = Stream(12 * world_size) if iterable else list(range(12 * world_size))
        return prepare_data_loader(
            DataLoader(data, batch_size=2, shuffle=not iterable), dispatch_batches=dispatch, rng_types=["generator"]
        )

    loader = make()
    list(loader)
    iterator = iter(loader)
    for _ in range(2):
        next(iterator)
    state = loader.state_dict()
    tail = [_values(b) for b in iterator]
    resumed = make()
    resumed.load_state_dict(state)
    assert [_values(b) for b in resumed] == tail


@distributed_test(world_size=2, device=DEVICES)
def test_put_on_device_goes_through_the_backend(rank, world_size):
    from accel.data_loader import DeviceLoaderWrapper, prepare_data_loader, skip_first_batches
    from accel.state import GradientState, PartialState

    state = PartialState()
    loader = prepare_data_loader(DataLoader(torch.arange(8 * world_size), batch_size=2), put_on_device=True)
    probe = DataLoader([0])
    assert isinstance(loader, DeviceLoaderWrapper) == (state.hardware.wrap_dataloader(probe, state.device) is not probe)
    assert loader.total_batch_size == 2 * world_size and len(loader) == 4
    ends = []
    for batch in loader:
        assert batch.device.type == state.device.type
        ends.append(GradientState().end_of_dataloader)
    assert ends == [False, False, False, True] and GradientState().active_dataloader is None
    loader.set_epoch(1)
    assert loader.iteration == 1
    skipped = skip_first_batches(loader, 3)
    assert type(skipped) is type(loader) and [b.tolist() for b in skipped] == [
        [6 * world_size + 2 * rank + i for i in range(2)]
    ]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_dispatcher_splits_batches_of_varying_sizes_without_losing_rows(rank, world_size):
    """Accelerate drops rows here (each process gets rows // n); every row reaches one process."""
    from accel.data_loader import prepare_data_loader

    # global batches (world_size batches each, concatenated) of 2n+1 and n+2 rows, then a last one of n-1
    sizes = [2 * world_size + 1, world_size + 2, world_size - 1]
    batches, start = [], 0
    for size in sizes[:2]:
        parts = [size - (world_size - 1)] + [1] * (world_size - 1)
        for part in parts:
            batches.append(list(range(start, start + part)))
            start += part
    batches.append(list(range(start, start + sizes[2])))
    data = torch.arange(start + sizes[2], dtype=torch.float32)
    loader = prepare_data_loader(DataLoader(data, batch_sampler=batches), dispatch_batches=True, put_on_device=True)
    firsts = [0, sizes[0], sizes[0] + sizes[1]]
    mine = [_values(b) for b in loader]
    from accel.utils.operations import gather_object

    everyone = gather_object([mine])
    assert all(len(theirs) == len(everyone[0]) for theirs in everyone)  # even_batches: as many batches each
    assert len(everyone[0]) == 3
    for step, size in enumerate(sizes):
        rows = [row for theirs in everyone for row in theirs[step]]
        expected = [float(i) for i in range(firsts[step], firsts[step] + size)]
        if size >= world_size:
            assert rows == expected  # slices differing by one row at most, none lost
            assert max(len(t[step]) for t in everyone) - min(len(t[step]) for t in everyone) <= 1
        else:  # too small to give everyone a row: completed from the first batch
            assert rows[:size] == expected and len(rows) == world_size


@distributed_test(world_size=SIZES, device=DEVICES)
def test_dispatcher_raises_the_same_type_error_on_every_rank(rank, world_size):
    import pytest

    from accel.data_loader import prepare_data_loader

    class Named(IterableDataset):
        def __iter__(self):
            for i in range(4 * world_size):
                yield {"x": torch.tensor(float(i)), "name": f"sample-{i}"}

    loader = prepare_data_loader(DataLoader(Named(), batch_size=2), put_on_device=True)
    with pytest.raises(TypeError, match="str"):
        list(loader)


@distributed_test(world_size=SIZES, device=DEVICES, timeout=120)
def test_stateful_loader_state_is_saved_and_restored_by_accelerator(tmp_path, world_size):
    pytest = __import__("pytest")
    pytest.importorskip("torchdata")
    from accel.accelerator import Accelerator
    from accel.utils.dataclasses import DataLoaderConfiguration

    def setup():
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        source = DataLoader(list(range(10 * world_size)), batch_size=2, shuffle=True)
        return acc, acc.prepare(source)

    torch.manual_seed(5)
    acc, loader = setup()
    assert loader.use_stateful_dataloader
    rest = []
    for step, batch in enumerate(loader):
        if step == 1:
            acc.save_state(tmp_path / "ckpt")
        elif step > 1:
            rest.append(_values(batch))

    torch.manual_seed(99)  # a different run: the order must come from the checkpoint
    acc, loader = setup()
    acc.load_state(tmp_path / "ckpt")
    assert [_values(b) for b in loader] == rest and len(rest) == 3


class _Stream(IterableDataset):
    """A stream that cannot be split by index (the dispatcher's case), `length` rows of (i, 10 * i)."""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        return iter({"x": torch.tensor(i), "y": torch.tensor(10 * i)} for i in range(self.length))


@distributed_test(world_size=SIZES, device=DEVICES, timeout=180)
@pytest.mark.parametrize("kind", ["stream", "shuffled"])
@pytest.mark.parametrize("split_batches", [False, True])
def test_stateful_dispatcher_resumes_where_its_state_was_taken(world_size, kind, split_batches):
    """dispatch_batches=True with use_stateful_dataloader=True: the main process reads one global batch ahead,
    the state handed out is that of the batches given out; a loader loading it yields exactly the rest (a short
    last batch, evened out, included), on every process, via state_dict and via the loader's own resume."""
    pytest = __import__("pytest")
    pytest.importorskip("torchdata")
    from accel.data_loader import DataLoaderDispatcher
    from accel.state import PartialState
    from accel.utils.operations import gather

    rows = 16 * world_size + 1  # eight global batches and a short last one (one row), evened out
    per_batch = 2 * world_size if split_batches else 2

    def fresh():
        from accel.data_loader import prepare_data_loader

        dataset = _Stream(rows) if kind == "stream" else [{"x": i, "y": 10 * i} for i in range(rows)]
        source = DataLoader(dataset, batch_size=per_batch, shuffle=kind == "shuffled")
        options = dict(dispatch_batches=True, use_stateful_dataloader=True, split_batches=split_batches)
        return prepare_data_loader(source, put_on_device=True, **options)

    def seen(batches, padding):  # every process's real rows of each batch, the same list on every process
        rows = [gather(b["x"]).tolist() for b in batches]
        rows[-1] = rows[-1][: len(rows[-1]) - padding]  # the rows that even out the last batch are not data
        return rows

    torch.manual_seed(3)
    loader = fresh()
    inner = getattr(loader, "_loader", loader)  # on XLA: inside the device loader's wrapper
    assert isinstance(inner, DataLoaderDispatcher) and loader.use_stateful_dataloader
    rest, state = [], None
    for step, batch in enumerate(loader):
        assert torch.equal(batch["y"], 10 * batch["x"])
        if step == 2:
            state = loader.state_dict()
        elif step > 2:
            rest.append(batch)
    rest = seen(rest, loader.remainder)
    assert loader.remainder == 2 * world_size - 1
    main = PartialState().is_main_process
    if main:  # three global batches of the wrapped loader's batches handed out, none of the one read ahead
        assert state["stateful_dataloader"]["_num_yielded"] == 3 * (1 if split_batches else world_size)
    assert state["batches_yielded"] == 3

    torch.manual_seed(77)  # another run: the order must come from the state
    resumed = fresh()
    resumed.load_state_dict(state)
    assert seen(list(resumed), loader.remainder) == rest and len(rest) == 9 - 3
    assert resumed.remainder == loader.remainder
    assert sorted(sum(rest, [])) == list(range(rows))[-len(sum(rest, [])) :] or kind == "shuffled"
    # the same loader, resumed from the same state a second time
    loader.load_state_dict(state)
    assert seen(list(loader), loader.remainder) == rest
    assert loader.state_dict()["stateful_dataloader"] is None  # between epochs: nothing to resume


@distributed_test(world_size=SIZES, device=["cpu", "cuda"], timeout=180)
def test_stateful_dispatcher_state_is_saved_and_restored_by_accelerator(tmp_path, world_size):
    pytest = __import__("pytest")
    pytest.importorskip("torchdata")
    from accel.accelerator import Accelerator
    from accel.data_loader import DataLoaderDispatcher
    from accel.utils.dataclasses import DataLoaderConfiguration

    def setup():
        config = DataLoaderConfiguration(use_stateful_dataloader=True, dispatch_batches=True)
        acc = Accelerator(dataloader_config=config)
        source = DataLoader(list(range(10 * world_size)), batch_size=2, shuffle=True)
        return acc, acc.prepare(source)

    torch.manual_seed(5)
    acc, loader = setup()
    assert isinstance(loader, DataLoaderDispatcher) and loader.use_stateful_dataloader
    rest = []
    for step, batch in enumerate(loader):
        if step == 1:
            acc.save_state(tmp_path / "ckpt")
        elif step > 1:
            rest.append(_values(batch))

    torch.manual_seed(99)
    acc, loader = setup()
    acc.load_state(tmp_path / "ckpt")
    assert [_values(b) for b in loader] == rest and len(rest) == 3
