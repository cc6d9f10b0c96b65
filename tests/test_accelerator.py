"""Single-process tests of the Accelerator facade and its wrappers.

Multi-rank behaviour (DDP, equivalence across ranks, joins) is in tests/multiproc/.
"""

import copy
import json
import os
import random

import pytest
import torch
from support import Counter

from accel.accelerator import Accelerator
from accel.optimizer import AcceleratedOptimizer
from accel.scheduler import AcceleratedScheduler
from accel.state import GradientState
from accel.utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)
from accel.utils.modeling import extract_model_from_parallel
from accel.utils.saving import atomic_save


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def make_data(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True)


class FakeLoader:
    """Stands for a prepared data loader: GradientState reads `end_of_dataloader` from it."""

    end_of_dataloader = False
    remainder = -1


# -- prepare -----------------------------------------------------------------------------------


def test_prepare_wraps_and_keeps_order():
    acc = Accelerator()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    other = {"not": "prepared"}
    out = acc.prepare(sched, other, model, opt)
    assert isinstance(out[0], AcceleratedScheduler) and out[0].scheduler is sched
    assert out[1] is other
    assert out[2] is model  # one process: no DDP wrapper
    assert isinstance(out[3], AcceleratedOptimizer) and out[3].optimizer is opt
    # the scheduler follows the optimizer prepared in the same call, even though it came first
    assert out[0].optimizers == [out[3]]
    assert acc.prepare(out[3]) is out[3]  # preparing twice is a no-op
    assert acc.prepare(model) is model and len(acc._models) == 1


def test_prepare_device_placement_per_object(monkeypatch):
    acc = Accelerator()
    moved = []
    model = make_model()
    monkeypatch.setattr(model, "to", lambda *a, **k: moved.append(a) or model)
    acc.prepare(model, device_placement=[False])
    assert moved == []
    acc2_model = make_model()
    monkeypatch.setattr(acc2_model, "to", lambda *a, **k: moved.append(a) or acc2_model)
    acc.prepare(acc2_model)
    assert moved == [(acc.device,)]
    with pytest.raises(ValueError, match="device_placement has 2 entries for 1"):
        acc.prepare(make_model(), device_placement=[True, False])


def test_optimizer_load_state_dict_places_state_on_device(monkeypatch):
    acc = Accelerator()
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    wrapped = acc.prepare(opt)
    seen = []
    import accel.optimizer as optimizer_module

    real = optimizer_module.move_to_device
    monkeypatch.setattr(optimizer_module, "move_to_device", lambda v, d: seen.append(d) or real(v, d))
    wrapped.load_state_dict(state)
    assert seen and set(seen) == {acc.device}
    assert torch.equal(wrapped.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert wrapped.param_groups is opt.param_groups and wrapped.defaults is opt.defaults


def test_zero_grad_follows_a_replaced_zero_grad_and_survives_pickling():
    import pickle

    acc = Accelerator()
    model = make_model()
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(2, 4)).sum().backward()
    opt.zero_grad()  # torch's zero_grad, which takes set_to_none
    assert model[0].weight.grad is None
    calls = []
    opt.optimizer.zero_grad = lambda: calls.append("plain")  # one that takes no set_to_none
    opt.zero_grad()
    assert calls == ["plain"]
    with pytest.raises(ValueError, match="takes no set_to_none"):
        opt.zero_grad(set_to_none=False)
    del opt.optimizer.zero_grad
    model(torch.randn(2, 4)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert torch.equal(model[0].weight.grad, torch.zeros_like(model[0].weight))
    restored = pickle.loads(pickle.dumps(opt))
    restored.zero_grad()
    assert all(p.grad is None for group in restored.param_groups for p in group["params"])


# -- accumulation ------------------------------------------------------------------------------


def test_accumulate_sync_pattern_and_optimizer_steps_only_at_boundaries():
    acc = Accelerator(gradient_accumulation_steps=3)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x, y = make_data(12)
    pattern, changed = [], []
    for i in range(6):
        before = [p.detach().clone() for p in model.parameters()]
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2])
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        pattern.append(acc.sync_gradients)
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)))
    assert pattern == [False, False, True, False, False, True]
    assert changed == pattern


def test_accumulated_gradients_equal_full_batch_gradients():
    x, y = make_data(8)
    reference = make_model()
    torch.nn.functional.mse_loss(reference(x), y).backward()

    acc = Accelerator(gradient_accumulation_steps=4)
    model = acc.prepare(make_model())
    for i in range(4):
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_end_of_dataloader_forces_sync_and_restarts_the_window():
    acc = Accelerator(gradient_accumulation_steps=4)
    loader = FakeLoader()
    gs = GradientState()
    gs._add_dataloader(loader)
    try:
        seen = []
        for i in range(6):
            loader.end_of_dataloader = i == 2
            with acc.accumulate():
                seen.append(acc.sync_gradients)
        assert seen == [False, False, True, False, False, False]
    finally:
        gs._remove_dataloader(loader)


