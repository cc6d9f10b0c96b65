"""Single-process tests of the utilities Accelerate users import: environment, memory, saving, progress bars,
the `is_*_available` family, the distributed types, and the typed lazy exports."""

import ast
import inspect
import os
import pathlib
import platform
import sys
import unittest

import pytest
import torch

import accel
import accel.utils
from accel.state import PartialState
from accel.utils import (
    clear_environment,
    find_executable_batch_size,
    patch_environment,
    purge_accelerate_environment,
    release_memory,
)
from accel.utils.dataclasses import DistributedType

# -- environment --------------------------------------------------------------------------


def test_patch_environment_sets_and_restores(monkeypatch):
    monkeypatch.setenv("ACCEL_TEST_KEEP", "old")
    monkeypatch.delenv("ACCEL_TEST_NEW", raising=False)
    with patch_environment(accel_test_keep=1, ACCEL_TEST_NEW="x"):
        assert os.environ["ACCEL_TEST_KEEP"] == "1" and os.environ["ACCEL_TEST_NEW"] == "x"
    assert os.environ["ACCEL_TEST_KEEP"] == "old" and "ACCEL_TEST_NEW" not in os.environ


def test_patch_environment_restores_after_an_error(monkeypatch):
    monkeypatch.delenv("ACCEL_TEST_BOOM", raising=False)
    with pytest.raises(KeyError), patch_environment(ACCEL_TEST_BOOM="1"):
        raise KeyError("boom")
    assert "ACCEL_TEST_BOOM" not in os.environ


def test_clear_environment_empties_then_restores_exactly(monkeypatch):
    monkeypatch.setenv("ACCEL_TEST_CLEAR", "kept")
    before = dict(os.environ)
    with clear_environment():
        assert dict(os.environ) == {}
        os.environ["ACCEL_TEST_ADDED"] = "gone afterwards"
    assert dict(os.environ) == before


