"""Simulator: N real Gloo ranks on one machine, fake CUDA and XLA."""