def test_sync_with_dataloader_false_ignores_the_end():
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    loader = FakeLoader()
    loader.end_of_dataloader = True
    GradientState()._add_dataloader(loader)
    seen = []
    for _ in range(3):
        with acc.accumulate():
            seen.append(acc.sync_gradients)
    assert seen == [False, True, False]


def test_accumulation_arguments_are_checked():
    with pytest.raises(ValueError, match="not both"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    with pytest.raises(ValueError, match="positive integer"):
        Accelerator(gradient_accumulation_steps=0)
    acc = Accelerator(gradient_accumulation_steps=2)
    acc.gradient_accumulation_steps = 5
    assert acc.gradient_accumulation_steps == 5 == GradientState().num_steps


# -- schedulers --------------------------------------------------------------------------------


def _prepared_with_scheduler(acc, scheduler_factory):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = scheduler_factory(opt)
    return acc.prepare(model, opt, sched)


def test_scheduler_steps_only_when_the_optimizer_steps():
    acc = Accelerator(gradient_accumulation_steps=2)
    model, opt, sched = _prepared_with_scheduler(
        acc, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1))
    )
    x, y = make_data(8)
    lrs = []
    for i in range(4):
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]))
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    # as Accelerate: a window of 2 batches advances the schedule once, at its end
    assert lrs == [1.0, pytest.approx(1 / 2), pytest.approx(1 / 2), pytest.approx(1 / 3)]


def test_scheduler_without_adjustment_advances_once_per_optimizer_step():
    plugin = GradientAccumulationPlugin(num_steps=2, adjust_scheduler=False)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    model, opt, sched = _prepared_with_scheduler(
        acc, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1))
    )
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(2, 4)).sum())
            opt.step()
            sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(1 / 3)


@pytest.mark.filterwarnings(
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before"
)  # no optimizer step here, on purpose
def test_scheduler_not_following_optimizer_steps_every_call():
    acc = Accelerator(gradient_accumulation_steps=4, step_scheduler_with_optimizer=False)
    _, _, sched = _prepared_with_scheduler(acc, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    for _ in range(3):
        with acc.accumulate():
            sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.125)


def test_one_cycle_schedule_stops_at_its_end_instead_of_raising():
    acc = Accelerator()
    model, opt, sched = _prepared_with_scheduler(
        acc, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=3)
    )
    sched._processes_factor = 4  # as on 4 processes: each step advances 4 times
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    sched.step()
    sched.step()
    assert sched.scheduler.last_epoch == 3
    assert sched.state_dict()["last_epoch"] == 3


# -- mixed precision ---------------------------------------------------------------------------


def _inner_output_dtypes(model, x):
    dtypes = []
    handle = model[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    out = model(x)
    handle.remove()
    return out, dtypes


def test_bf16_runs_forward_under_autocast_and_returns_fp32():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(make_model())
    out, inner = _inner_output_dtypes(model, torch.randn(3, 4))
    assert inner == [torch.bfloat16] and out.dtype == torch.float32
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    out, inner = _inner_output_dtypes(plain, torch.randn(3, 4))
    assert inner == [torch.float32]
    with acc.autocast():
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.bfloat16


def test_autocast_kwargs_take_effect():
    acc = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    model = acc.prepare(make_model())
    _, inner = _inner_output_dtypes(model, torch.randn(3, 4))
    assert inner == [torch.float32]
    with acc.autocast(autocast_handler=AutocastKwargs(enabled=True)):
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.bfloat16


def test_no_mixed_precision_leaves_forward_alone():
    acc = Accelerator()
    model = make_model()
    assert "forward" not in acc.prepare(model).__dict__
    with acc.autocast():
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.float32


def test_grad_scaler_kwargs_take_effect():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=1)])
    assert acc.scaler is not None and acc.scaler.get_scale() == 1024.0
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    assert acc.scaler.get_scale() == 2048.0  # growth_interval=1: grows after one good step
    assert not opt.step_was_skipped


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    # a small scale, so that only the deliberate inf overflows fp16
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=64.0)])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    before = [p.detach().clone() for p in model.parameters()]
    acc.backward(model(torch.randn(2, 4)).sum() * float("inf"))
    opt.step()
    sched.step()
    assert opt.step_was_skipped and acc.optimizer_step_was_skipped
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert sched.get_last_lr() == [0.1]
    opt.zero_grad()
    acc.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    sched.step()
    assert not opt.step_was_skipped and sched.get_last_lr() == [0.05]


