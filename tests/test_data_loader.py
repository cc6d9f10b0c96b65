"""Single-process tests of data loading across processes.

Every process's shard is built here in one process, by passing `num_processes` and
`process_index` explicitly; the multi-rank behaviour (collectives) is in
tests/multiproc/test_data_loader.py.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from accel.data_loader import (
    BatchSamplerShard,
    DataLoaderDispatcher,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from accel.state import GradientState

PROPERTY = settings(max_examples=120, deadline=None)


class Stream(IterableDataset):
    """Items 0..length-1 as 0-d tensors (or plain ints)."""

    def __init__(self, length, tensors=True):
        self.length = length
        self.tensors = tensors

    def __iter__(self):
        for i in range(self.length):
            yield torch.tensor(i) if self.tensors else i

    def __len__(self):
        return self.length


class Opaque:
    """A batch sampler that is not a `BatchSampler`: forces the generic sharding path."""

    def __init__(self, batch_sampler, batch_size="same"):
        self.inner = batch_sampler
        self.batch_size = batch_sampler.batch_size if batch_size == "same" else batch_size
        self.drop_last = batch_sampler.drop_last

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


class Listed:
    """A batch sampler yielding the given batches (of any sizes)."""

    def __init__(self, batches, batch_size=None, drop_last=False):
        self.batches = batches
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self):
        return len(self.batches)


def stepwise(per_process):
    """Concatenate the processes' batches step by step, in process order (what a gather returns)."""
    steps = max((len(b) for b in per_process), default=0)
    return [i for k in range(steps) for batches in per_process if k < len(batches) for i in batches[k]]


def values(batch):
    return batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)


# -- worked examples of the reference pages ----------------------------------------------------


def test_batch_sampler_shard_worked_example():
    batches = BatchSampler(SequentialSampler(range(8)), 4, drop_last=False)
    assert [list(BatchSamplerShard(batches, 2, r)) for r in range(2)] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    split = [list(BatchSamplerShard(batches, 2, r, split_batches=True)) for r in range(2)]
    assert split == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_iterable_dataset_shard_worked_example():
    shards = [list(IterableDatasetShard(range(8), batch_size=4, num_processes=2, process_index=r)) for r in range(2)]
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7]]
    split = [
        list(IterableDatasetShard(range(8), batch_size=4, num_processes=2, process_index=r, split_batches=True))
        for r in range(2)
    ]
    assert split == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_even_batches_loops_back_to_the_start():
    batches = BatchSampler(SequentialSampler(range(10)), 3, drop_last=False)
    shards = [BatchSamplerShard(batches, 2, r) for r in range(2)]
    assert [list(s) for s in shards] == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
    assert shards[0].padding == 2
    uneven = [list(BatchSamplerShard(batches, 2, r, even_batches=False)) for r in range(2)]
    assert uneven == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]


def test_drop_last_stops_at_the_first_incomplete_round():
    batches = BatchSampler(SequentialSampler(range(11)), 2, drop_last=True)
    assert [list(BatchSamplerShard(batches, 2, r)) for r in range(2)] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert [len(BatchSamplerShard(batches, 2, r)) for r in range(2)] == [2, 2]


def test_split_batches_even_and_uneven_last_batch():
    batches = BatchSampler(SequentialSampler(range(7)), 4, drop_last=False)
    assert [list(BatchSamplerShard(batches, 2, r, split_batches=True)) for r in range(2)] == [
        [[0, 1], [4, 5]],
        [[2, 3], [6, 0]],
    ]
    uneven = [list(BatchSamplerShard(batches, 2, r, split_batches=True, even_batches=False)) for r in range(2)]
    assert uneven == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    tiny = BatchSampler(SequentialSampler(range(5)), 4, drop_last=False)
    short = [BatchSamplerShard(tiny, 2, r, split_batches=True, even_batches=False) for r in range(2)]
    assert [list(s) for s in short] == [[[0, 1], [4]], [[2, 3]]]
    assert [len(s) for s in short] == [2, 1]


