"""Experiment trackers: what `Accelerator(log_with=...)`, `init_trackers`, `log` and `end_training` drive.

A tracker is a `GeneralTracker`: `start()` opens the run, `store_init_configuration`
records hyperparameters, `log` records values at a step, `finish()` closes the run.
accel ships TensorBoard (through `torch.utils.tensorboard`); any other tracker is a
`GeneralTracker` subclass, passed as an instance in `log_with` or registered by name with
`register_tracker_class`. Trackers run on the main process only, unless a tracker sets
`main_process_only = False`.

The names of Accelerate's other integrations (wandb, comet_ml, mlflow, ...) are known:
naming one whose package is missing is an `ImportError` saying what to install, rather
than a run whose logs silently go nowhere.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from accel.utils.dataclasses import LoggerType

__all__ = [
    "GeneralTracker",
    "TensorBoardTracker",
    "LoggerType",
    "get_available_trackers",
    "register_tracker_class",
    "filter_trackers",
    "on_main_process",
]

_F = TypeVar("_F", bound=Callable[..., Any])

# Accelerate's integrations that accel does not ship: tracker name -> (module, pip package).
_OTHER_TRACKERS = {
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "aim": ("aim", "aim"),
    "mlflow": ("mlflow", "mlflow"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
    "swanlab": ("swanlab", "swanlab"),
}


def on_main_process(function: _F) -> _F:
    """Run a tracker method on the main process only when its tracker says `main_process_only`.

    Decided at call time, so that creating a tracker does not create the process state.
    """

    @functools.wraps(function)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False):
            from accel.state import PartialState

            if not PartialState().is_main_process:
                return None
        return function(self, *args, **kwargs)

    return run  # type: ignore[return-value]  # functools.wraps keeps the signature that _F describes


class GeneralTracker:
    """Base class of experiment trackers; subclass it to log anywhere.

    A subclass defines `name` (what `log_with`, `get_tracker` and `init_kwargs` call it),
    `requires_logging_directory` (whether it is created as `Tracker(project_name,
    logging_dir, **kwargs)` or `Tracker(project_name, **kwargs)`), and a `tracker`
    property (the underlying run object, returned by `get_tracker(name, unwrap=True)`),
    then overrides the methods it needs.
    """

    #: run start/log/finish on the main process only
    main_process_only = True
    #: what `log_with`, `get_tracker` and `init_kwargs` call the tracker (subclasses set it)
    name: str
    #: whether the tracker is created with the logging directory (subclasses set it)
    requires_logging_directory: bool
    #: the underlying run object (subclasses define it, usually as a property)
    tracker: Any

    def __init__(self, _blank: bool = False) -> None:
        if _blank:  # the stand-in get_tracker returns on processes that track nothing
            return
        # dir(), not getattr: a `tracker` property may need what the subclass sets after this runs
        present = dir(self)
        missing = [f"`{attr}`" for attr in ("name", "requires_logging_directory", "tracker") if attr not in present]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} must define {', '.join(missing)} in its class body "
                "(see accel.tracking.GeneralTracker)"
            )

    def start(self) -> None:
        """Open the run (called by `init_trackers`, after the processes are set up)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record `values` (bool, str, int, float or None) as the run's hyperparameters."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record `values` at `step`."""

    def finish(self) -> None:
        """Close the run (called by `end_training`)."""


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files in `logging_dir/run_name`, through `torch.utils.tensorboard`.

    `kwargs` go to `SummaryWriter` (e.g. `flush_secs`).
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = os.fspath(logging_dir)
        self.logging_dir = os.path.join(self.logging_dir_param, run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        self.writer = _summary_writer_class()(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Hyperparameters into TensorBoard's HPARAMS tab, and `<time>/hparams.yml` next to the events."""
        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        folder = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hparams.yml"), "w", encoding="utf-8") as handle:
            # JSON is YAML: readable by yaml.safe_load without needing PyYAML to write it
            json.dump(values, handle, indent=2, sort_keys=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers as scalars, strings as text, dicts of numbers as grouped scalars.

        0-d tensors and numpy scalars count as numbers; any other value is a TypeError.
        """
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                numbers = {k: _as_number(f"{key}/{k}", v) for k, v in value.items()}
                self.writer.add_scalars(key, numbers, global_step=step, **kwargs)
            else:
                self.writer.add_scalar(key, _as_number(key, value), global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _as_number(key: str, value: Any) -> int | float:
    if isinstance(value, (bool, int, float)):
        return value
    item = getattr(value, "item", None)  # a 0-d tensor or a numpy scalar
    if callable(item) and getattr(value, "ndim", None) == 0:
        number = item()
        if isinstance(number, (bool, int, float)):
            return number
    raise TypeError(
        f"log({key!r}: {type(value).__name__}): TensorBoard takes numbers, strings and dicts of numbers; "
        "log a tensor's value with tensor.item()"
    )


def _summary_writer_class() -> Any:
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            "log_with='tensorboard' writes through torch.utils.tensorboard, which needs the tensorboard package: "
            "pip install tensorboard"
        )
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


_TRACKER_CLASSES: dict[str, type[GeneralTracker]] = {"tensorboard": TensorBoardTracker}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make a `GeneralTracker` subclass usable by its `name` in `log_with` (register before `Accelerator()`)."""
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"register_tracker_class needs a GeneralTracker subclass, got {tracker_class!r}")
    name = getattr(tracker_class, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{tracker_class.__name__} needs a non-empty `name` to be registered")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(f"{tracker_class.__name__} needs a `requires_logging_directory` attribute")
    if name in _TRACKER_CLASSES and _TRACKER_CLASSES[name] is not tracker_class:
        raise ValueError(f"a tracker named {name!r} is registered already ({_TRACKER_CLASSES[name].__name__})")
    _TRACKER_CLASSES[name] = tracker_class


def get_available_trackers() -> list[str]:
    """Names of the trackers that `log_with="all"` starts on this machine."""
    return [name for name in _TRACKER_CLASSES if name != "tensorboard" or _tensorboard_installed()]


def _tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def filter_trackers(log_with: Any, logging_dir: str | os.PathLike | None = None) -> list[str | GeneralTracker]:
    """The trackers `log_with` asks for: names (deduplicated) and `GeneralTracker` instances.

    `"all"` means every tracker this machine can run, plus the instances given. A name
    that accel knows but cannot run here raises (ImportError naming the package to
    install, or NotImplementedError for integrations accel does not ship), as does a
    tracker that writes files when there is no logging directory.
    """
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    instances = [e for e in entries if isinstance(e, GeneralTracker)]
    names = [str(e) for e in entries if not isinstance(e, GeneralTracker)]
    if LoggerType.ALL.value in names:
        names = get_available_trackers()
    chosen: list[str | GeneralTracker] = list(instances)
    for name in names:
        if name in chosen:
            continue
        tracker_class = _TRACKER_CLASSES.get(name)
        if tracker_class is None:
            _refuse(name)
        if name == "tensorboard" and not _tensorboard_installed():
            raise ImportError("log_with='tensorboard' needs the tensorboard package: pip install tensorboard")
        if tracker_class is not None and tracker_class.requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"log_with={name!r} writes files: give Accelerator(project_dir=...) "
                "(or ProjectConfiguration(logging_dir=...))"
            )
        chosen.append(name)
    return chosen


def _refuse(name: str) -> None:
    if name in _OTHER_TRACKERS:
        module, package = _OTHER_TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ImportError(
                f"log_with={name!r} needs the {package} package, which is not installed: pip install {package}"
            )
        raise NotImplementedError(
            f"log_with={name!r}: accel ships TensorBoard only; log to {name} with a GeneralTracker subclass "
            "(accel.tracking) passed in log_with or registered with register_tracker_class"
        )
    known = sorted(set(_TRACKER_CLASSES) | set(_OTHER_TRACKERS) | {LoggerType.ALL.value})
    raise ValueError(f"log_with={name!r} is not a tracker; choose among {known} or pass a GeneralTracker instance")


def start_trackers(
    chosen: Sequence[str | GeneralTracker],
    project_name: str,
    logging_dir: str | os.PathLike | None,
    config: dict[str, Any] | None,
    init_kwargs: dict[str, dict[str, Any]],
) -> list[GeneralTracker]:
    """Create the named trackers, start every tracker, and record `config` in each."""
    trackers: list[GeneralTracker] = []
    for entry in chosen:
        if isinstance(entry, GeneralTracker):
            trackers.append(entry)  # a user's instance, created already
            continue
        tracker_class: Any = _TRACKER_CLASSES[entry]
        kwargs = init_kwargs.get(entry, {})
        if tracker_class.requires_logging_directory:
            trackers.append(tracker_class(project_name, logging_dir, **kwargs))
        else:
            trackers.append(tracker_class(project_name, **kwargs))
    for tracker in trackers:
        tracker.start()
    if config is not None:
        for tracker in trackers:
            tracker.store_init_configuration(config)
    return trackers