def test_fp8_without_an_engine_names_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("transformer_engine", "torchao") else real(name, *a),
    )
    with pytest.raises(ImportError, match="transformer_engine.*torchao"):
        Accelerator(mixed_precision="fp8")


def test_clip_grad_norm_unscales_first():
    x, y = make_data(4)
    reference = make_model()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)

    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    torch.testing.assert_close(norm, expected, rtol=1e-4, atol=1e-6)
    acc.clip_grad_value_(model.parameters(), 0.01)  # a second unscale in the same step is not done
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.01
    opt.step()
    assert not opt.step_was_skipped


# -- unwrapping ----------------------------------------------------------------------------------


def test_unwrap_through_ddp_and_compile(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    ddp = DistributedDataParallel(model)
    assert extract_model_from_parallel(ddp) is model
    compiled = torch.compile(ddp, backend="eager")
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    kept = extract_model_from_parallel(compiled, keep_torch_compile=True)
    assert kept is compiled and kept._orig_mod is model


def test_prepare_keeps_torch_compile_around_the_model():
    acc = Accelerator(mixed_precision="bf16")
    model = make_model()
    compiled = torch.compile(model, backend="eager")
    prepared = acc.prepare(compiled)
    assert prepared is compiled
    assert acc.unwrap_model(prepared) is compiled  # as Accelerate: the compiled wrapper is kept by default
    assert acc.unwrap_model(prepared, keep_torch_compile=False) is model
    assert prepared(torch.randn(2, 4)).dtype == torch.float32


# -- saving and checkpoints --------------------------------------------------------------------


def test_save_is_atomic(tmp_path):
    target = tmp_path / "weights.pt"
    Accelerator().save({"w": torch.ones(2)}, target)
    assert torch.equal(torch.load(target)["w"], torch.ones(2))

    def crashing_writer(obj, handle):
        handle.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"w": torch.zeros(2)}, target, crashing_writer)
    assert torch.equal(torch.load(target)["w"], torch.ones(2))
    assert os.listdir(tmp_path) == ["weights.pt"]


def _training_setup(acc):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return acc.prepare(model, opt, sched)


def _train_steps(acc, model, opt, sched, n):
    for _ in range(n):
        x = torch.randn(4, 4)
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
            opt.step()
            sched.step()
            opt.zero_grad()


def test_save_and_load_state_resume_identically(tmp_path):
    def fresh():
        acc = Accelerator(
            mixed_precision="fp16", gradient_accumulation_steps=2, kwargs_handlers=[AutocastKwargs(enabled=False)]
        )
        counter = Counter()
        acc.register_for_checkpointing(counter)
        return (acc, counter, *_training_setup(acc))

    acc, counter, model, opt, sched = fresh()
    torch.manual_seed(5)
    _train_steps(acc, model, opt, sched, 6)  # ends at an accumulation boundary
    counter.count = 7
    acc.save_state(tmp_path / "ckpt")
    _train_steps(acc, model, opt, sched, 5)  # draws its data from the RNG saved above
    expected = [p.detach().clone() for p in model.parameters()]
    expected_python = random.random()

    torch.manual_seed(99)  # a different start, as in a new process
    acc, counter, model, opt, sched = fresh()
    acc.load_state(tmp_path / "ckpt")
    assert counter.count == 7 and acc.step == 6
    _train_steps(acc, model, opt, sched, 5)
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p, e)
    assert random.random() == expected_python
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "custom_checkpoint_0.pkl",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "scaler.pt",
        "scheduler.bin",
    ]


def test_automatic_checkpoint_naming_and_total_limit(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config)
    model, opt, sched = _training_setup(acc)
    for _ in range(3):
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    assert acc.save_iteration == 3
    config.iteration = 0
    assert acc.load_state().endswith("checkpoint_2")
    assert acc.save_iteration == 3
    config.iteration = 2
    with pytest.raises(ValueError, match="already exists"):
        acc.save_state()


def test_checkpoint_errors(tmp_path):
    acc = Accelerator()
    with pytest.raises(ValueError, match="needs output_dir"):
        acc.save_state()
    with pytest.raises(ValueError, match="needs input_dir"):
        acc.load_state()
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        acc.load_state(tmp_path / "missing")
    # Accelerate's words: "Item at index i" counts the invalid objects only
    with pytest.raises(ValueError, match=r"invalid:\n\t- Item at index 0, `object`$"):
        acc.register_for_checkpointing(Counter(), object())
    acc.save_state(tmp_path / "empty")
    acc.prepare(make_model())
    with pytest.raises(FileNotFoundError, match="missing model 0"):
        acc.load_state(tmp_path / "empty")