def test_purge_restores_both_prefixes_for_functions(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.delenv("ACCEL_MIXED_PRECISION", raising=False)

    @purge_accelerate_environment
    def leaky():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["ACCEL_MIXED_PRECISION"] = "fp16"
        os.environ["OTHER_TEST_VAR_KEPT"] = "1"
        return "done"

    try:
        assert leaky() == "done"
        assert os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"
        assert "ACCEL_MIXED_PRECISION" not in os.environ
        assert os.environ["OTHER_TEST_VAR_KEPT"] == "1"  # only the two prefixes are restored
    finally:
        os.environ.pop("OTHER_TEST_VAR_KEPT", None)


def test_purge_wraps_test_methods_of_a_class_and_its_subclasses(monkeypatch):
    monkeypatch.delenv("ACCEL_TEST_PURGED", raising=False)

    @purge_accelerate_environment
    class Base(unittest.TestCase):
        def test_sets(self):
            os.environ["ACCEL_TEST_PURGED"] = "base"

    class Child(Base):
        def test_child_sets(self):
            os.environ["ACCEL_TEST_PURGED"] = "child"

    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(Child).run(result)
    assert result.wasSuccessful() and result.testsRun == 2
    assert "ACCEL_TEST_PURGED" not in os.environ


def test_check_os_kernel_warns_on_old_kernels(monkeypatch, caplog):
    from accel.utils import check_os_kernel

    PartialState()
    old = platform.uname_result("Linux", "host", "4.19.0-generic", "#1", "x86_64")
    monkeypatch.setattr(platform, "uname", lambda: old)
    check_os_kernel()
    assert "4.19.0" in caplog.text and "5.5.0" in caplog.text
    caplog.clear()
    new = platform.uname_result("Linux", "host", "6.1.0", "#1", "x86_64")
    monkeypatch.setattr(platform, "uname", lambda: new)
    check_os_kernel()
    assert caplog.text == ""


# -- memory ---------------------------------------------------------------------------------


def test_release_memory_returns_nones_and_frees():
    import weakref

    big = torch.ones(1000)
    ref = weakref.ref(big)
    a, b = release_memory(big, [1])
    del big
    assert (a, b) == (None, None) and ref() is None


def _out_of_memory():
    return RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.fixture
def collections(monkeypatch):
    """Counts `gc.collect()` calls instead of making them: each costs seconds in a pytest worker that
    has run hundreds of tests, and the retry logic, not the collector, is what these tests check."""
    import gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    return calls


def test_find_executable_batch_size_shrinks_until_it_fits(collections):
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 90:
            raise _out_of_memory()
        return batch_size * scale

    assert train(2) == 2 * 82
    assert tried == [128, 115, 103, 92, 82]  # times 0.9, rounded down, after each out-of-memory error
    assert len(collections) == 1 + 4  # before the first try and after each out-of-memory error


def test_find_executable_batch_size_follows_accelerate_step_by_step(collections):
    from accelerate.utils import find_executable_batch_size as peer

    def make(decorator, log):
        @decorator(starting_batch_size=10)
        def run(batch_size):
            log.append(batch_size)
            if batch_size > 7:
                raise _out_of_memory()
            return batch_size

        return run

    ours, theirs = [], []
    assert make(find_executable_batch_size, ours)() == make(peer, theirs)()
    assert ours == theirs
    assert len(collections) == 2 * (1 + 3)  # each library collects garbage as often


def test_find_executable_batch_size_errors(collections):
    @find_executable_batch_size(starting_batch_size=2)
    def never_fits(batch_size):
        raise _out_of_memory()

    with pytest.raises(RuntimeError, match="no batch size from 2 down to 1 fits"):
        never_fits()

    @find_executable_batch_size
    def other_error(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        other_error()

    @find_executable_batch_size(starting_batch_size=8)
    def takes_one(batch_size, model):
        return model

    with pytest.raises(TypeError, match="passes it itself"):
        takes_one(8, "model")


def test_custom_reduce_batch_size_fn(collections):
    sizes = iter([6, 3])

    @find_executable_batch_size(starting_batch_size=12, reduce_batch_size_fn=lambda: next(sizes))
    def train(batch_size):
        if batch_size > 3:
            raise _out_of_memory()
        return batch_size

    assert train() == 3


# -- save -------------------------------------------------------------------------------------


def test_save_pickle_and_safetensors(tmp_path):
    from safetensors.torch import load_file

    from accel.utils import save

    PartialState()
    linear = torch.nn.Linear(3, 2)
    save({"w": linear.weight, "step": 3}, tmp_path / "obj.bin")
    loaded = torch.load(tmp_path / "obj.bin", weights_only=False)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], linear.weight) and not loaded["w"].requires_grad

    tied = linear.state_dict()
    tied["alias"] = tied["weight"]  # a tied weight: one storage, two names
    save(tied, tmp_path / "model.safetensors", safe_serialization=True)
    tensors = load_file(tmp_path / "model.safetensors")
    assert set(tensors) == {"weight", "bias"} and torch.equal(tensors["weight"], linear.weight)
    with pytest.raises(TypeError, match="flat dict of tensors"):
        save({"step": 3}, tmp_path / "bad.safetensors", safe_serialization=True)


def test_save_writes_on_the_main_process_only(tmp_path):
    from accel.utils import save

    state = PartialState()
    state.process_index, state.local_process_index = 1, 0  # a second machine's first process
    save({"a": 1}, tmp_path / "global.bin")
    save({"a": 1}, tmp_path / "per_node.bin", save_on_each_node=True)
    assert not (tmp_path / "global.bin").exists() and (tmp_path / "per_node.bin").exists()


# -- tqdm -------------------------------------------------------------------------------------


def test_tqdm_is_disabled_off_the_local_main_process():
    from accel.utils import tqdm

    state = PartialState()
    assert not tqdm(range(3)).disable
    state.local_process_index = 1
    assert tqdm(range(3)).disable
    assert not tqdm(range(3), main_process_only=False).disable
    assert tqdm(range(3), disable=True, main_process_only=False).disable
    with pytest.raises(ValueError, match="main_process_only"):
        tqdm(True, range(3))


# -- is_*_available -------------------------------------------------------------------------


def _available_names():
    import accelerate.utils

    return sorted(n for n in dir(accelerate.utils) if n.startswith("is_") and n.endswith("_available"))


def test_every_is_available_name_exists_and_agrees_with_accelerate_here():
    import accelerate.utils

    names = _available_names()
    assert len(names) == 55 and sorted(accel.utils.IS_AVAILABLE) == names
    disagree = {n: (getattr(accel.utils, n)(), getattr(accelerate.utils, n)()) for n in names}
    disagree = {n: v for n, v in disagree.items() if bool(v[0]) != bool(v[1])}
    assert disagree == {}


