"""Experiment trackers: TensorBoard files hold what was logged, custom trackers, clear errors, main process only."""

import importlib.util
import json
import os

import pytest
import torch

from accel.accelerator import Accelerator
from accel.tracking import GeneralTracker, TensorBoardTracker, filter_trackers, register_tracker_class
from accel.utils.dataclasses import LoggerType, ProjectConfiguration
from harness import distributed_test

pytest.importorskip("tensorboard")


def _read_events(folder):
    """{tag: [(step, value)]} of the scalars, and {tag: [text]} of the texts, in TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    texts = {
        tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
        if tag.endswith("text_summary")
    }
    return scalars, texts


def _event_dirs(root):
    return sorted(d for d, _, files in os.walk(root) if any(f.startswith("events.out.tfevents") for f in files))


def test_tensorboard_files_hold_the_logged_values(tmp_path):
    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    acc.init_trackers("run", config={"lr": 0.1, "batch_size": 4, "optimizer": "adamw"})
    acc.log({"loss": 1.5, "accuracy": 0.25}, step=1)
    acc.log({"loss": torch.tensor(0.5), "note": "halfway"}, step=2)
    acc.log({"grouped": {"a": 1.0, "b": 2.0}}, step=3)
    tracker = acc.get_tracker("tensorboard")
    assert isinstance(tracker, TensorBoardTracker)
    assert acc.get_tracker("tensorboard", unwrap=True) is tracker.writer
    acc.end_training()

    scalars, texts = _read_events(tmp_path / "run")
    assert scalars["loss"] == [(1, 1.5), (2, 0.5)]
    assert scalars["accuracy"] == [(1, 0.25)]
    assert texts["note/text_summary"] == ["halfway"]
    # add_scalars writes one run per key: run/grouped_a, run/grouped_b
    assert _read_events(tmp_path / "run" / "grouped_a")[0]["grouped"] == [(3, 1.0)]
    assert _read_events(tmp_path / "run" / "grouped_b")[0]["grouped"] == [(3, 2.0)]
    (hparams,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "run") for f in fs if f == "hparams.yml"]
    with open(hparams) as handle:
        assert json.load(handle) == {"lr": 0.1, "batch_size": 4, "optimizer": "adamw"}
    with pytest.raises(ValueError, match="no tracker named 'wandb'"):
        acc.get_tracker("wandb")


def test_tensorboard_refuses_values_it_would_drop(tmp_path):
    acc = Accelerator(log_with=[LoggerType.TENSORBOARD], project_config=ProjectConfiguration(logging_dir=str(tmp_path)))
    acc.init_trackers("run", init_kwargs={"tensorboard": {"flush_secs": 1}})
    with pytest.raises(TypeError, match=r"'weights': Tensor.*tensor.item\(\)"):
        acc.log({"weights": torch.ones(3)})
    acc.end_training()


class RecordingTracker(GeneralTracker):
    """A user's tracker: records every call."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self, run_name="made by the user", **kwargs):
        super().__init__()
        self.run_name, self.kwargs, self.calls = run_name, kwargs, []

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append(("start",))

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


def test_custom_tracker_instance_and_registered_class():
    mine = RecordingTracker()
    acc = Accelerator(log_with=[mine])
    acc.init_trackers("project", config={"lr": 1})
    acc.log({"loss": 2.0}, step=5, log_kwargs={"recording": {"commit": True}, "other": {"x": 1}})
    assert acc.get_tracker("recording") is mine and acc.get_tracker("recording", unwrap=True) is mine.calls
    acc.end_training()
    assert mine.calls == [("start",), ("config", {"lr": 1}), ("log", {"loss": 2.0}, 5, {"commit": True}), ("finish",)]

    register_tracker_class(RecordingTracker)
    from accel.state import reset_state

    reset_state()
    acc = Accelerator(log_with="recording")
    acc.init_trackers("by name", init_kwargs={"recording": {"colour": "blue"}})
    made = acc.get_tracker("recording")
    assert (made.run_name, made.kwargs, made.calls) == ("by name", {"colour": "blue"}, [("start",)])


def test_tracker_errors_say_what_to_do(tmp_path):
    class Incomplete(GeneralTracker):
        name = "incomplete"

    with pytest.raises(NotImplementedError, match="`requires_logging_directory`, `tracker`"):
        Incomplete()
    with pytest.raises(ValueError, match="'nonsense' is not a tracker"):
        Accelerator(log_with="nonsense")
    with pytest.raises(ValueError, match="project_dir"):
        Accelerator(log_with="tensorboard")
    for name, package in [("wandb", "wandb"), ("comet_ml", "comet-ml"), ("mlflow", "mlflow"), ("aim", "aim")]:
        if importlib.util.find_spec(name) is None:
            with pytest.raises(ImportError, match=f"pip install {package}"):
                Accelerator(log_with=name, project_dir=tmp_path)
    with pytest.raises(ValueError, match="GeneralTracker subclass"):
        register_tracker_class(object)
    assert filter_trackers(["tensorboard", "tensorboard", LoggerType.TENSORBOARD], tmp_path) == ["tensorboard"]
    assert filter_trackers("all", tmp_path)[0] == "tensorboard"
    assert filter_trackers(None) == []


@distributed_test(world_size=[2, 4], device=["cpu", "cuda", "xla"])
def test_only_the_main_process_logs(tmp_path, rank, world_size):
    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    acc.init_trackers("run", config={"world_size": world_size})
    for step in range(3):
        acc.log({"loss": float(10 * rank + step)}, step=step)  # every rank calls; rank 0's values are kept
    if rank != 0:
        blank = acc.get_tracker("tensorboard")
        assert type(blank) is GeneralTracker and blank.log({"x": 1}) is None
    acc.end_training()
    acc.wait_for_everyone()
    # one writer: the run's event file, and the one add_hparams puts in a subfolder of the run
    folders = _event_dirs(tmp_path)
    assert len(folders) == 2 and folders[0] == str(tmp_path / "run") and folders[1].startswith(folders[0] + os.sep)
    assert len([f for f in os.listdir(tmp_path / "run") if f.startswith("events.out")]) == 1
    scalars, _ = _read_events(tmp_path / "run")
    assert scalars["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_tensorboard_output_matches_accelerate(tmp_path):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    from accel.state import reset_state

    def run(library, folder):
        acc = library.Accelerator(log_with="tensorboard", project_dir=str(folder))
        acc.init_trackers("run", config={"lr": 0.5})
        for step in range(3):
            acc.log({"loss": 1.0 / (step + 1), "note": f"step {step}"}, step=step)
        acc.end_training()

    run(accelerate, tmp_path / "theirs")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    reset_state()
    run(__import__("accel"), tmp_path / "ours")
    ours = _read_events(tmp_path / "ours" / "run")
    assert ours == _read_events(tmp_path / "theirs" / "run")
    assert ours[0]["loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert ours[1]["note/text_summary"] == ["step 0", "step 1", "step 2"]
    assert len(_event_dirs(tmp_path / "ours")) == len(_event_dirs(tmp_path / "theirs")) == 2  # run + hparams
