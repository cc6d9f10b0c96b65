"""`scaled_dot_product_attention` on a simulated GPU: the backend the card would pick, with its memory.

Here: the choice among flash, efficient, cuDNN and math as torch's C++ makes it (`backends`), the fused
kernels' results and workspaces (`kernels`), and the entry that routes each call (`sdpa`).
May import: gpus, memory, tensors.
"""
