"""GPU memory of a simulated GPU, counted as PyTorch's CUDA caching allocator counts it.

Here: the allocator (`allocator`, its `blocks` and pools), its settings (`settings`, and the rules they
change, expandable segments included, in `configured`), the node's ledger that processes share
(`node`), the history behind torch's memory tracker (`history`), what uses the memory (`report`,
drawn by `picture`). Rooms above name themselves to it (`allocator.follow_starts`,
`report.collective_source`) rather than being imported.
May import: gpus.
"""
