"""What running Accelerate's tests/fsdp/test_fsdp.py against accel turned up, one test each: FSDP1 fields hold
torch's enums, FSDP2 drops backward_prefetch with a warning, the run's precision reaches the plugin (on one
process too), set_auto_wrap_policy binds torch's policies, the RAM-efficient-loading switches."""

import functools
import logging

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from accel.utils import FullyShardedDataParallelPlugin as Plugin
from accel.utils import patch_environment


@pytest.mark.parametrize(
    "given,expected",
    [
        ("FULL_SHARD", ShardingStrategy.FULL_SHARD),
        ("shard_grad_op", ShardingStrategy.SHARD_GRAD_OP),
        ("3", ShardingStrategy.NO_SHARD),
        (4, ShardingStrategy.HYBRID_SHARD),
        ("HYBRID_SHARD_ZERO2", ShardingStrategy._HYBRID_SHARD_ZERO2),
        (ShardingStrategy.NO_SHARD, ShardingStrategy.NO_SHARD),
    ],
)
def test_fsdp1_sharding_strategy_is_torchs_enum(given, expected):
    assert Plugin(fsdp_version=1, sharding_strategy=given).sharding_strategy == expected
    with patch_environment(FSDP_SHARDING_STRATEGY=str(getattr(given, "name", given))):
        plugin = Plugin(fsdp_version=1)
    assert plugin.sharding_strategy == expected and plugin.reshard_after_forward is None


def test_bad_fsdp1_fields_are_refused():
    with pytest.raises(ValueError, match=r"'EVERYTHING' is not a ShardingStrategy: use one of \['FULL_SHARD'"):
        Plugin(fsdp_version=1, sharding_strategy="EVERYTHING")
    with pytest.raises(ValueError, match="9 is not a BackwardPrefetch"):
        Plugin(fsdp_version=1, backward_prefetch=9)
    with pytest.raises(ValueError, match="FSDP2's spelling"):
        Plugin(fsdp_version=1, sharding_strategy=None, reshard_after_forward=True)


def test_fsdp2_takes_reshard_after_forward_and_no_sharding_strategy():
    with patch_environment(FSDP_RESHARD_AFTER_FORWARD="false"):
        plugin = Plugin(fsdp_version=2)
    assert plugin.reshard_after_forward is False and plugin.sharding_strategy is None


@pytest.mark.parametrize("given", ["BACKWARD_POST", "2", BackwardPrefetch.BACKWARD_POST])
def test_backward_prefetch(given, caplog):
    assert Plugin(fsdp_version=1, backward_prefetch=given).backward_prefetch == BackwardPrefetch.BACKWARD_POST
    with patch_environment(FSDP_BACKWARD_PREFETCH="backward_pre"):
        assert Plugin(fsdp_version=1).backward_prefetch == BackwardPrefetch.BACKWARD_PRE
    assert Plugin(fsdp_version=1, backward_prefetch="NO_PREFETCH").backward_prefetch is None
    with caplog.at_level(logging.WARNING, logger="accel.utils.dataclasses"):
        assert Plugin(fsdp_version=2, backward_prefetch=given).backward_prefetch is None  # FSDP2 prefetches itself
    assert "backward_prefetch is not supported in FSDP2" in caplog.text


@pytest.mark.parametrize("flag", [True, False])
def test_fsdp1_cpu_offload_is_torchs_config(flag):
    assert Plugin(fsdp_version=1, cpu_offload=flag).cpu_offload == CPUOffload(offload_params=flag)
    with patch_environment(FSDP_OFFLOAD_PARAMS=str(flag).lower()):
        assert Plugin(fsdp_version=1).cpu_offload == CPUOffload(offload_params=flag)


def test_the_runs_precision_becomes_the_plugins_policy_on_one_process():
    from accel import Accelerator
    from accel.state import reset_state

    reset_state()
    try:
        with patch_environment(ACCEL_MIXED_PRECISION="bf16", ACCELERATE_USE_FSDP="true", FSDP_VERSION="2"):
            accelerator = Accelerator()
        assert accelerator.mixed_precision == "bf16"
        expected = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16
        )
        assert accelerator.state.fsdp_plugin.mixed_precision_policy == expected
    finally:
        reset_state()


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)


class Model(nn.Module):
    _no_split_modules = ["Layer"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])


def test_set_auto_wrap_policy_binds_torchs_policies():
    plugin = Plugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    plugin.set_auto_wrap_policy(Model())
    policy = plugin.auto_wrap_policy
    assert isinstance(policy, functools.partial) and policy.func is transformer_auto_wrap_policy
    assert policy.keywords == {"transformer_layer_cls": {Layer}} and plugin.transformer_cls_names_to_wrap == ["Layer"]
    plugin.set_auto_wrap_policy(Model())  # a second time: the same
    assert plugin.auto_wrap_policy.keywords == {"transformer_layer_cls": {Layer}}

    with patch_environment(FSDP_AUTO_WRAP_POLICY="SIZE_BASED_WRAP", FSDP_MIN_NUM_PARAMS="30"):
        plugin = Plugin(fsdp_version=2)
    plugin.set_auto_wrap_policy(Model())
    assert plugin.auto_wrap_policy.func is size_based_auto_wrap_policy
    assert plugin.auto_wrap_policy.keywords == {"min_num_params": 30}

    plugin = Plugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=0)
    plugin.set_auto_wrap_policy(Model())
    assert plugin.auto_wrap_policy is None  # no minimum: nothing but the root is wrapped

    plugin = Plugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap="T5Layer")
    with pytest.raises(ValueError, match="Could not find the transformer layer class T5Layer in the model."):
        plugin.set_auto_wrap_policy(Model())


def test_size_based_wrapping_without_a_minimum_wraps_nothing():
    from accel.fsdp import auto_wrap_predicate

    assert (
        auto_wrap_predicate(Plugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=0), Model())
        is None
    )
    wraps = auto_wrap_predicate(Plugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=19), Model())
    assert wraps(Layer()) and not wraps(nn.Linear(3, 3))  # more than 19 parameters: 20 and 12


def test_ram_efficient_loading_switches(monkeypatch):
    from accel.utils import disable_fsdp_ram_efficient_loading, enable_fsdp_ram_efficient_loading

    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        # set first so that monkeypatch records them and takes back what the switches set: left in this
        # process's environment, they made later `accel launch` runs of Accelerate's scripts use FSDP
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    enable_fsdp_ram_efficient_loading()
    import os

    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "True" and os.environ["ACCELERATE_USE_FSDP"] == "True"
    assert Plugin(fsdp_version=2).cpu_ram_efficient_loading is True
    disable_fsdp_ram_efficient_loading()
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "False"
    assert Plugin(fsdp_version=2).cpu_ram_efficient_loading is False


def test_accelerates_fsdp_constants():
    from accel.utils import constants

    assert constants.FSDP_SHARDING_STRATEGY[4] == "HYBRID_SHARD_ZERO2"
    assert constants.FSDP2_STATE_DICT_TYPE == ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
    assert constants.FSDP_AUTO_WRAP_POLICY == ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
    assert constants.FSDP_MODEL_NAME == "pytorch_model_fsdp"
