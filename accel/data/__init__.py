"""Building blocks of `accel.data_loader`: samplers, dataset shards and loader classes.

Users import every public name from `accel.data_loader`; these modules only keep each
concern small (index sharding, iterable sharding, the per-rank loader, the dispatcher).
"""
