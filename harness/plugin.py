"""pytest plugin entry point (pytest11): @distributed_test, rank fixtures, markers."""
