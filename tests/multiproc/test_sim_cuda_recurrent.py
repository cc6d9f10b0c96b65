"""Recurrent and speech layers on simulated GPUs, against the same on the CPU: LSTM and GRU (their fused CUDA
cells, `accel.sim.cuda.kernels.rnn`), packed sequences and CTC loss with lengths on the host
(`accel.sim.cuda.kernels.host_arguments`)."""

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


def _same_on_gpu(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module).cuda()


def _close(gpu: torch.Tensor, cpu: torch.Tensor) -> None:
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@distributed_test(world_size=[2], device="cuda")
def test_recurrent_layers_give_the_cpus_outputs_and_gradients(rank, world_size, kind):
    torch.cuda.set_device(rank)
    torch.manual_seed(rank)
    cpu = getattr(torch.nn, kind)(6, 8, num_layers=2, bidirectional=True, batch_first=True)
    gpu = _same_on_gpu(cpu)
    x = torch.randn(3, 5, 6, requires_grad=True)
    x_gpu = x.detach().cuda().requires_grad_()
    (out, state), (out_gpu, state_gpu) = cpu(x), gpu(x_gpu)
    _close(out_gpu, out)
    for got, want in zip(
        state_gpu if kind == "LSTM" else [state_gpu], state if kind == "LSTM" else [state], strict=True
    ):
        _close(got, want)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    (out_gpu * weights.cuda()).sum().backward()
    _close(x_gpu.grad, x.grad)
    for (name, p_gpu), p in zip(gpu.named_parameters(), cpu.parameters(), strict=True):
        assert p_gpu.grad is not None, name
        _close(p_gpu.grad, p.grad)


@distributed_test(world_size=[2], device="cuda")
def test_packed_sequences_keep_their_lengths_on_the_host(rank, world_size):
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.cuda.set_device(rank)
    cpu = torch.nn.LSTM(4, 6)
    gpu = _same_on_gpu(cpu)
    padded = torch.randn(5, 3, 4)
    lengths = torch.tensor([5, 3, 2])  # on the host, as pack_padded_sequence requires
    packed = pack_padded_sequence(padded.cuda(), lengths)
    assert packed.data.device.type == "cuda" and packed.batch_sizes.device.type == "cpu"
    assert packed.batch_sizes.tolist() == [3, 3, 2, 1, 1]
    out_gpu, lengths_gpu = pad_packed_sequence(gpu(packed)[0])
    out, _ = pad_packed_sequence(cpu(pack_padded_sequence(padded, lengths))[0])
    assert lengths_gpu.tolist() == [5, 3, 2]
    _close(out_gpu, out)
    out_gpu.sum().backward()
    assert gpu.weight_hh_l0.grad.device.type == "cuda"
    with pytest.raises(RuntimeError, match="'lengths' argument should be a 1D CPU int64 tensor"):
        pack_padded_sequence(padded.cuda(), lengths.cuda())  # torch's own check, as on a GPU


@distributed_test(world_size=[2], device="cuda")
def test_ctc_loss_with_lengths_on_the_host_gives_the_cpus_loss_and_gradient(rank, world_size):
    torch.cuda.set_device(rank)
    torch.manual_seed(rank)
    log_probs = torch.randn(30, 2, 10).log_softmax(2).requires_grad_()
    targets = torch.randint(1, 10, (2, 8))
    input_lengths, target_lengths = torch.tensor([30, 25]), torch.tensor([8, 5])
    loss = torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths)
    on_gpu = log_probs.detach().cuda().requires_grad_()
    loss_gpu = torch.nn.functional.ctc_loss(on_gpu, targets.cuda(), input_lengths, target_lengths)
    _close(loss_gpu, loss.detach())
    loss.backward()
    loss_gpu.backward()
    _close(on_gpu.grad, log_probs.grad)
    # lengths on the GPU are read as well; the sum of the losses is the CPU's
    summed = torch.nn.CTCLoss(reduction="sum")(on_gpu, targets.cuda(), input_lengths.cuda(), target_lengths.cuda())
    _close(summed, torch.nn.CTCLoss(reduction="sum")(log_probs, targets, input_lengths, target_lengths).detach())


@distributed_test(world_size=SIZES, device="cuda")
def test_ddp_gru_trains_as_one_process_on_the_whole_batch(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    reference = torch.nn.GRU(4, 5, batch_first=True)
    model = DistributedDataParallel(_same_on_gpu(reference), device_ids=[rank])
    whole = torch.randn(2 * world_size, 6, 4, generator=torch.Generator().manual_seed(1))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    for _ in range(3):
        for net, batch, optimizer in (
            (model, whole[2 * rank : 2 * rank + 2].cuda(), optimizers[0]),
            (reference, whole, optimizers[1]),
        ):
            optimizer.zero_grad()
            net(batch)[0].square().mean().backward()
            optimizer.step()
    for p_gpu, p in zip(model.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p_gpu.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6)


@distributed_test(world_size=[2], device="cuda")
def test_cudnn_weight_flattening_a_cuda_build_asks_for_keeps_the_weights(rank, world_size):
    # on a CUDA build with cuDNN, nn.LSTM.cuda() flattens its weights; cuDNN is not simulated: they stay apart
    torch.cuda.set_device(rank)
    lstm = torch.nn.LSTM(3, 4).cuda()
    weights = [w.detach().clone() for w in lstm._flat_weights]
    flat = torch._cudnn_rnn_flatten_weight(lstm._flat_weights, 4, 3, 2, 4, 0, 1, False, False)
    assert flat.device.type == "cuda" and flat.numel() == sum(w.numel() for w in weights)
    for kept, before in zip(lstm._flat_weights, weights, strict=True):
        assert torch.equal(kept, before)
