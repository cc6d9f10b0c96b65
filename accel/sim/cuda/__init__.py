"""The simulated GPU: CUDA tensors held in host memory, `torch.cuda` answering as on a GPU host,
a simulated card's memory, and NCCL's semantics carried by Gloo (`fake` installs it in a rank)."""
