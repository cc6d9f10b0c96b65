"""pytest plugin entry point (pytest11): @distributed_test, rank fixtures, markers.

- Runs `@distributed_test` bodies on warm simulated ranks (one pool manager per
  session, closed at its end, so no rank outlives the session) and reports each failed
  rank with its own traceback. Ranks come from the rank server (`accel.sim.runtime.server`),
  which outlives the session for the next one; the first distributed test's ranks start
  as soon as pytest meets a module that declares one.
- Fixtures `rank`, `local_rank`, `world_size`, `device` for distributed tests; other
  fixtures cannot cross into ranks and are refused with a clear error.
- Markers `gpu`, `multi_gpu`, `tpu` skip without that hardware; `--real-devices` runs
  `device="cuda"` distributed tests on real GPUs with NCCL when enough are present.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
from typing import Any

import pytest

from accel.sim.diagnoses import stacks
from accel.sim.runtime import forking
from accel.sim.runtime.manager import PoolManager, new_manager
from harness import remote, runner
from harness.decorator import DistributedSpec, spec_of

MANAGER_KEY = pytest.StashKey[PoolManager]()
#: whether ranks came from the rank server before this session said
_SERVER_MODE_KEY = pytest.StashKey[bool]()
#: whether this session started its first distributed test's ranks ahead of time
_PRESTARTED_KEY = pytest.StashKey[bool]()
#: (module path, world size, device) of the first pool, started once that module is imported
_DEFERRED_KEY = pytest.StashKey[tuple[str, int, str]]()
#: whether this session forked its own rank server (`accel.sim.runtime.forking.fork_session_server`)
_FORKED_KEY = pytest.StashKey[bool]()

# What torch's import starts is known, so that the session may fork itself once it imported torch.
forking.watch_torch_import()
#: sessions configured in this process now (more than one: pytester runs one inside a test)
_sessions = [0]
#: rank modules the fork server should import once rather than every rank
_RANK_PRELOAD = ("harness.remote", "_pytest.assertion.rewrite")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("accel", "accel distributed tests")
    group.addoption(
        "--real-devices",
        action="store_true",
        default=False,
        help='run @distributed_test(device="cuda") tests on real GPUs with NCCL (skipped when fewer GPUs than ranks)',
    )
    group.addoption(
        "--simulate",
        metavar="cuda:N",
        default=None,
        help="run the session and every process it starts on a simulated node (as ACCEL_SIMULATE=cuda:N does): "
        "cuda:N, cuda:N,gpu=NAME, cuda:N,shapes_only, xla:N",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """`--simulate`: put the session on a simulated node before conftests and test modules import torch."""
    value = early_config.known_args_namespace.simulate
    if value:
        simulate_session(value)


def simulate_session(value: str) -> None:
    """This process and those it starts (xdist workers, subprocesses) on node `value` (`accel.sim.node`)."""
    from accel.sim.node import spec, start

    try:
        wanted = spec.parse(value)
    except spec.SimulateSpecError as error:
        raise pytest.UsageError(str(error).replace(f"{spec.ENV}=", "--simulate=")) from None
    running = start.current()
    if running is not None and running != wanted:
        raise pytest.UsageError(f"--simulate={value} asks for another node than {spec.ENV}={running} gives")
    os.environ[spec.ENV] = str(wanted)
    start.start()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed(world_size, device, timeout, isolated, check_collectives, faults): body runs on simulated ranks "
        "(set by @distributed_test)",
    )
    config.addinivalue_line("markers", "gpu: needs a real CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "multi_gpu: needs at least two real CUDA GPUs (skipped otherwise)")
    config.addinivalue_line("markers", "tpu: needs a real TPU through torch_xla (skipped without one)")
    forking.add_preload(*_RANK_PRELOAD)
    _sessions[0] += 1
    # Ranks come from a rank server shared with the next sessions and the -n N workers
    # (accel.sim.runtime.server); ACCEL_SIM_SERVER=0 gives each session its own fork server.
    config.stash[_SERVER_MODE_KEY] = forking.use_server(forking.server_wanted())
    stacks.hide_in_stacks(remote.__file__)
    # Ranks start from the session's environment, not from whatever a fixture of the
    # test that happens to start a pool had set in this process.
    config.stash[MANAGER_KEY] = new_manager(env=dict(os.environ))


def pytest_unconfigure(config: pytest.Config) -> None:
    _sessions[0] -= 1
    manager = config.stash.get(MANAGER_KEY, None)
    if manager is not None:
        manager.close()
    if config.stash.get(_FORKED_KEY, False):
        forking.end_session()
    previous = config.stash.get(_SERVER_MODE_KEY, None)
    if previous is not None:  # a session run inside another (pytester) leaves the outer one's choice
        forking.use_server(previous)


# -- hardware --------------------------------------------------------------------------


def gpu_count() -> int:
    """Real CUDA GPUs visible to this process (imports torch only when asked)."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_tpu() -> bool:
    """Whether a real torch_xla is importable here (the simulator's stand-in lives only in ranks)."""
    return importlib.util.find_spec("torch_xla") is not None


