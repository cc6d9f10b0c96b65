"""Data-loader names and behaviours Accelerate users rely on: the state mixin, stateful loaders, signatures."""

import inspect
import sys
import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from accel.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    get_sampler,
    prepare_data_loader,
    skip_first_batches,
)
from accel.state import GradientState

pytest.importorskip("torchdata")
pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")  # torchdata 0.11 on torch 2.13


class Numbers(IterableDataset):
    def __init__(self, length):
        self.length = length

    def __iter__(self):
        return iter(range(self.length))

    def __len__(self):
        return self.length


def _values(batches):
    return [b.tolist() for b in batches]


# -- use_stateful_dataloader ---------------------------------------------------------------------


def _source(kind):
    if kind == "stream":
        return DataLoader(Numbers(20), batch_size=2)
    generator = torch.Generator().manual_seed(3) if kind == "seeded" else None
    return DataLoader(list(range(20)), batch_size=2, shuffle=True, generator=generator)


@pytest.mark.parametrize("num_processes", [1, 2])
@pytest.mark.parametrize("kind", ["shuffled", "seeded", "stream"])
def test_stateful_loader_resumes_from_its_own_state(kind, num_processes):
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    source = _source(kind)
    options = dict(num_processes=num_processes, process_index=num_processes - 1, use_stateful_dataloader=True)
    loader = prepare_data_loader(source, **options)
    assert isinstance(loader, DataLoaderShard) and isinstance(loader, StatefulDataLoader)
    assert loader.use_stateful_dataloader and type(loader.base_dataloader) is StatefulDataLoader
    list(loader)  # a first epoch, so that the resumed one is not the first
    iterator = iter(loader)
    seen = _values(next(iterator) for _ in range(3))
    state = loader.state_dict()
    assert state["stateful_dataloader"]["_num_yielded"] == 3  # the look-ahead batch is not counted
    rest = _values(iterator)

    resumed = prepare_data_loader(source, **options)
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipping batches" on top of the stateful resume
        assert _values(resumed) == rest
    assert len(seen) + len(rest) == len(loader)
    assert resumed.state_dict()["stateful_dataloader"] is None  # between epochs: nothing to resume


def test_stateful_state_is_refused_by_a_plain_loader():
    source = _source("shuffled")
    loader = prepare_data_loader(source, num_processes=2, process_index=0, use_stateful_dataloader=True)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(ValueError, match="use_stateful_dataloader=True"):
        prepare_data_loader(source, num_processes=2, process_index=0).load_state_dict(loader.state_dict())


def test_stateful_loader_without_torchdata_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(ImportError, match="pip install torchdata"):
        prepare_data_loader(_source("shuffled"), num_processes=1, process_index=0, use_stateful_dataloader=True)


@pytest.mark.parametrize("kind", ["shuffled", "stream"])
def test_a_stateful_dispatcher_resumes_from_its_own_state(kind):
    # one process here; on 2 and 4: tests/multiproc/test_sharded_loading.py
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(1)
    source = _source(kind)
    loader = prepare_data_loader(source, dispatch_batches=True, use_stateful_dataloader=True)
    assert isinstance(loader, DataLoaderDispatcher) and isinstance(loader, StatefulDataLoader)
    iterator = iter(loader)
    seen = _values(next(iterator) for _ in range(4))
    state = loader.state_dict()
    # four batches handed out: the one the dispatcher read ahead is not counted
    assert state["stateful_dataloader"]["_num_yielded"] == 4 and state["batches_yielded"] == 4
    rest = _values(iterator)
    torch.manual_seed(2)
    resumed = prepare_data_loader(source, dispatch_batches=True, use_stateful_dataloader=True)
    resumed.load_state_dict(state)
    assert _values(resumed) == rest and len(seen) + len(rest) == 10
    assert sorted(sum(seen + rest, [])) == list(range(20))


def test_skip_first_batches_keeps_the_stateful_loader():
    loader = prepare_data_loader(_source("stream"), num_processes=1, process_index=0, use_stateful_dataloader=True)
    skipped = skip_first_batches(loader, 7)
    assert skipped.use_stateful_dataloader and _values(skipped) == [[14, 15], [16, 17], [18, 19]]


# -- DataLoaderStateMixin, SkipDataLoader, samplers ---------------------------------------------------


def test_prepared_loaders_are_data_loader_state_mixins():
    shard = prepare_data_loader(DataLoader(list(range(6)), batch_size=2), num_processes=2, process_index=0)
    dispatcher = prepare_data_loader(DataLoader(Numbers(6), batch_size=2), dispatch_batches=True)
    for loader in (shard, dispatcher, SkipDataLoader(Numbers(4), skip_batches=1, batch_size=2)):
        assert isinstance(loader, DataLoaderStateMixin) and isinstance(loader, DataLoader)
        assert loader.end_of_dataloader is False and loader.remainder == -1
        # as Accelerate's: a plain torch loader inside, over the same dataset
        assert type(loader.base_dataloader) is DataLoader and loader.base_dataloader.dataset is loader.dataset
        assert isinstance(loader.gradient_state, GradientState)
        loader.begin()
        assert GradientState().active_dataloader is loader
        loader.end_of_dataloader, loader.remainder = True, 1
        loader.reset()
        assert (loader.end_of_dataloader, loader.remainder) == (False, -1)
        loader.end()
        assert GradientState().active_dataloader is None


