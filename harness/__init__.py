"""pytest plugin for multi-rank tests (see harness.plugin)."""