def _hardware_skip(item: pytest.Item) -> str | None:
    if item.get_closest_marker("tpu") is not None and not has_tpu():
        return "needs a TPU (torch_xla is not installed)"
    wants_gpu = item.get_closest_marker("gpu") is not None
    wants_many = item.get_closest_marker("multi_gpu") is not None
    if wants_gpu or wants_many:
        count = gpu_count()
        if wants_many and count < 2:
            return f"needs at least 2 GPUs, {count} visible"
        if count < 1:
            return "needs a GPU, none visible"
    return None


# -- running ---------------------------------------------------------------------------


def _spec(item: pytest.Item) -> DistributedSpec | None:
    return spec_of(getattr(item, "obj", None)) if isinstance(item, pytest.Function) else None


def _uses_real_device(item: pytest.Function) -> bool:
    return bool(item.config.getoption("real_devices")) and item.funcargs.get("device") == "cuda"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Any, parent: Any) -> None:
    # The first module that declares a distributed test: start its first configuration's
    # ranks now, while pytest imports the module (torch, seconds) and collects the rest.
    config = parent.config
    if config.stash.get(_PRESTARTED_KEY, False) or config.option.collectonly:
        return
    if not _on_the_command_line(parent.session, module_path):
        return
    first = first_distributed_config(str(module_path))
    if first is None:
        return
    config.stash[_PRESTARTED_KEY] = True
    world_size, device = first
    if device == "cuda" and config.getoption("real_devices"):
        return
    if _self_fork_awaits_torch():
        # No rank server to reach: once this module imported torch (as test modules do at
        # their top), this process forks itself into the session's rank server.
        config.stash[_DEFERRED_KEY] = (str(module_path), world_size, device)
        return
    _fork_self(config)
    config.stash[MANAGER_KEY].prestart(world_size, device)


def _on_the_command_line(session: pytest.Session, module_path: Any) -> bool:
    """Whether pytest will collect this module: the command line (or testpaths) names it or a
    folder above it. pytest makes a module node for every file of a folder it enters, also for
    those a narrower argument (`pytest tests/test_a.py`) then leaves out, which it never imports:
    their distributed tests never run, and no ranks are started for them."""
    path = pathlib.Path(module_path)
    return any(session.isinitpath(place) for place in (path, *path.parents))


def _self_fork_awaits_torch() -> bool:
    if _sessions[0] > 1 or forking.session_server_pid() is not None:
        return False
    if forking._use_server and forking.server_running():
        return False
    return forking.self_fork_refusal() == forking.NO_TORCH_YET


def _fork_self(config: pytest.Config) -> None:
    """Ranks from a fork of this process when no rank server runs and forking is safe."""
    if _sessions[0] > 1:  # a session run inside another's test (pytester, in-process): not forked mid-test
        return
    if forking.session_server_pid() is not None or (forking._use_server and forking.server_running()):
        return
    if forking.fork_session_server(_pytest_warning_filters(config)):
        config.stash[_FORKED_KEY] = True