def test_skip_data_loader_tells_gradient_state_its_last_batch():
    loader = SkipDataLoader(Numbers(8), skip_batches=1, batch_size=2)
    seen = []
    for batch in loader:
        assert GradientState().active_dataloader is loader
        seen.append((batch.tolist(), GradientState().end_of_dataloader))
    assert seen == [([2, 3], False), ([4, 5], False), ([6, 7], True)]
    assert GradientState().active_dataloader is None and len(loader) == 3


def test_get_and_set_sampler():
    source = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    loader = prepare_data_loader(source, num_processes=2, process_index=0, use_seedable_sampler=True, data_seed=1)
    assert isinstance(get_sampler(loader), SeedableRandomSampler) and loader.get_sampler() is get_sampler(loader)
    order = SequentialSampler(range(8))
    loader.set_sampler(order)
    assert get_sampler(loader) is order and _values(loader) == [[0, 1], [4, 5]]
    assert SkipBatchSampler(BatchSampler(order, 2, False), 1).total_length == 4


def test_device_mesh_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="torch_device_mesh=None"):
        prepare_data_loader(DataLoader(list(range(4))), torch_device_mesh=object())


def test_one_process_is_left_as_accelerate_leaves_it():
    from accelerate.data_loader import prepare_data_loader as peer_prepare

    source = DataLoader(list(range(7)), batch_size=3)
    ours = prepare_data_loader(source, num_processes=1, process_index=0)
    assert (
        _values(ours)
        == _values(peer_prepare(source, num_processes=1, process_index=0))
        == [
            [0, 1, 2],
            [3, 4, 5],
            [6],
        ]
    )


# -- signatures --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "prepare_data_loader",
        "skip_first_batches",
        "BatchSamplerShard",
        "IterableDatasetShard",
        "DataLoaderShard",
        "DataLoaderDispatcher",
        "SkipBatchSampler",
        "SkipDataLoader",
        "get_sampler",
    ],
)
def test_parameters_are_accelerates(name):
    import accelerate.data_loader as peer

    import accel.data_loader as ours

    def parameters(obj):
        function = obj.__init__ if inspect.isclass(obj) else obj
        return {p.name: p.default for p in inspect.signature(function).parameters.values() if p.kind != p.VAR_KEYWORD}

    theirs, mine = parameters(getattr(peer, name)), parameters(getattr(ours, name))
    assert {k: v for k, v in mine.items() if k in theirs} == theirs
    assert list(theirs) == [k for k in mine if k in theirs]  # same order for positional use


def test_public_methods_are_accelerates():
    import accelerate.data_loader as peer

    for name in ("DataLoaderShard", "DataLoaderDispatcher", "SkipDataLoader", "DataLoaderStateMixin"):
        missing = {m for m in dir(getattr(peer, name)) if not m.startswith("_")} - set(
            dir(getattr(sys.modules["accel.data_loader"], name))
        )
        assert not missing, (name, missing)
    assert IterableDatasetShard and BatchSamplerShard and DataLoaderDispatcher


@pytest.mark.parametrize("stateful", [False, True])
def test_skip_data_loader_state_resumes_the_pass(stateful):
    loader = SkipDataLoader(Numbers(12), skip_batches=1, batch_size=2, use_stateful_dataloader=stateful)
    iterator = iter(loader)
    assert _values([next(iterator), next(iterator)]) == [[2, 3], [4, 5]]
    state = loader.state_dict()
    rest = _values(iterator)
    assert rest == [[6, 7], [8, 9], [10, 11]]
    resumed = SkipDataLoader(Numbers(12), skip_batches=1, batch_size=2, use_stateful_dataloader=stateful)
    resumed.load_state_dict(state)
    assert _values(resumed) == rest
    assert _values(resumed) == [[2, 3], [4, 5]] + rest  # the next pass is whole again


class EpochSampler(torch.utils.data.Sampler):
    """Sequential indices; records every set_epoch."""

    def __init__(self, size):
        self.size, self.epochs = size, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.size))

    def __len__(self):
        return self.size


class EpochNumbers(Numbers):
    def __init__(self, length):
        super().__init__(length)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


@pytest.mark.parametrize("iterable", [False, True])
def test_every_pass_sets_the_epoch_as_accelerate_does(iterable):
    from accelerate.data_loader import prepare_data_loader as peer_prepare

    epochs = []
    for prepare in (prepare_data_loader, peer_prepare):
        if iterable:
            holder = EpochNumbers(8)
            source = DataLoader(holder, batch_size=2)
        else:
            holder = EpochSampler(8)
            source = DataLoader(list(range(8)), batch_size=2, sampler=holder)
        loader = prepare(source, num_processes=2, process_index=0, dispatch_batches=False)
        for _ in range(3):
            list(loader)
        epochs.append(holder.epochs)
    assert epochs[0] == epochs[1] == [0, 1, 2]