def test_is_available_answers_what_torch_says(monkeypatch):
    from accel.utils import is_bf16_available, is_cuda_available, is_torch_xla_available, is_xpu_available

    assert is_bf16_available() is (True if not torch.cuda.is_available() else torch.cuda.is_bf16_supported())
    assert is_cuda_available() == torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert is_cuda_available()
    monkeypatch.undo()
    assert is_torch_xla_available() == ("torch_xla" in sys.modules or _importable("torch_xla"))
    monkeypatch.setenv("USE_TORCH_XLA", "0")
    assert not is_torch_xla_available()
    with pytest.raises(ValueError, match="cannot both be true"):
        is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)
    assert is_xpu_available() == (hasattr(torch, "xpu") and torch.xpu.is_available())


def _importable(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_package_checks_follow_what_is_installed():
    from accel.utils import is_pytest_available, is_tensorboard_available, is_wandb_available

    assert is_pytest_available()
    assert is_wandb_available() == _importable("wandb")
    assert is_tensorboard_available() == (_importable("tensorboard") or _importable("tensorboardX"))


# -- distributed types ----------------------------------------------------------------------


def test_every_accelerate_distributed_type_exists():
    from accelerate.utils import DistributedType as Peer

    assert [m.value for m in DistributedType] == [m.value for m in Peer]
    assert DistributedType.FSDP == "FSDP" and DistributedType("MULTI_XPU") is DistributedType.MULTI_XPU


@pytest.mark.parametrize("member", list(DistributedType))
def test_unsupported_types_fail_clearly(member):
    if member in DistributedType.supported():
        assert member.require_supported() is member
    else:
        with pytest.raises(NotImplementedError, match=f"DistributedType.{member.name} is not supported"):
            member.require_supported()


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_DEEPSPEED", "ACCEL_USE_MEGATRON_LM"])
def test_a_run_asking_for_an_engine_we_lack_is_refused(monkeypatch, variable):
    monkeypatch.setenv(variable, "true")
    with pytest.raises(NotImplementedError, match=f"{variable}=true asks for it"):
        PartialState()
    monkeypatch.setenv(variable, "false")
    assert PartialState().num_processes == 1


# -- lazy exports seen by type checkers -----------------------------------------------------


@pytest.mark.parametrize("module", [accel, accel.utils], ids=["accel", "accel.utils"])
def test_type_checking_imports_mirror_the_exports_table(module):
    tree = ast.parse(pathlib.Path(inspect.getfile(module)).read_text())
    blocks = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"]
    assert len(blocks) == 1
    seen: dict[str, set[str]] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name}: re-export it as `{alias.name} as {alias.name}`"
            seen.setdefault(node.module, set()).add(alias.name)
    assert seen == {m: set(names) for m, names in module._EXPORTS.items()}


# -- unwrapping -----------------------------------------------------------------------------------


def test_extract_model_from_parallel_recursive_unwraps_submodules():
    from accel.utils import extract_model_from_parallel

    inner = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.DataParallel(inner), torch.nn.ReLU())
    same = extract_model_from_parallel(model)
    assert same is model and isinstance(model[0], torch.nn.DataParallel)  # not recursive: submodules untouched
    extract_model_from_parallel(model, recursive=True)
    assert model[0] is inner


def test_leaf_tests():
    from accel.utils.operations import TensorInformation, is_tensor_information, is_torch_tensor

    assert is_torch_tensor(torch.ones(1)) and not is_torch_tensor([1])
    assert is_tensor_information(TensorInformation((1,), torch.float32)) and not is_tensor_information(torch.ones(1))


def test_is_initialized_follows_the_accelerator_state():
    from accel.state import AcceleratorState, is_initialized

    assert not is_initialized()
    AcceleratorState()
    assert is_initialized()


# -- small helpers, side by side with Accelerate ------------------------------------------------