def _pytest_warning_filters(config: pytest.Config) -> list[tuple]:
    """The warning filters pytest applies over the interpreter's while it collects and runs tests."""
    import warnings

    with warnings.catch_warnings():
        warnings.resetwarnings()
        catch = getattr(config, "_catch_configured_warnings", None)  # private to pytest: the same filters
        if catch is None:
            warnings.filterwarnings("always", category=DeprecationWarning)
            warnings.filterwarnings("always", category=PendingDeprecationWarning)
            return list(warnings.filters)
        with catch(record=False):
            return list(warnings.filters)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    report = yield
    deferred = collector.config.stash.get(_DEFERRED_KEY, None)
    if deferred is not None and isinstance(collector, pytest.Module) and str(collector.path) == deferred[0]:
        del collector.config.stash[_DEFERRED_KEY]
        _fork_self(collector.config)
        collector.config.stash[MANAGER_KEY].prestart(deferred[1], deferred[2])
    return report


def first_distributed_config(path: str) -> tuple[int, str] | None:
    """(world_size, device) of the first `@distributed_test` of a module's source that says them
    as literals (the first of lists), without importing it; None when there is none."""
    try:
        with open(path, "rb") as handle:
            source = handle.read()
        if b"distributed_test" not in source:
            return None
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for decorator in node.decorator_list:
            found = _literal_config(decorator)
            if found is not None:
                return found
    return None


def _literal_config(decorator: ast.expr) -> tuple[int, str] | None:
    if not isinstance(decorator, ast.Call):
        return None
    func = decorator.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if name != "distributed_test":
        return None
    given = dict(zip(("world_size", "device"), decorator.args, strict=False))
    given.update({kw.arg: kw.value for kw in decorator.keywords if kw.arg})
    values: dict[str, Any] = {"world_size": 4, "device": "cpu", "isolated": False}
    for key in values:
        if key in given:
            try:
                value = ast.literal_eval(given[key])
            except ValueError:
                return None
            values[key] = value[0] if isinstance(value, (list, tuple)) and value else value
    if values["isolated"] or not isinstance(values["world_size"], int) or not isinstance(values["device"], str):
        return None
    return values["world_size"], values["device"]


def pytest_collection_finish(session: pytest.Session) -> None:
    # Start the fork server as soon as distributed tests are known to run: it imports
    # torch while the tests before the first distributed one run.
    if not session.config.option.collectonly and any(_spec(item) is not None for item in session.items):
        _fork_self(session.config)
        forking.warm_up()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = _hardware_skip(item)
    if reason:
        pytest.skip(reason)
    spec = _spec(item)
    if spec is None:
        return
    unknown = runner.unknown_fixtures(item, spec) if isinstance(item, pytest.Function) else []
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        pytest.fail(
            f"@distributed_test {item.name} asks for {names}: the body runs inside the ranks, where only the "
            "fixtures rank, local_rank, world_size, device and tmp_path and pytest.mark.parametrize arguments "
            "are available; set other things up inside the body",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = _spec(pyfuncitem)
    if spec is None:
        return None
    real = _uses_real_device(pyfuncitem)
    if real:
        world_size, count = int(pyfuncitem.funcargs["world_size"]), gpu_count()  # type: ignore[call-overload]  # (funcargs values are typed object)
        if count < world_size:
            pytest.skip(f"--real-devices: needs {world_size} GPUs, {count} visible")
    runner.run_item(pyfuncitem, spec, pyfuncitem.config.stash[MANAGER_KEY], real)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    failure = item.stash.get(runner.FAILURE_KEY, None)
    if failure is not None and call.when == "call" and report.failed:
        report.longrepr = runner.longrepr(item, failure)
    return report


# -- fixtures --------------------------------------------------------------------------


def _require_distributed(request: pytest.FixtureRequest, name: str) -> DistributedSpec:
    spec = _spec(request.node)
    if spec is None:
        pytest.fail(
            f"the {name!r} fixture only exists in @distributed_test tests (harness.distributed_test)", pytrace=False
        )
    return spec


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> None:
    """This rank's global index (filled in inside each rank)."""
    _require_distributed(request, "rank")


@pytest.fixture
def local_rank(request: pytest.FixtureRequest) -> None:
    """This rank's index on its machine (filled in inside each rank)."""
    _require_distributed(request, "local_rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """Number of ranks of this distributed test."""
    return _require_distributed(request, "world_size").world_sizes[0]


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    """Simulated device of this distributed test ("cpu", "cuda" or "xla")."""
    return _require_distributed(request, "device").devices[0]