def test_dataset_smaller_than_one_round_is_cycled():
    batches = BatchSampler(SequentialSampler(range(3)), 2, drop_last=False)
    assert [list(BatchSamplerShard(batches, 3, r)) for r in range(3)] == [[[0, 1]], [[2, 0]], [[1, 2]]]


# -- properties over every layout --------------------------------------------------------------


layouts = st.fixed_dictionaries(
    {
        "length": st.integers(0, 45),
        "batch": st.integers(1, 5),
        "n": st.integers(1, 4),
        "split": st.booleans(),
        "even": st.booleans(),
        "drop": st.booleans(),
    }
)


def _expected_coverage(length, global_batch, drop):
    return list(range(length // global_batch * global_batch)) if drop else list(range(length))


@PROPERTY
@given(layouts)
def test_batch_sampler_shards_cover_the_data_as_specified(layout):
    length, n, split, even, drop = (layout[k] for k in ("length", "n", "split", "even", "drop"))
    batch = layout["batch"] * n if split else layout["batch"]
    base = BatchSampler(SequentialSampler(range(length)), batch, drop_last=drop)
    shards = [BatchSamplerShard(base, n, r, split_batches=split, even_batches=even) for r in range(n)]
    per_process = [list(shard) for shard in shards]
    # The generic path (any batch sampler) and the fast path (plain BatchSampler) agree.
    assert per_process == [list(BatchSamplerShard(Opaque(base), n, r, split, even)) for r in range(n)]
    assert [len(s) for s in shards] == [len(b) for b in per_process]
    process_batch = batch // n if split else batch
    global_batch = batch if split else batch * n
    if drop or even:  # one process too: its short last batch is completed, as in Accelerate
        assert len({len(b) for b in per_process}) == 1
        assert all(len(b) == process_batch for batches in per_process for b in batches)
    gathered = stepwise(per_process)
    padding = shards[0].padding
    assert all(s.padding == padding for s in shards)
    assert gathered[: len(gathered) - padding] == _expected_coverage(length, global_batch, drop)
    if even and not drop and length:
        assert len(gathered) % global_batch == 0 and 0 <= padding < global_batch
        assert gathered[len(gathered) - padding :] == list(itertools.islice(itertools.cycle(range(length)), padding))
    else:
        assert padding == 0


@PROPERTY
@given(layouts)
def test_iterable_shards_cover_the_data_as_specified(layout):
    length, n, split, drop = (layout[k] for k in ("length", "n", "split", "drop"))
    batch = layout["batch"] * n if split else layout["batch"]
    shards = [IterableDatasetShard(range(length), batch, drop, n, r, split) for r in range(n)]
    streams = [list(shard) for shard in shards]
    process_batch = shards[0].process_batch_size
    assert len({len(s) for s in streams}) == 1
    assert all(len(s) % process_batch == 0 for s in streams)
    assert [len(s) for s in shards] == [len(s) for s in streams]
    per_process = [[s[i : i + process_batch] for i in range(0, len(s), process_batch)] for s in streams]
    gathered = stepwise(per_process)
    padding = shards[0].padding
    assert padding == shards[0].expected_padding()
    assert gathered[: len(gathered) - padding] == _expected_coverage(length, shards[0].global_batch_size, drop)


def _run_prepared(loader):
    """Batches of a prepared loader, with (end_of_dataloader, remainder) as GradientState saw them."""
    seen = []
    for batch in loader:
        state = GradientState()
        assert state.active_dataloader is loader
        seen.append((values(batch), state.end_of_dataloader, state.remainder))
    assert GradientState().active_dataloader is None
    return seen


@PROPERTY
@given(layouts, st.booleans())
def test_prepared_loaders_gather_each_sample_once(layout, iterable):
    length, n, split, even, drop = (layout[k] for k in ("length", "n", "split", "even", "drop"))
    batch = layout["batch"] * n if split else layout["batch"]
    dataset = Stream(length) if iterable else list(range(length))
    source = DataLoader(dataset, batch_size=batch, drop_last=drop)
    loaders = [
        prepare_data_loader(
            source, num_processes=n, process_index=r, split_batches=split, even_batches=even, dispatch_batches=False
        )
        for r in range(n)
    ]
    runs = [_run_prepared(loader) for loader in loaders]
    assert [len(loader) for loader in loaders] == [len(run) for run in runs]
    for run in runs:
        assert [end for _, end, _ in run] == [False] * (len(run) - 1) + [True] * bool(run)
    assert loaders[0].total_batch_size == (batch if split else batch * n)
    gathered = stepwise([[b for b, _, _ in run] for run in runs])
    remainder = max((run[-1][2] for run in runs if run), default=0)
    assert gathered[: len(gathered) - remainder] == _expected_coverage(length, loaders[0].total_batch_size, drop)


# -- errors ------------------------------------------------------------------------------------


def test_split_batches_needs_a_divisible_batch_size():
    batches = BatchSampler(SequentialSampler(range(8)), 3, drop_last=False)
    with pytest.raises(ValueError, match=r"batch_size=3 .*num_processes=2"):
        BatchSamplerShard(batches, 2, 0, split_batches=True)
    with pytest.raises(ValueError, match=r"batch_size=3 .*num_processes=2"):
        IterableDatasetShard(range(8), batch_size=3, num_processes=2, split_batches=True)
    with pytest.raises(ValueError, match=r"batch_size=3 .*num_processes=2"):
        prepare_data_loader(DataLoader(range(8), batch_size=3), num_processes=2, process_index=0, split_batches=True)


def test_varying_batch_sizes_even_out_the_number_of_batches():
    varying = Listed([[0, 1, 2], [3], [4, 5]])
    # even_batches=True: the last round is completed with whole batches from the start
    shards = [list(BatchSamplerShard(varying, 2, r)) for r in range(2)]
    assert shards == [[[0, 1, 2], [4, 5]], [[3], [0, 1, 2]]]
    assert [len(BatchSamplerShard(varying, 2, r)) for r in range(2)] == [2, 2]
    shards = [list(BatchSamplerShard(varying, 2, r, even_batches=False)) for r in range(2)]
    assert shards == [[[0, 1, 2], [4, 5]], [[3]]]
    declared = Listed([[0, 1, 2], [3], [4, 5, 6]], batch_size=3)
    with pytest.raises(ValueError, match=r"batch_size=3.*a batch of 3 indices after a shorter one"):
        list(BatchSamplerShard(declared, 2, 0))
    loaders = [
        prepare_data_loader(DataLoader(range(7), batch_sampler=varying), num_processes=2, process_index=r)
        for r in range(2)
    ]
    assert [[b.tolist() for b in loader] for loader in loaders] == [[[0, 1, 2], [4, 5]], [[3], [0, 1, 2]]]


@pytest.mark.parametrize("num_processes", [1, 2, 4])
@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize(
    ("sampler", "split"), [("fixed", False), ("fixed", True), ("varying", False)]
)  # split_batches needs a batch size
def test_batch_sampler_shard_yields_what_accelerates_yields(sampler, split, even, num_processes):
    from accelerate.data_loader import BatchSamplerShard as PeerShard

    if sampler == "fixed":
        base = BatchSampler(SequentialSampler(range(11)), 4 if split else 3, drop_last=False)
    else:
        base = Listed([[0], [1, 2], [3, 4, 5], [6, 7, 8, 9], [0, 1, 2]])
    for rank in range(num_processes):
        ours = BatchSamplerShard(base, num_processes, rank, split_batches=split, even_batches=even)
        theirs = PeerShard(base, num_processes, rank, split_batches=split, even_batches=even)
        batches = list(ours)
        assert batches == list(theirs)
        # (Accelerate's len() counts the split last batch even where this process gets none of it)
        assert len(ours) == len(batches)


def test_bad_process_layout_is_rejected():
    batches = BatchSampler(SequentialSampler(range(8)), 2, drop_last=False)
    with pytest.raises(ValueError, match=r"process_index must be in \[0, 2\), got 2"):
        BatchSamplerShard(batches, 2, 2)
    with pytest.raises(ValueError, match="num_processes must be a positive integer, got 0"):
        IterableDatasetShard(range(4), num_processes=0)


def test_dispatcher_rejects_batches_without_tensors():
    # as Accelerate: a batch must hold a tensor to have a batch size (non-tensor values alongside pass along)
    loader = prepare_data_loader(
        DataLoader(Stream(4, tensors=False), batch_size=2, collate_fn=lambda items: {"text": ["a"] * len(items)}),
        dispatch_batches=True,
    )
    assert isinstance(loader, DataLoaderDispatcher)
    with pytest.raises(TypeError, match="batch size"):
        list(loader)


def test_dispatch_needs_the_running_processes():
    with pytest.raises(ValueError, match="num_processes=2 and process_index=1"):
        prepare_data_loader(
            DataLoader(Stream(4), batch_size=2), num_processes=2, process_index=1, dispatch_batches=True
        )


@pytest.mark.parametrize("put_on_device", [False, True])
def test_iterable_datasets_are_dispatched_by_default_only_when_put_on_device(put_on_device):
    from accelerate.data_loader import DataLoaderDispatcher as PeerDispatcher
    from accelerate.data_loader import prepare_data_loader as peer_prepare

    ours = prepare_data_loader(DataLoader(Stream(4), batch_size=2), put_on_device=put_on_device)
    theirs = peer_prepare(DataLoader(Stream(4), batch_size=2), put_on_device=put_on_device)
    assert isinstance(ours, DataLoaderDispatcher) == put_on_device == isinstance(theirs, PeerDispatcher)
    assert [values(b) for b in ours] == [[0, 1], [2, 3]]


# -- GradientState wiring ----------------------------------------------------------------------


def test_nested_loops_follow_the_innermost_loader():
    train = prepare_data_loader(DataLoader(list(range(4)), batch_size=2))
    evaluation = prepare_data_loader(DataLoader(list(range(3)), batch_size=2))
    state = GradientState()
    trace = []
    for _ in train:
        trace.append(("train", state.active_dataloader is train, state.end_of_dataloader))
        for _ in evaluation:
            trace.append(("eval", state.active_dataloader is evaluation, state.end_of_dataloader))
        trace.append(("train again", state.active_dataloader is train, state.end_of_dataloader))
    assert state.active_dataloader is None and not state.in_dataloader
    assert trace[:4] == [
        ("train", True, False),
        ("eval", True, False),
        ("eval", True, True),
        ("train again", True, False),
    ]
    assert trace[4:] == [
        ("train", True, True),
        ("eval", True, False),
        ("eval", True, True),
        ("train again", True, True),
    ]


def test_breaking_out_of_a_loop_unregisters_the_loader():
    loader = prepare_data_loader(DataLoader(list(range(10)), batch_size=2))
    for _ in loader:
        break
    assert GradientState().active_dataloader is None


def test_remainder_is_unknown_until_the_last_batch():
    loaders = [
        prepare_data_loader(DataLoader(list(range(5)), batch_size=2), num_processes=2, process_index=r)
        for r in range(2)
    ]
    seen = [[(loader.end_of_dataloader, loader.remainder) for _ in loader] for loader in loaders]
    assert seen == [[(False, -1), (True, 3)]] * 2


# -- sizes and epochs --------------------------------------------------------------------------


def test_total_batch_size_and_dataset_length():
    source = DataLoader(list(range(10)), batch_size=4)
    assert prepare_data_loader(source, num_processes=2, process_index=0).total_batch_size == 8
    split = prepare_data_loader(source, num_processes=2, process_index=0, split_batches=True)
    assert split.total_batch_size == 4 and split.total_dataset_length == 10
    stream = prepare_data_loader(
        DataLoader(Stream(10), batch_size=4), num_processes=2, process_index=1, dispatch_batches=False
    )
    assert stream.total_batch_size == 8 and stream.total_dataset_length == 10
    assert isinstance(stream.dataset, IterableDatasetShard)


class EpochSampler(SequentialSampler):
    def __init__(self, data):
        super().__init__(data)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


class EpochStream(Stream):
    def __init__(self, length):
        super().__init__(length)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def test_set_epoch_reaches_samplers_and_datasets():
    sampler = EpochSampler(range(8))
    loader = prepare_data_loader(
        DataLoader(list(range(8)), batch_size=2, sampler=sampler), num_processes=2, process_index=0
    )
    loader.set_epoch(3)
    assert sampler.epochs == [3] and loader.iteration == 3
    stream = EpochStream(8)
    shard = prepare_data_loader(
        DataLoader(stream, batch_size=2), num_processes=2, process_index=0, dispatch_batches=False
    )
    shard.set_epoch(5)
    assert stream.epochs == [5] and shard.dataset.epoch == 5


def test_seedable_random_sampler_depends_on_seed_and_epoch_only():
    data = range(20)
    first, second = SeedableRandomSampler(data, data_seed=7), SeedableRandomSampler(data, data_seed=7)
    torch.manual_seed(123)  # the global RNG plays no part
    assert list(first) == list(second)
    epoch0 = SeedableRandomSampler(data, data_seed=7)
    order0 = list(epoch0)
    assert sorted(order0) == list(data)
    assert epoch0.epoch == 1 and list(epoch0) != order0  # a complete pass moves to the next epoch
    epoch0.set_epoch(0)
    assert list(epoch0) == order0
    assert list(SeedableRandomSampler(data, data_seed=8)) != order0
    drawn = list(SeedableRandomSampler(data, replacement=True, num_samples=50, data_seed=1))
    assert len(drawn) == 50 and set(drawn) <= set(data)
    assert len(list(SeedableRandomSampler(data, num_samples=45, data_seed=1))) == 45


def test_use_seedable_sampler_gives_every_process_the_same_order():
    source = DataLoader(list(range(16)), batch_size=2, shuffle=True)
    loaders = [
        prepare_data_loader(source, num_processes=2, process_index=r, use_seedable_sampler=True, data_seed=3)
        for r in range(2)
    ]
    for epoch in range(2):
        for loader in loaders:
            loader.set_epoch(epoch)
        gathered = stepwise([[values(b) for b in loader] for loader in loaders])
        assert sorted(gathered) == list(range(16))
    assert isinstance(loaders[0].batch_sampler.sampler, SeedableRandomSampler)


def test_shuffled_loader_gets_a_private_generator_and_leaves_the_original_alone():
    source = DataLoader(list(range(16)), batch_size=2, shuffle=True)
    loader = prepare_data_loader(source, num_processes=2, process_index=0, rng_types=["generator"])
    assert isinstance(loader.synchronized_generator, torch.Generator)
    assert loader.batch_sampler.sampler.generator is loader.synchronized_generator
    assert source.sampler.generator is None


# -- device placement ----------------------------------------------------------------------------


def test_put_on_device_keeps_batches_and_structure():
    data = [{"x": torch.tensor([float(i)]), "y": i} for i in range(4)]
    loader = prepare_data_loader(DataLoader(data, batch_size=2), device=torch.device("cpu"), put_on_device=True)
    batches = list(loader)
    assert [b["x"].tolist() for b in batches] == [[[0.0], [1.0]], [[2.0], [3.0]]]
    assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3]]
    assert loader.device == torch.device("cpu")


