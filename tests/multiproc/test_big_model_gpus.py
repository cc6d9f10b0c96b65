"""Big-model dispatch across 4 simulated GPUs: a device map planned within `max_memory`, the weights loaded
where it says (a `save_model` checkpoint), activations moving from GPU to GPU, CPU-offloaded blocks run on
the first GPU, and the outputs equal to the model run whole on the CPU."""

from collections import OrderedDict

import torch
from torch import nn

from harness import distributed_test


def stack(blocks=6, width=32):
    torch.manual_seed(0)
    layers = OrderedDict()
    for i in range(blocks):
        layers[f"block{i}"] = nn.Sequential(nn.Linear(width, width), nn.GELU())
    layers["head"] = nn.Linear(width, 2)
    return nn.Sequential(layers).eval()


@distributed_test(world_size=4, device="cuda")
def test_dispatch_across_four_gpus_and_cpu_offload(rank, tmp_path):
    from accel import infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch
    from accel.utils.saving import write_model_weights

    reference = stack()
    folder = tmp_path / "weights"
    if rank == 0:
        write_model_weights(reference.state_dict(), str(folder), max_shard_size="5KB")
    torch.distributed.barrier()
    x = torch.randn(3, 32)
    expected = reference(x)

    block = (32 * 32 + 32) * 4  # bytes of one block's weights
    memory = {0: 2 * block, 1: 2 * block, 2: 2 * block, 3: 2 * block, "cpu": 10 * block}
    with init_empty_weights():
        model = stack()
    device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=["Sequential"])
    from accelerate.utils import infer_auto_device_map as peer

    with init_empty_weights():
        assert peer(stack(), max_memory=dict(memory), no_split_module_classes=["Sequential"]) == device_map
    # GPU 0 keeps room for the largest layer, so it holds one block; the others two each
    assert device_map["block0"] == 0 and device_map["block1"] == 1 and device_map["block2"] == 1
    assert {device_map[f"block{i}"] for i in range(6)} == {0, 1, 2, 3}
    model = load_checkpoint_and_dispatch(model, str(folder), device_map=device_map)
    for name, device in device_map.items():
        weight = model.get_submodule(name)[0].weight if name.startswith("block") else model.get_submodule(name).weight
        assert weight.device == torch.device("cuda", device), name
    out = model(x)  # inputs on the CPU: outputs come back there
    assert out.device.type == "cpu" and torch.allclose(out, expected, atol=1e-6)

    # blocks mapped to the CPU are offloaded: kept in host memory, run on GPU 0
    with init_empty_weights():
        model = stack()
    offloaded = {"block0": 0, "block1": "cpu", "block2": 1, "block3": "cpu", "block4": 2, "block5": 3, "head": 3}
    model = load_checkpoint_and_dispatch(model, str(folder), device_map=offloaded)
    assert model.block1[0].weight.device.type == "meta"
    seen = []
    model.block1[0].register_forward_hook(lambda m, i, o: seen.append(o.device))
    out = model(x.cuda(0))
    assert seen == [torch.device("cuda", 0)] and out.device == torch.device("cuda", 0)
    assert torch.allclose(out.cpu(), expected, atol=1e-6)