def test_env_parsing_matches_accelerate(monkeypatch):
    import accelerate.utils as peer

    from accel.utils import get_int_from_env, parse_choice_from_env, parse_flag_from_env, str_to_bool

    for text in ["y", "YES", "t", "True", "on", "1", "n", "No", "f", "false", "OFF", "0"]:
        assert str_to_bool(text) == peer.str_to_bool(text) and str_to_bool(text, to_bool=True) is bool(
            peer.str_to_bool(text)
        )
    with pytest.raises(ValueError, match="invalid truth value"):
        str_to_bool("maybe")
    monkeypatch.setenv("ACCEL_TEST_FLAG", "yes")
    monkeypatch.setenv("ACCEL_TEST_INT_B", "3")
    monkeypatch.setenv("ACCEL_TEST_INT_A", "-1")
    assert parse_flag_from_env("ACCEL_TEST_FLAG") is peer.parse_flag_from_env("ACCEL_TEST_FLAG") is True
    assert parse_flag_from_env("ACCEL_TEST_UNSET", True) is True
    assert parse_choice_from_env("ACCEL_TEST_UNSET") == peer.parse_choice_from_env("ACCEL_TEST_UNSET") == "no"
    keys = ["ACCEL_TEST_INT_A", "ACCEL_TEST_INT_B"]
    assert get_int_from_env(keys, 7) == peer.get_int_from_env(keys, 7) == 3
    assert get_int_from_env(["ACCEL_TEST_UNSET"], 7) == 7


def test_versions_match_accelerate():
    import accelerate.utils as peer
    from packaging.version import Version

    from accel.utils import compare_versions, is_torch_version

    for op in [">", ">=", "==", "!=", "<=", "<"]:
        assert is_torch_version(op, "2.4") == peer.is_torch_version(op, "2.4")
        assert compare_versions(Version("1.2.3"), op, "1.2.3") == peer.compare_versions(Version("1.2.3"), op, "1.2.3")
    assert compare_versions("torch", ">=", "2.0")
    with pytest.raises(ValueError, match="operation must be one of"):
        compare_versions("torch", "=>", "2.0")


def test_other_helpers_match_accelerate():
    import collections

    import accelerate.utils as peer

    from accel.utils import (
        convert_bytes,
        get_pretty_name,
        honor_type,
        ignorant_find_batch_size,
        merge_dicts,
        recursive_getattr,
    )

    for size in [0, 512, 2048, 5 * 1024**3, 3 * 1024**5]:
        assert convert_bytes(size) == peer.convert_bytes(size)
    for obj in [torch.nn.Linear, torch.nn.Linear(1, 1), len, 3]:
        assert get_pretty_name(obj) == peer.get_pretty_name(obj)
    assert merge_dicts({"a": {"b": 1}, "c": 2}, {"a": {"d": 3}}) == {"a": {"d": 3, "b": 1}, "c": 2}
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert recursive_getattr(model, "0.weight") is peer.recursive_getattr(model, "0.weight")
    Pair = collections.namedtuple("Pair", "a b")
    assert honor_type(Pair(1, 2), iter([3, 4])) == Pair(3, 4) and honor_type([1], (x for x in [5])) == [5]
    for data in [{"x": torch.ones(3, 1)}, {"x": 1}, []]:
        assert ignorant_find_batch_size(data) == peer.ignorant_find_batch_size(data)
    assert ignorant_find_batch_size(torch.tensor(1.0)) is None  # Accelerate lets an IndexError through here


def test_is_port_in_use():
    import socket

    from accel.utils import is_port_in_use

    with socket.socket() as server:
        server.bind(("localhost", 0))
        server.listen()
        port = server.getsockname()[1]
        assert is_port_in_use(port)
    assert not is_port_in_use(port)


def test_wait_for_everyone_alone_returns():
    from accel.utils import wait_for_everyone

    PartialState()
    assert wait_for_everyone() is None


def test_checkpoint_file_names_are_accelerate_s():
    import accelerate.utils.constants as peer

    from accel.utils import constants

    names = [n for n in dir(constants) if n.isupper()]
    # the checkpoint file names, the FSDP option lists and the layers layerwise casting upcasts
    assert len(names) == 20 and all(getattr(constants, n) == getattr(peer, n) for n in names)


def test_load_reads_numpy_states_but_refuses_code(tmp_path):
    import random

    import numpy as np

    from accel.utils import load

    np.random.seed(3)
    states = {"numpy": np.random.get_state(), "python": random.getstate(), "w": torch.ones(2)}
    torch.save(states, tmp_path / "rng.pkl")
    loaded = load(tmp_path / "rng.pkl")
    assert np.array_equal(loaded["numpy"][1], states["numpy"][1]) and torch.equal(loaded["w"], torch.ones(2))

    torch.save({"f": PartialState}, tmp_path / "code.pkl")  # a class reference: not weights
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        load(tmp_path / "code.pkl")
    assert load(tmp_path / "code.pkl", weights_only=False)["f"] is PartialState