@pytest.mark.parametrize("kind", [tuple, list, dict, "tensor", "nested"])
def test_put_on_device_moves_every_leaf_and_keeps_the_container(kind):
    x, y = torch.arange(8.0).reshape(4, 2), torch.arange(4)
    if kind == "tensor":
        data, batch_of = x, lambda b: [b]
    elif kind == "nested":
        data = [{"x": x[i], "pair": (y[i], y[i])} for i in range(4)]
        batch_of = lambda b: [b["x"], *b["pair"]]  # noqa: E731
    elif kind is dict:
        data, batch_of = [{"x": x[i], "y": y[i]} for i in range(4)], lambda b: list(b.values())
    else:
        data, batch_of = list(zip(x, y, strict=True)), list
    collate = None  # default_collate: a dict, a tensor, or lists for sequences
    if kind in (list, tuple):
        collate = lambda items: kind(torch.stack(column) for column in zip(*items, strict=True))  # noqa: E731
    meta = torch.device("meta")  # a device other than the CPU's, available everywhere
    loader = prepare_data_loader(DataLoader(data, batch_size=2, collate_fn=collate), device=meta, put_on_device=True)
    batches = list(loader)
    assert len(batches) == 2
    for batch in batches:
        assert type(batch) is (type(batch) if kind in ("tensor", "nested") else kind)
        assert all(t.device == meta for t in batch_of(batch))
    placed = loader._placer()
    on_meta = (x.to(meta), y.to(meta))
    assert placed(on_meta) is on_meta  # already there: the very same batch


