"""Single-process tests of the shared state: PartialState, AcceleratorState, GradientState."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from accel.state import AcceleratorState, GradientState, PartialState, reset_state, split_inputs
from accel.utils.dataclasses import DistributedType


def test_single_process_defaults():
    state = PartialState()
    assert state.initialized
    assert state.num_processes == 1 and state.process_index == 0 and state.local_process_index == 0
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert state.distributed_type == DistributedType.NO
    assert state.device == torch.device("cpu")
    assert state.backend is None and not state.use_distributed
    assert state.debug is False


def test_instances_share_state():
    first = PartialState()
    first.custom_marker = 41
    assert PartialState().custom_marker == 41
    assert AcceleratorState().custom_marker == 41  # delegated to PartialState


def test_reset_state_forgets_everything():
    PartialState().custom_marker = 1
    GradientState()._set_sync_gradients(False)
    reset_state()
    assert not PartialState._shared_state and not GradientState._shared_state
    assert not hasattr(PartialState(), "custom_marker")
    assert GradientState().sync_gradients is True


def test_debug_flag_from_constructor_and_env(monkeypatch):
    assert PartialState(debug=True).debug is True
    reset_state()
    monkeypatch.setenv("ACCEL_DEBUG_MODE", "1")
    assert PartialState().debug is True
    reset_state()
    monkeypatch.setenv("ACCEL_DEBUG_MODE", "maybe")
    with pytest.raises(ValueError, match="ACCEL_DEBUG_MODE='maybe' is not a boolean"):
        PartialState()


def test_world_size_without_rendezvous_address_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="MASTER_ADDR/MASTER_PORT are not set"):
        PartialState()


def test_adopts_an_initialised_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group = dist.group.WORLD
    state = PartialState()
    assert dist.group.WORLD is group  # not initialised a second time
    assert state.adopted_process_group is True
    assert state.backend == "gloo"
    state.wait_for_everyone()


def test_init_process_group_from_launcher_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "1")
    state = PartialState(init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert not dist.is_initialized()  # one process: no process group needed
    assert state.num_processes == 1


def test_accelerator_state_mixed_precision(monkeypatch):
    state = AcceleratorState(mixed_precision="bf16", _from_accelerator=True)
    assert state.mixed_precision == "bf16" and state.initialized
    assert state.num_processes == 1 and state.device == torch.device("cpu")
    with pytest.raises(ValueError, match="already initialised with mixed_precision='bf16'"):
        AcceleratorState(mixed_precision="fp16", _from_accelerator=True)
    reset_state()
    monkeypatch.setenv("ACCEL_MIXED_PRECISION", "fp16")
    assert AcceleratorState().mixed_precision == "fp16"


def test_bad_mixed_precision_names_the_choices():
    with pytest.raises(ValueError, match=r"mixed_precision='fp12'.*'no', 'fp8', 'fp16', 'bf16'"):
        AcceleratorState(mixed_precision="fp12")


def test_main_process_first_and_print_on_one_process(capsys):
    state = PartialState()
    with state.main_process_first():
        state.print("inside")
    with state.local_main_process_first():
        pass
    assert capsys.readouterr().out == "inside\n"


def test_process_decorators_on_one_process():
    state = PartialState()
    calls = []

    @state.on_main_process
    def main_only(x):
        calls.append(("main", x))
        return x

    @state.on_process(process_index=1)
    def second_only():
        calls.append("second")

    @state.on_local_process(local_process_index=0)
    def local_zero():
        calls.append("local0")

    assert main_only(3) == 3
    assert second_only() is None
    local_zero()
    state.on_last_process(lambda: calls.append("last"))()
    state.on_local_main_process()(lambda: calls.append("local-main"))()
    assert calls == [("main", 3), "local0", "last", "local-main"]
    with pytest.raises(ValueError, match="process_index must be a non-negative int"):
        state.on_process(lambda: None, process_index=-1)


@pytest.mark.parametrize(
    ("total", "processes", "expected"),
    [
        (5, 2, [[0, 1, 2], [3, 4]]),
        (7, 4, [[0, 1], [2, 3], [4, 5], [6]]),
        (2, 4, [[0], [1], [], []]),
    ],
)
def test_split_inputs_lists(total, processes, expected):
    data = list(range(total))
    assert [split_inputs(data, processes, i) for i in range(processes)] == expected


def test_split_inputs_padding_repeats_the_last_item():
    data = list(range(5))
    assert [split_inputs(data, 4, i, apply_padding=True) for i in range(4)] == [[0, 1], [2, 2], [3, 3], [4, 4]]
    assert [split_inputs(data[:2], 4, i, apply_padding=True) for i in range(4)] == [[0], [1], [1], [1]]


def test_split_inputs_tensors_tuples_dicts():
    tensor = torch.arange(10).reshape(5, 2)
    parts = [split_inputs(tensor, 2, i, apply_padding=True) for i in range(2)]
    assert parts[0].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert parts[1].tolist() == [[6, 7], [8, 9], [8, 9]]
    assert split_inputs((1, 2, 3), 2, 1, apply_padding=True) == (3, 3)
    split = split_inputs({"a": [1, 2, 3, 4], "b": torch.arange(4)}, 2, 1)
    assert split["a"] == [3, 4] and split["b"].tolist() == [2, 3]
    with pytest.raises(ValueError, match="same length"):
        split_inputs({"a": [1], "b": [1, 2]}, 2, 0)
    with pytest.raises(TypeError, match="got set"):
        split_inputs({1, 2}, 2, 0)


@pytest.mark.parametrize("padding", [False, True])
def test_a_datasets_dataset_is_split_by_rows_as_accelerate_splits_it(padding):
    datasets = pytest.importorskip("datasets")
    from accelerate.state import PartialState as Theirs

    rows = datasets.Dataset.from_dict({"x": list(range(7))})
    shares = [split_inputs(rows, 3, index, apply_padding=padding) for index in range(3)]
    assert all(isinstance(share, datasets.Dataset) for share in shares)
    expected = [[0, 1, 2], [3, 4, 6], [5, 6, 6]] if padding else [[0, 1, 2], [3, 4], [5, 6]]
    assert [share["x"] for share in shares] == expected
    theirs = Theirs()  # one process: the whole dataset, as ours gives
    with theirs.split_between_processes(rows, apply_padding=padding) as whole:
        assert whole["x"] == split_inputs(rows, 1, 0, apply_padding=padding)["x"]


def test_split_between_processes_context_manager():
    with PartialState().split_between_processes(["a", "b", "c"]) as mine:
        assert mine == ["a", "b", "c"]


def test_gradient_state_defaults_and_plugin():
    from accel.utils.dataclasses import GradientAccumulationPlugin

    state = GradientState()
    assert state.sync_gradients and state.num_steps == 1 and not state.adjust_scheduler
    assert state.sync_with_dataloader and not state.sync_each_batch
    assert not state.in_dataloader and not state.end_of_dataloader and state.remainder == -1
    GradientState(GradientAccumulationPlugin(num_steps=4, sync_each_batch=True))
    assert state.num_steps == 4 and state.sync_each_batch and state.adjust_scheduler


def test_gradient_state_follows_nested_dataloaders():
    @dataclasses.dataclass
    class FakeLoader:
        end_of_dataloader: bool = False
        remainder: int = -1

    train, evaluation = FakeLoader(), FakeLoader(end_of_dataloader=True, remainder=3)
    state = GradientState()
    state._add_dataloader(train)
    assert state.active_dataloader is train and not state.end_of_dataloader
    state._add_dataloader(evaluation)
    assert state.end_of_dataloader and state.remainder == 3
    state._remove_dataloader(evaluation)
    assert state.active_dataloader is train and state.remainder == -1
    state._remove_dataloader(train)
    assert not state.in_dataloader


def test_gradient_state_reports_distributed_type():
    assert GradientState().distributed_type is None
    PartialState()
    assert GradientState().distributed_type == DistributedType.NO


def test_process_questions_are_answered_after_accelerator_state_reset():
    # as Accelerate: AcceleratorState._reset_state() keeps the PartialState, which answers the process questions
    # (Accelerate's external_deps/test_metrics.py asks an Accelerator kept across the reset)
    from accel import Accelerator
    from accel.state import AcceleratorState, reset_state

    reset_state()
    try:
        accelerator = Accelerator()
        AcceleratorState._reset_state()
        assert accelerator.is_local_main_process and accelerator.is_main_process
        assert accelerator.state.is_last_process and not accelerator.state.use_distributed
        with pytest.raises(AttributeError, match="was not reinitialized"):
            accelerator.state.device  # noqa: B018  (not a process question: refused as before)
        AcceleratorState._reset_state(reset_partial_state=True)
        with pytest.raises(AttributeError, match="was not reinitialized"):
            accelerator.state.is_main_process  # noqa: B018
    finally:
        reset_state()
