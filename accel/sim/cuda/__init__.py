"""The simulated GPU: CUDA tensors held in host memory, `torch.cuda` answering as on a GPU host,
a simulated card's memory, and NCCL's semantics carried by Gloo (`fake` installs it in a rank).

Rooms, one concern each; a room imports only the rooms listed in its docstring's "May import"
line (checked by tests/test_import_cycles.py), which makes this order, lowest first:

* `gpus`: which GPUs a rank has and what card each is (card table, current GPU, generators,
  shapes-only mode, `SimulatedDeviceError`);
* `memory`: the CUDA caching allocator (blocks, settings, expandable segments, the node's ledger,
  history for torch's memory tracker, the memory report and its picture);
* `tensors`: a tensor on a simulated GPU (`SimCudaTensor`), factories and copies onto it,
  checkpoints, the host's waits that sync debug reports;
* `kernels`, `attention`, `nccl`: CUDA kernels computed on the host (BLAS workspaces, SyncBatchNorm,
  RNN cells, extension stand-ins, autocast), `scaled_dot_product_attention`'s backends, and the
  "nccl" process group with functional collectives, DataParallel's copies and stand-in ranks;
* `torch_cuda`: what `torch.cuda` and `torch.accelerator` answer (properties and memory counters,
  streams and events, profiler, determinism, JIT-built extensions);
* `timing`: the clock and cost model of predicted step times (kernels, collectives, steps, reports);
* `fake` (wires every room into a rank) and `rank` (what the runtime asks of a simulated GPU rank).
"""