def test_put_on_the_cpu_hands_on_batches_already_there_and_walks_the_others():
    loader = prepare_data_loader(
        DataLoader(list(range(4)), batch_size=2), device=torch.device("cpu"), put_on_device=True
    )
    place = loader._placer()
    x, y = torch.zeros(2), torch.ones(2)
    for batch in ((x, y), [x, y], {"x": x, "y": y}, x):
        assert place(batch) is batch
    nested = {"x": x, "pair": [y, "label"], "n": 3}
    placed = place(nested)
    assert placed["x"] is x and placed["pair"][0] is y and placed["pair"][1] == "label" and placed["n"] == 3


# -- skipping ----------------------------------------------------------------------------------


def test_skip_first_batches_of_a_plain_loader_keeps_its_kind():
    skipped = skip_first_batches(DataLoader(list(range(10)), batch_size=3), 2)
    assert type(skipped) is DataLoader and [values(b) for b in skipped] == [[6, 7, 8], [9]]
    assert len(skipped) == 2
    stream = skip_first_batches(DataLoader(Stream(10), batch_size=3), 2)
    assert isinstance(stream, SkipDataLoader) and [values(b) for b in stream] == [[6, 7, 8], [9]]


def test_skip_first_batches_of_shards():
    source = DataLoader(list(range(20)), batch_size=2)
    shard = prepare_data_loader(source, num_processes=2, process_index=1)
    skipped = skip_first_batches(shard, 2)
    assert isinstance(skipped, DataLoaderShard)
    assert [values(b) for b in skipped] == [values(b) for b in shard][2:]
    assert len(skipped) == len(shard) - 2 and skipped.total_batch_size == shard.total_batch_size
    stream = prepare_data_loader(
        DataLoader(Stream(20), batch_size=2), num_processes=2, process_index=0, dispatch_batches=False
    )
    skipped_stream = skip_first_batches(stream, 3)
    assert isinstance(skipped_stream, DataLoaderShard)
    assert [values(b) for b in skipped_stream] == [values(b) for b in stream][3:]