def test_accel_version(capsys):
    from accel.commands import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"accel {accel.__version__}"


def test_exported_functions_are_not_shadowed_by_submodules():
    """A submodule named like an exported function would replace it once imported (`import accel.utils.x`)."""
    import importlib
    import pkgutil

    submodules = {info.name for info in pkgutil.iter_modules(accel.utils.__path__)}
    for name in submodules:
        importlib.import_module(f"accel.utils.{name}")
    assert submodules & set(accel.utils.__all__) == set()


def test_clean_state_dict_for_safetensors_matches_accelerate(caplog, request):
    from accelerate.state import PartialState as PeerState
    from accelerate.utils import clean_state_dict_for_safetensors as peer

    PeerState(cpu=True)  # the peer logs through its own state
    request.addfinalizer(PeerState._reset_state)

    from accel.utils import clean_state_dict_for_safetensors

    def tied():
        model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
        model[1].weight = model[0].weight
        return model.state_dict()

    ours, theirs = tied(), tied()
    assert clean_state_dict_for_safetensors(ours) is ours
    assert list(ours) == list(peer(theirs)) == ["0.weight"]
    assert "1.weight" in caplog.text


# -- issue 16: names and behaviours found by running Accelerate's own tests against accel ----------


def test_convert_dict_to_env_variables_skips_unsafe_items(caplog):
    from accel.utils import convert_dict_to_env_variables

    env = {"ACCELERATE_DEBUG_MODE": "1", "BAD_ENV_NAME": "<mything", "OTHER_ENV": "2", "EMPTY": ""}
    with caplog.at_level("WARNING", logger="accel.utils.environment"):
        assert convert_dict_to_env_variables(env) == ["ACCELERATE_DEBUG_MODE=1\n", "OTHER_ENV=2\n"]
    assert "BAD_ENV_NAME" in caplog.text and "EMPTY" in caplog.text


def test_torch_dynamo_plugin_reads_the_environment_like_accelerates(monkeypatch):
    from accelerate.utils import TorchDynamoPlugin as Peer

    from accel.utils import DynamoBackend, TorchDynamoPlugin

    for name in ("BACKEND", "MODE", "USE_FULLGRAPH", "USE_DYNAMIC", "USE_REGIONAL_COMPILATION"):
        monkeypatch.delenv(f"ACCELERATE_DYNAMO_{name}", raising=False)
    assert TorchDynamoPlugin().to_dict() == Peer().to_dict() and TorchDynamoPlugin().to_kwargs() == {}
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "true")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    ours, theirs = TorchDynamoPlugin(), Peer()
    assert ours.backend is DynamoBackend.INDUCTOR and ours.dynamic is True and ours.use_regional_compilation
    assert ours.to_dict() == theirs.to_dict() and ours.to_kwargs() == theirs.to_kwargs()
    assert "use_regional_compilation" not in ours.to_kwargs()
    with pytest.raises(ValueError, match="backend='NOPE'"):
        TorchDynamoPlugin(backend="nope")


def test_error_texts_users_compare_are_accelerates():
    from accelerate.utils import recursively_apply as peer_apply

    from accel.utils import recursively_apply

    texts = []
    for apply in (recursively_apply, peer_apply):
        with pytest.raises(TypeError) as caught:
            apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
        texts.append(str(caught.value))
    assert texts[0] == texts[1]


def test_pad_across_processes_warns_on_nested_tensors_and_keeps_out_of_range_dims():
    from accel.utils import CannotPadNestedTensorWarning, pad_across_processes

    PartialState()
    nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(1)])
    with pytest.warns(CannotPadNestedTensorWarning):
        assert pad_across_processes(nested) is nested
    tensor = torch.randn(4, 3, 10)
    assert pad_across_processes(tensor, dim=-1) is tensor and pad_across_processes(tensor, dim=-4) is tensor


