"""CPU threads of a run: ``--threads`` and the OpenMP wait policy (docs/performance.md,
"Under contention").

Two settings decide how a CPU run behaves when it shares the cores with other work:

* **threads** — torch's intra-op pool (``torch.set_num_threads``; OpenMP, MKL and oneDNN follow
  it) and its inter-op pool (``torch.set_num_interop_threads``). ``--threads N`` sets both to N;
  ``--threads 0`` (the default) leaves torch's own choice: ``OMP_NUM_THREADS`` when exported
  (so a caller that pins it, a test suite or a job scheduler, keeps control), else one per CPU
  the process may run on.
* **OMP_WAIT_POLICY** — what an OpenMP worker does between two parallel regions: ``ACTIVE``
  spins (a contended core is then shared with a thread doing nothing useful, and a region waits
  for its slowest thread), ``PASSIVE`` sleeps at once (a futex wake per region). libgomp, the
  OpenMP of the torch wheels, reads it once, when torch loads it, so
  `apps.calm_llm.__main__` sets it (`set_wait_policy`) before anything imports torch; a value
  the user exported wins, and an exported empty value leaves libgomp's own default (spin for
  a while, then sleep).

The choice of the defaults is measured by ``python -m bench.contention`` (SFT step time at
threads × wait policy × competing load, in subprocesses). Cost: none beyond the two calls.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_WAIT_POLICY = "PASSIVE"


def set_wait_policy(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``OMP_WAIT_POLICY`` to `DEFAULT_WAIT_POLICY` unless the user set it; an empty value
    is removed (libgomp's own default). Returns the value in effect (None: libgomp's default).

    Must run before ``import torch`` in the process: libgomp reads the variable when it loads.
    """
    env = os.environ if environ is None else environ
    value = env.get("OMP_WAIT_POLICY")
    if value is None:
        env["OMP_WAIT_POLICY"] = value = DEFAULT_WAIT_POLICY
    elif not value.strip():
        del env["OMP_WAIT_POLICY"]  # libgomp rejects "" with an error line: unset means its default
        return None
    return value


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where the platform
    has no affinity call, e.g. macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def apply_threads(threads: int) -> tuple[int, int]:
    """Set torch's intra-op and inter-op threads to ``threads`` (0: leave torch's own, which
    is ``OMP_NUM_THREADS`` or one per CPU); returns (intra, inter) as torch reports them after.

    The inter-op pool can be sized only before its first use in the process (torch raises
    otherwise): a second run in the same process keeps the size the first one set, since that
    pool only matters for ``torch.jit.fork``-style work that this app does not do.
    """
    import torch

    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = one per usable CPU), got {threads}")
    if threads == 0:
        return torch.get_num_threads(), torch.get_num_interop_threads()
    n = threads
    torch.set_num_threads(n)
    if torch.get_num_interop_threads() != n:
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:  # already started in this process (an earlier run, a test)
            pass
    return torch.get_num_threads(), torch.get_num_interop_threads()