def test_skip_first_batches_of_a_dispatcher():
    dispatcher = prepare_data_loader(DataLoader(Stream(10), batch_size=3), dispatch_batches=True)
    skipped = skip_first_batches(dispatcher, 1)
    assert isinstance(skipped, DataLoaderDispatcher)
    assert [values(b) for b in skipped] == [[3, 4, 5], [6, 7, 8], [9]]


def test_skipped_batches_are_not_loaded():
    loaded = []

    class Recording(list):
        def __getitem__(self, index):
            loaded.append(index)
            return super().__getitem__(index)

    shard = prepare_data_loader(DataLoader(Recording(range(12)), batch_size=2), num_processes=2, process_index=0)
    assert [values(b) for b in skip_first_batches(shard, 2)] == [[8, 9]]
    assert loaded == [8, 9]


# -- resume --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["shuffled", "seedable", "stream", "dispatcher"])
def test_state_dict_resumes_on_the_next_batch(kind):
    torch.manual_seed(0)
    if kind == "stream":

        def make():
            return prepare_data_loader(
                DataLoader(Stream(20), batch_size=2), num_processes=2, process_index=1, dispatch_batches=False
            )
    elif kind == "dispatcher":

        def make():
            return prepare_data_loader(DataLoader(Stream(20), batch_size=2), dispatch_batches=True)

    else:
        source = DataLoader(list(range(20)), batch_size=2, shuffle=True)
        seedable = kind == "seedable"

        def make():
            return prepare_data_loader(
                source,
                num_processes=2,
                process_index=0,
                rng_types=["generator"],
                use_seedable_sampler=seedable,
                data_seed=5,
            )

    loader = make()
    list(loader)  # a whole first epoch, so that the resumed one is not the first
    iterator = iter(loader)
    head = [values(next(iterator)) for _ in range(2)]
    state = loader.state_dict()
    tail = [values(b) for b in iterator]
    assert tail
    resumed = make()
    resumed.load_state_dict(state)
    assert [values(b) for b in resumed] == tail
    assert resumed.state_dict()["batches_yielded"] == 0 and resumed.iteration == loader.iteration
    assert head and head[0] not in tail or kind in ("stream", "dispatcher")


