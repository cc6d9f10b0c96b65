"""The diagnoses: collective checks, deadlocks, failures and their stacks, injected faults."""
