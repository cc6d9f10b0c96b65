"""CUDA extensions built at first use, on simulated GPUs: stand-ins in torch ops, or a clear error at once.

DeepSpeed builds FusedAdam (its optimizer for "Adam" / "AdamW" configs), FusedLamb and
FusedLion just in time through `torch.utils.cpp_extension.load`; on simulated GPUs they get
stand-ins that step as torch's optimizers do, to float rounding. Any other CUDA extension
fails at once, naming it, and writes nothing to the extensions directory. The rank tests
run on 2 and 4 simulated GPU ranks.
"""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]
STEPS = 5
LAMB_LR = 0.05


@contextlib.contextmanager
def extensions_dir(path):
    """TORCH_EXTENSIONS_DIR set to `path` inside the block (a rank process lives on after the test)."""
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    try:
        yield path
    finally:
        if before is None:
            del os.environ["TORCH_EXTENSIONS_DIR"]
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = before


def written(path):
    """Every file and directory under `path` (none when it does not exist)."""
    return sorted(os.path.join(root, name) for root, dirs, files in os.walk(path) for name in dirs + files)


def parameters(seed, dtype=torch.float32):
    """Two parameters on the current simulated GPU, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to("cuda", dtype)) for shape in shapes]


def run_steps(optimizer, params, seed, steps=STEPS):
    """`steps` optimizer steps on fixed gradients (different at each step)."""
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to("cuda", p.dtype)
        optimizer.step()


def adam_reference(params, seed, lr, betas, eps, decay, decoupled, bias_correction):
    """Adam / AdamW written out in float64, bias correction on or off (torch's optimizers always correct)."""
    ref = [p.detach().double().cpu() for p in params]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    generator = torch.Generator().manual_seed(seed + 1)
    for step in range(1, STEPS + 1):
        for i, p in enumerate(ref):
            g = torch.randn(p.shape, generator=generator).double()
            if not decoupled:
                g = g + decay * p
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            c1, c2 = (1 - betas[0] ** step, 1 - betas[1] ** step) if bias_correction else (1.0, 1.0)
            update = (m[i] / c1) / ((v[i] / c2).sqrt() + eps)
            if decoupled:
                update = update + decay * p
            ref[i] = p - lr * update
    return ref


@pytest.mark.parametrize("adam_w_mode", [True, False])
@distributed_test(world_size=SIZES, device="cuda")
def test_fused_adam_steps_as_torch_adamw_and_adam(rank, tmp_path, adam_w_mode):
    pytest.importorskip("deepspeed")
    from deepspeed.ops.adam import FusedAdam

    settings = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    with extensions_dir(tmp_path / f"rank{rank}"):
        fused_params, torch_params = parameters(rank), parameters(rank)
        fused = FusedAdam(fused_params, adam_w_mode=adam_w_mode, **settings)
        reference = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(torch_params, **settings)
        run_steps(fused, fused_params, rank)
        run_steps(reference, torch_params, rank)
    for got, expected in zip(fused_params, torch_params, strict=True):
        assert got.device == torch.device("cuda", rank) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        moments = fused.state[got]
        torch.testing.assert_close(moments["exp_avg"], reference.state[expected]["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(moments["exp_avg_sq"], reference.state[expected]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    assert (fused_params[0] - parameters(rank)[0]).abs().max() > 1e-3  # it did move
    assert written(tmp_path / f"rank{rank}") == []  # nothing was compiled


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@distributed_test(world_size=[2], device="cuda")
def test_fused_adam_bias_correction_on_and_off(rank, tmp_path, adam_w_mode, bias_correction):
    pytest.importorskip("deepspeed")
    from deepspeed.ops.adam import FusedAdam

    settings = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05}
    with extensions_dir(tmp_path):
        params = parameters(rank)
        fused = FusedAdam(params, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **settings)
        run_steps(fused, params, rank)
    expected = adam_reference(
        parameters(rank),
        rank,
        settings["lr"],
        settings["betas"],
        settings["eps"],
        settings["weight_decay"],
        decoupled=adam_w_mode,
        bias_correction=bias_correction,
    )
    for got, want in zip(params, expected, strict=True):
        torch.testing.assert_close(got.detach().cpu().double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@distributed_test(world_size=[2], device="cuda")
def test_fused_adam_half_precision_parameters_follow_float32_math(rank, tmp_path, dtype):
    pytest.importorskip("deepspeed")
    from deepspeed.ops.adam import FusedAdam

    with extensions_dir(tmp_path):
        params = parameters(rank, dtype)
        fused = FusedAdam(params, lr=1e-2, weight_decay=0.01)
        run_steps(fused, params, rank, steps=1)
    # one step from fp32 copies of the same values, rounded to `dtype` at the end as the kernel stores them
    wide = [torch.nn.Parameter(p.detach().float()) for p in parameters(rank, dtype)]
    reference = torch.optim.AdamW(wide, lr=1e-2, weight_decay=0.01)
    generator = torch.Generator().manual_seed(rank + 1)
    for p in wide:
        p.grad = torch.randn(p.shape, generator=generator).to("cuda", dtype).float()
    reference.step()
    for got, want in zip(params, wide, strict=True):
        assert got.dtype == dtype and fused.state[got]["exp_avg"].dtype == dtype
        torch.testing.assert_close(got, want.to(dtype))


@distributed_test(world_size=SIZES, device="cuda")
def test_fused_lamb_trains_and_matches_its_formula(rank, tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.ops.lamb import FusedLamb

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).cuda()
    x = torch.randn(32, 6, device="cuda")
    y = x @ torch.randn(6, 1, device="cuda")  # a target the model can learn
    start = {name: p.detach().double().cpu() for name, p in model.named_parameters()}
    with extensions_dir(tmp_path / f"rank{rank}"):
        optimizer = FusedLamb(model.parameters(), lr=LAMB_LR, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01)
        losses = []
        for step in range(30):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if step == 0:
                grads = {name: p.grad.detach().double().cpu() for name, p in model.named_parameters()}
            optimizer.step()
            if step == 0:
                first = {name: p.detach().double().cpu() for name, p in model.named_parameters()}
                coefficients = optimizer.get_lamb_coeffs()
            losses.append(loss.item())
    # the first step, written out: Adam moments, eps outside the root, trust ratio ||w|| / ||update||
    for (name, w), coefficient in zip(start.items(), coefficients, strict=True):
        g = grads[name]
        m, v = 0.1 * g, 0.001 * g * g
        update = m / (v.sqrt() + 1e-8) + 0.01 * w
        ratio = min(max((w.norm() / update.norm()).item(), 0.01), 10.0)
        assert coefficient == pytest.approx(ratio, rel=1e-4), name
        step_size = LAMB_LR * (1 - 0.999) ** 0.5 / (1 - 0.9)
        torch.testing.assert_close(first[name], w - step_size * ratio * update, rtol=1e-5, atol=1e-6)
    assert losses[-1] < 0.9 * losses[0] and losses == sorted(losses, reverse=True), losses
    assert written(tmp_path / f"rank{rank}") == []


@distributed_test(world_size=[2], device="cuda")
def test_fused_lion_matches_its_formula(rank, tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.ops.lion import FusedLion

    lr, betas, decay = 1e-3, (0.9, 0.99), 0.1
    with extensions_dir(tmp_path):
        params = parameters(rank)
        run_steps(FusedLion(params, lr=lr, betas=betas, weight_decay=decay), params, rank)
    expected = [p.detach().double().cpu() for p in parameters(rank)]
    moments = [torch.zeros_like(p) for p in expected]
    generator = torch.Generator().manual_seed(rank + 1)
    for _ in range(STEPS):
        for i, p in enumerate(expected):
            g = torch.randn(p.shape, generator=generator).double()
            direction = betas[0] * moments[i] + (1 - betas[0]) * g
            expected[i] = p * (1 - lr * decay) - lr * torch.where(direction > 0, 1.0, -1.0)
            moments[i] = betas[1] * moments[i] + (1 - betas[1]) * g
    for got, want in zip(params, expected, strict=True):
        torch.testing.assert_close(got.detach().cpu().double(), want, rtol=1e-5, atol=1e-6)


@distributed_test(world_size=SIZES, device="cuda")
def test_a_cuda_extension_without_a_stand_in_fails_at_once_and_writes_nothing(rank, tmp_path):
    from torch.utils.cpp_extension import load, load_inline

    from accel.sim.cuda.fake import SimulatedDeviceError

    source = tmp_path / f"my_kernel_{rank}.cu"
    source.write_text("__global__ void k() {}\n")
    with extensions_dir(tmp_path / f"extensions{rank}") as root:
        with pytest.raises(SimulatedDeviceError) as info:
            load(name="my_kernel", sources=[str(source)], verbose=False)
        message = str(info.value)
        assert f"the CUDA extension 'my_kernel' (my_kernel_{rank}.cu)" in message
        assert "is not available on a simulated GPU" in message and "Nothing was built or written" in message
        with pytest.raises(SimulatedDeviceError, match="the CUDA extension 'inline_kernel'"):
            load_inline(name="inline_kernel", cpp_sources="", cuda_sources="__global__ void k() {}")
        # a source of a stand-in's name is not taken for it unless it is that kernel's source
        with pytest.raises(SimulatedDeviceError, match="the CUDA extension 'fused_adam'.*torch_adam"):
            load(name="fused_adam", sources=[str(source)])
        assert written(root) == []


@distributed_test(world_size=[2], device="cuda")
def test_deepspeed_kernels_without_a_stand_in_name_the_switch_that_avoids_them(rank, tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.ops.op_builder import QuantizerBuilder, TransformerBuilder

    from accel.sim.cuda.fake import SimulatedDeviceError

    with extensions_dir(tmp_path) as root:
        with pytest.raises(SimulatedDeviceError) as info:
            QuantizerBuilder().load()
        message = str(info.value)
        assert "the CUDA extension 'quantizer'" in message and "built by DeepSpeed's QuantizerBuilder" in message
        assert '"zero_quantized_weights": false' in message
        with pytest.raises(SimulatedDeviceError, match="DeepSpeedTransformerLayer"):
            TransformerBuilder().load()
        assert written(root) == []


@distributed_test(world_size=[2], device="cuda")
def test_the_stand_ins_check_their_inputs_as_the_kernels_do(rank):
    from accel.sim.cuda.kernels import extension as kernels

    g, p = torch.ones(4, device="cuda"), torch.ones(4, device="cuda")
    m, v = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    args = (1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    with pytest.raises(RuntimeError, match="expected input to be on cuda"):
        kernels.multi_tensor_adam(2048, flag, [[g.cpu()], [p.cpu()], [m.cpu()], [v.cpu()]], *args)
    with pytest.raises(RuntimeError, match="Size mismatch"):
        kernels.multi_tensor_adam(2048, flag, [[g], [p[:2]], [m], [v]], *args)
    with pytest.raises(RuntimeError, match="A tensor was not contiguous."):
        wide = torch.ones(4, 2, device="cuda").t()
        kernels.multi_tensor_adam(2048, flag, [[wide], [wide], [wide], [wide]], *args)
    with pytest.raises(RuntimeError, match="tensor_lists.size\\(\\) != depth"):
        kernels.multi_tensor_adam(2048, flag, [[g], [p], [m]], *args)
    ints = torch.ones(4, dtype=torch.int, device="cuda")
    with pytest.raises(RuntimeError, match="\"adam\" not implemented for 'Int'"):
        kernels.multi_tensor_adam(2048, flag, [[ints], [ints], [ints], [ints]], *args)
    empty = torch.tensor([], dtype=torch.float)
    with pytest.raises(RuntimeError, match="g must be a CUDA tensor"):
        kernels.lamb(p, empty, m, v, g.cpu(), 1e-3, 0.9, 0.999, 10.0, 0.01, 1e-8, 1.0, 1, 1, 1, 0.0)
    coefficient = kernels.lamb(p, empty, m, v, g, 1e-3, 0.9, 0.999, 10.0, 0.01, 1e-8, 1.0, 1, 1, 1, 0.0)
    assert coefficient.device == torch.device("cuda", rank) and coefficient.shape == (1,)


@pytest.mark.frameworks
@pytest.mark.parametrize("stage", [1, 2, 3])
# isolated: DeepSpeed keeps the process groups of the run it set up in module globals
@distributed_test(world_size=[2], device="cuda", timeout=180, isolated=True)
def test_deepspeed_zero_with_an_adamw_config_trains_as_torch_adamw_ddp(rank, tmp_path, stage):
    pytest.importorskip("deepspeed")
    import deepspeed
    from torch.nn.parallel import DistributedDataParallel

    settings = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": settings},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 by default; the DDP run does not clip
    }

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def batches():
        """Each rank's batch, the same at every step, of a target the model can learn."""
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + rank))
        return [(x, x @ torch.randn(8, 1, generator=torch.Generator().manual_seed(7)))] * 6

    with extensions_dir(tmp_path / f"rank{rank}"):
        engine, optimizer, _, _ = deepspeed.initialize(model=mlp(), model_parameters=None, config=config)
        assert type(optimizer.optimizer).__name__ == "FusedAdam"
        losses = []
        for x, y in batches():
            loss = torch.nn.functional.mse_loss(engine(x.cuda()), y.cuda())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    assert written(tmp_path / f"rank{rank}") == []
    ddp = DistributedDataParallel(mlp().cuda(), device_ids=[rank])
    reference = torch.optim.AdamW(ddp.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    expected = []
    for x, y in batches():
        reference.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x.cuda()), y.cuda())
        loss.backward()
        reference.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5), (losses, expected)
    assert losses[-1] < losses[0]


def test_the_stand_ins_import_no_framework():
    code = (
        "import sys, accel.sim.cuda.torch_cuda.extensions, accel.sim.cuda.kernels.extension;"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'apex')], 'imported a framework'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_which_extensions_are_cuda_ones_and_which_have_stand_ins():
    from accel.sim.cuda.torch_cuda import extensions

    assert extensions.builds_cuda(["a.cpp", "b.cu"], None) and extensions.builds_cuda(["a.cpp"], True)
    assert not extensions.builds_cuda(["a.cpp"], None) and not extensions.builds_cuda(["b.cu"], False)
    adam = ["/x/csrc/adam/fused_adam_frontend.cpp", "/x/csrc/adam/multi_tensor_adam.cu"]
    assert extensions.find_stand_in("fused_adam", adam).name == "fused_adam"
    assert extensions.find_stand_in("fused_adam", ["/y/other.cu"]) is None
    assert extensions.find_stand_in("fused_lamb", ["fused_lamb_cuda.cpp", "fused_lamb_cuda_kernel.cu"]) is not None
    assert extensions.find_stand_in("my_kernel", ["multi_tensor_adam.cu"]) is None


@distributed_test(world_size=[2], device="cuda")
def test_a_triton_kernel_fails_at_its_launch_naming_it(rank):
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from accel.sim.cuda.fake import SimulatedDeviceError

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

    x = torch.zeros(8, device="cuda")
    with pytest.raises(SimulatedDeviceError, match="Triton kernel '.*add_one' is not available on a simulated GPU"):
        add_one[(1,)](x, 8, BLOCK=8)
    assert x.sum().item() == 0