def test_resuming_mid_epoch_leaves_the_global_rng_as_the_uninterrupted_run_has_it():
    source = DataLoader(list(range(12)), batch_size=2, shuffle=True)
    loader = prepare_data_loader(source, num_processes=2, process_index=0)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    rng_after_first_batch = torch.get_rng_state()
    resumed = prepare_data_loader(source, num_processes=2, process_index=0)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng_after_first_batch)  # as Accelerator.load_state restores it
    resumed_iterator = iter(resumed)
    next(resumed_iterator)
    assert torch.equal(torch.get_rng_state(), rng_after_first_batch)  # no second base-seed draw
    assert next(resumed_iterator) is not None


def test_state_between_epochs_starts_the_next_epoch():
    source = DataLoader(list(range(12)), batch_size=2, shuffle=True)
    loader = prepare_data_loader(source, num_processes=2, process_index=0, rng_types=["generator"])
    list(loader)
    state = loader.state_dict()
    expected = [values(b) for b in loader]
    twin = prepare_data_loader(source, num_processes=2, process_index=0, rng_types=["generator"])
    twin.load_state_dict(state)
    assert [values(b) for b in twin] == expected and twin.iteration == 2


def test_load_state_dict_rejects_other_states():
    loader = prepare_data_loader(DataLoader(list(range(4)), batch_size=2))
    with pytest.raises(ValueError, match="batches_yielded"):
        loader.load_state_dict({"epoch": 1})


