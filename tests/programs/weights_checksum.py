"""What the framework programs print of their weights, so that runs on different devices compare."""

import hashlib


def checksum(tensors):
    """A digest of the tensors' float32 values and names, their sum and the sum of their absolute values."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().float().cpu().contiguous().numpy().tobytes())
    values = [t.detach().double().cpu() for t in tensors.values()]
    return {
        "sha256": digest.hexdigest()[:16],
        "sum": sum(float(v.sum()) for v in values),
        "abs": sum(float(v.abs().sum()) for v in values),
    }
