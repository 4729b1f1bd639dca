"""Suite-wide plugins: the skip policy (tests/skip_policy.py); and under pytest-xdist (the
README's ``-n auto``) each worker's share of the cores, set before torch is imported: n workers
each running torch's default one thread per core would oversubscribe the machine n-fold."""

import os

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

pytest_plugins = ["tests.skip_policy"]