# -- plain gather_for_metrics in one process ---------------------------------------------------------


def test_gather_for_metrics_in_one_process_returns_the_input():
    from accel.utils.metrics import gather_for_metrics

    data = {"logits": torch.ones(2, 3), "labels": [1, 2]}
    assert gather_for_metrics(data) is data
    assert gather_for_metrics(["a", "b"], use_gather_object=True) == ["a", "b"]


def test_random_sampler_order_is_the_same_for_every_shard_built_alike():
    torch.manual_seed(11)
    generator = torch.Generator().manual_seed(4)
    base = BatchSampler(RandomSampler(range(30), generator=generator), 4, drop_last=False)
    state = generator.get_state()
    per_process = []
    for r in range(3):
        generator.set_state(state)  # what the "generator" RNG sync does across processes
        per_process.append(list(BatchSamplerShard(base, 3, r)))
    assert sorted(stepwise(per_process)[:30]) == list(range(30))


def test_worker_processes_with_persistent_workers():
    source = DataLoader(list(range(10)), batch_size=2, num_workers=1, persistent_workers=True)
    loaders = [prepare_data_loader(source, num_processes=2, process_index=r) for r in range(2)]
    runs = [_run_prepared(loader) for loader in loaders]
    assert stepwise([[b for b, _, _ in run] for run in runs]) == list(range(10)) + [0, 1]
    assert [run[-1][2] for run in runs] == [2, 2]
    iterator = iter(loaders[1])
    next(iterator)
    state = loaders[1].state_dict()
    rest = [values(b) for b in iterator]
    loaders[1].load_state_dict(state)
    assert [values(b) for b in loaders[1]] == rest  # skipped by reading, the workers being persistent


class SeededStream(IterableDataset):
    """A shuffled stream whose order comes from its own generator."""

    def __init__(self, length):
        self.length = length
        self.generator = torch.Generator().manual_seed(0)

    def __iter__(self):
        return iter(torch.randperm(self.length, generator=self.generator).tolist())