def test_preparing_again_does_not_register_twice(tmp_path):
    acc = Accelerator()
    model, opt, sched = _training_setup(acc)
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    again = acc.prepare(model, opt, sched, loader)
    assert again == (model, opt, sched, loader)
    assert acc.prepare_model(model) is model and acc.prepare_optimizer(opt) is opt
    assert (len(acc._models), len(acc._optimizers), len(acc._schedulers), len(acc._dataloaders)) == (1, 1, 1, 1)
    folder = acc.save_state(tmp_path / "ckpt")
    assert sorted(f for f in os.listdir(folder) if f.startswith("model")) == ["model.safetensors"]
    # forgotten by free_memory, then prepared again: registered again, as Accelerate does
    acc.free_memory()
    assert acc.prepare(model) is model and acc._models == [model]


# -- the rest of the API ---------------------------------------------------------------------------


def test_triggers_single_process():
    acc = Accelerator()
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False


def test_free_memory_forgets_prepared_objects():
    acc = Accelerator()
    model, opt = acc.prepare(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))
    assert acc.free_memory(model, opt) == [None, None]
    assert acc._models == [] and acc._optimizers == [] and acc.step == 0


def test_profile_writes_a_chrome_trace(tmp_path):
    acc = Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))])
    with acc.profile() as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert prof is not None
    with open(tmp_path / "profile_0.json") as handle:
        assert "traceEvents" in json.load(handle)


def test_process_helpers_single_process(capsys):
    acc = Accelerator()
    acc.print("hello")
    assert capsys.readouterr().out == "hello\n"
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    assert acc.on_main_process(lambda: 3)() == 3
    assert acc.on_process(lambda: 3, process_index=1)() is None
    with acc.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]
    with acc.main_process_first():
        acc.wait_for_everyone()
    t = torch.arange(3)
    assert torch.equal(acc.gather(t), t) and torch.equal(acc.reduce(t), t)
    assert torch.equal(acc.pad_across_processes(t), t)
    assert torch.equal(acc.gather_for_metrics(t), t)
    with acc.join_uneven_inputs([]):
        pass
    acc.end_training()


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="more than one AutocastKwargs"):
        Accelerator(kwargs_handlers=[AutocastKwargs(), AutocastKwargs()])
    with pytest.raises(ValueError, match="kwargs_handlers got"):
        Accelerator(kwargs_handlers=[GradientAccumulationPlugin()])
    with pytest.raises(ValueError, match="log_with='tensorboard' writes files"):
        Accelerator(log_with="tensorboard")  # no project_dir (trackers: tests/test_tracking.py)
    with pytest.raises(ValueError, match="conflicts with dataloader_config.split_batches"):
        Accelerator(split_batches=False, dataloader_config=DataLoaderConfiguration(split_batches=True))
    acc = Accelerator(split_batches=True, even_batches=False, rng_types=["torch"], project_dir="proj")
    assert acc.split_batches and not acc.even_batches and acc.rng_types == ["torch"]
    assert acc.project_dir == "proj" and acc.logging_dir == "proj"
    acc2 = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=1)])
    assert acc2.ddp_handler.to_kwargs() == {"bucket_cap_mb": 1}


def test_join_helpers_say_what_is_missing():
    from accel.joining import join_ddp_models, join_optimizer_steps
    from accel.state import active_backend

    # as Accelerate proceeds where it cannot join: a warning saying what is not joined
    with pytest.warns(UserWarning, match="no optimizer was prepared"), join_optimizer_steps([], active_backend()):
        pass
    # as Accelerate: a model that is not DistributedDataParallel gets a warning, not an error
    with pytest.warns(UserWarning, match="DistributedDataParallel models"), join_ddp_models([make_model()]):
        pass


def test_fp8_engine_choice_is_checked():
    from accel.utils.fp8 import find_fp8_engine

    with pytest.raises(ValueError, match="'MSAMP' is not supported"):
        find_fp8_engine("MSAMP")


@pytest.mark.parametrize(
    "name", ["deepspeed_plugin", "megatron_lm_plugin", "torch_tp_plugin", "parallelism_config", "dynamo_backend"]
)
def test_engines_accel_does_not_run_are_refused_by_name(name):
    with pytest.raises(NotImplementedError, match=rf"Accelerator\({name}=\.\.\.\): "):
        Accelerator(**{name: object()})


def test_engine_arguments_left_at_none_or_no_are_accepted():
    Accelerator(deepspeed_plugin=None, dynamo_backend="no", torch_tp_plugin=None)