def test_convert_outputs_to_fp32_can_be_undone_and_pickled():
    import pickle

    from accel.utils import convert_outputs_to_fp32, extract_model_from_parallel
    from accel.utils.operations import ConvertOutputsToFp32

    model = torch.nn.Linear(2, 2)
    model._original_forward = model.forward
    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
    assert isinstance(model.forward, ConvertOutputsToFp32)  # a class: no local function in the way
    assert model(torch.randn(3, 2)).dtype == torch.float32
    with pytest.raises(pickle.PicklingError, match="unwrap_model"):
        pickle.dumps(model)
    model = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    assert model(torch.randn(3, 2)).dtype == torch.float32
    pickle.loads(pickle.dumps(model))


def test_saving_tied_weights_as_safetensors_logs_what_was_left_out(tmp_path, caplog):
    from safetensors.torch import load_file

    from accel.utils import save

    PartialState()

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(10, 10)
            self.b = self.a

    with caplog.at_level("WARNING"):
        save(Tied().state_dict(), tmp_path / "model.safetensors", safe_serialization=True)
    records = [r for r in caplog.records if "Removed shared tensor" in r.getMessage()]
    assert len(records) == 1 and "b.weight" in records[0].getMessage()
    assert sorted(load_file(tmp_path / "model.safetensors")) == ["a.bias", "a.weight"]


def test_shared_state_survives_pickling_and_says_when_it_was_reset():
    import pickle

    from accel.state import AcceleratorState, reset_state

    state = AcceleratorState()
    _ = state.device
    again = pickle.loads(pickle.dumps(state))
    assert again.__dict__ is state.__dict__ and again.device == state.device
    reset_state()
    with pytest.raises(AttributeError, match="This happens if `AcceleratorState._reset_state\\(\\)` was called"):
        _ = AcceleratorState.__new__(AcceleratorState).__getattr__("device")
    AcceleratorState().destroy_process_group()  # no group: nothing to do, no error


def test_copy_tensor_to_devices_on_one_process():
    from accel.utils.operations import copy_tensor_to_devices

    PartialState()
    assert copy_tensor_to_devices(torch.tensor([1, 2, 3])).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="passed None"):
        copy_tensor_to_devices(None)


def test_accelerate_use_fsdp_asks_for_the_plugin_from_the_environment(monkeypatch):
    from accel.state import AcceleratorState
    from accel.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "1000")
    state = AcceleratorState()
    plugin = state.fsdp_plugin
    assert isinstance(plugin, FullyShardedDataParallelPlugin) and plugin.min_num_params == 1000
    assert state.distributed_type == DistributedType.NO  # one process: nothing to shard, as Accelerate


def test_fsdp_plugin_fields_equal_accelerates(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin as Peer

    from accel.utils import FullyShardedDataParallelPlugin

    # recorded, so that what the plugins set there does not outlive the test
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "unset")
    for name in list(os.environ):
        if name.startswith("FSDP_"):
            monkeypatch.delenv(name)
    cases = [
        {"fsdp_version": 2},
        {"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["B"]},
        {
            "fsdp_version": 2,
            "auto_wrap_policy": "size_based_wrap",
            "min_num_params": 10,
            "reshard_after_forward": False,
        },
        {
            "fsdp_version": 2,
            "mixed_precision_policy": "bf16",
            "state_dict_type": "FULL_STATE_DICT",
            "cpu_offload": True,
        },
        {"fsdp_version": 2, "activation_checkpointing": True, "cpu_ram_efficient_loading": True},
    ]
    for fields in cases:
        assert repr(FullyShardedDataParallelPlugin(**fields)) == repr(Peer(**fields)), fields
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Block,Layer")
    assert repr(FullyShardedDataParallelPlugin()) == repr(Peer())
    with pytest.raises(ValueError, match="Invalid auto wrap policy"):
        FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="everything")
    with pytest.raises(ValueError, match="FSDP2 does not support LOCAL_STATE_DICT"):
        FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="LOCAL_STATE_DICT")


def test_split_batches_validation_says_round_multiple_as_accelerate():
    from torch.utils.data import BatchSampler, SequentialSampler

    from accel.data_loader import BatchSamplerShard, IterableDatasetShard

    batches = BatchSampler(SequentialSampler(range(8)), 3, drop_last=False)
    with pytest.raises(ValueError, match="round multiple"):
        BatchSamplerShard(batches, 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="round multiple"):
        IterableDatasetShard(range(8), batch_size=3, num_processes=2, split_batches=True)