def test_iterable_dataset_generator_is_the_synchronised_one_and_resumes():
    stream = SeededStream(12)

    def make():
        return prepare_data_loader(
            DataLoader(stream, batch_size=2),
            num_processes=2,
            process_index=0,
            rng_types=["generator"],
            dispatch_batches=False,
        )

    loader = make()
    assert loader.synchronized_generator is stream.generator
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    rest = [values(b) for b in iterator]
    resumed = make()
    resumed.load_state_dict(state)
    assert [values(b) for b in resumed] == rest


class BatchIndexed(torch.utils.data.Dataset):
    """A dataset indexed by whole lists of indices (used with a BatchSampler as `sampler`)."""

    def __getitem__(self, indices):
        return torch.tensor(indices)

    def __len__(self):
        return 10


def test_batch_sampler_given_as_sampler_is_sharded():
    source = DataLoader(BatchIndexed(), sampler=BatchSampler(SequentialSampler(range(10)), 2, False), batch_size=None)
    loaders = [prepare_data_loader(source, num_processes=2, process_index=r) for r in range(2)]
    assert [[values(b) for b in loader] for loader in loaders] == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    assert loaders[0].total_batch_size == 4 and loaders[0]._last_padding() == 2
    assert [values(b) for b in skip_first_batches(loaders[1], 1)] == [[6, 7], [0, 1]]


def test_unbatched_map_style_loader_cannot_be_sharded():
    source = DataLoader(list(range(4)), batch_size=None)
    with pytest.raises(ValueError, match="batch_size=None across 2 processes"):
        prepare_data_loader(source, num_processes=2, process_index=0)
    assert [values(torch.as_tensor(b)) for b in prepare_data_loader(source, num_processes=1, process_index=0)] == [
        0,
        1,
        2,
        3,
    ]


@PROPERTY
@given(layouts, st.integers(0, 3), st.integers(0, 12), st.booleans())
def test_resume_at_any_batch_yields_the_rest_of_the_epoch(layout, rank, consumed, shuffle):
    length, n, split, even, drop = (layout[k] for k in ("length", "n", "split", "even", "drop"))
    batch = layout["batch"] * n if split else layout["batch"]
    rank %= n
    shuffle = shuffle and length > 0  # RandomSampler refuses an empty dataset

    def make():
        source = DataLoader(list(range(length)), batch_size=batch, drop_last=drop, shuffle=shuffle)
        options = dict(split_batches=split, even_batches=even, rng_types=["generator"], data_seed=9)
        return prepare_data_loader(source, num_processes=n, process_index=rank, **options)

    first = make()
    list(first)  # resume inside the second epoch
    iterator = iter(first)
    done = [values(next(iterator)) for _ in range(min(consumed, len(first)))]
    state = first.state_dict()
    rest = [values(b) for b in iterator]
    assert state["batches_yielded"] == len(done)
    resumed = make()
    resumed.load_state_dict(state)
    assert [values(b) for b in resumed] == rest


def test_base_dataloader_is_a_plain_loader_over_the_same_batches():
    prepared = prepare_data_loader(DataLoader(torch.arange(10), batch_size=3), put_on_device=True)
    base = prepared.base_dataloader
    assert type(base) is DataLoader and base is prepared.base_dataloader  # made once
    assert [b.tolist() for b in base] == [b.tolist() for b in prepared]
    # the skipping loader of an iterable dataset: its base skips nothing, as Accelerate's
    stream = skip_first_batches(DataLoader(Stream(10), batch_size=3), 2)
    assert [b.tolist() for b in stream] == [[6, 7, 8], [9]]
    assert [b.tolist() for b in stream.base_dataloader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_base_dataloader_of_a_stateful_loader_is_stateful():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    prepared = prepare_data_loader(DataLoader(torch.arange(6), batch_size=2), use_stateful_dataloader=True)
    assert type(prepared.base_dataloader) is stateful.StatefulDataLoader
    assert [b.tolist() for b in prepared.base_dataloader] == [[0, 1], [2, 3], [4, 5]]
