"""Per-call overhead of ``bilevel.hypergrad`` against the plain-PyTorch floor, in counts that a
contended machine cannot distort (no timings).

    python -m bench.overhead            # the flagged rows of bench/results/hypergrad*.json
    python -m bench.overhead --counts   # + aten ops, Python calls and syncs per call

The rows: every committed (problem, size, method) where ``bilevel``'s best-of time is more
than 1.2× ``plain_torch``'s or above the fastest peer's. The counts, for one hypergradient
call of each library on the small instances where fixed costs dominate:

* ``aten``: ATen operators dispatched, forward and backward (a ``TorchDispatchMode`` sees
  every op below autograd, including the ones the backward engine runs);
* ``py_calls``: Python function calls (``cProfile``'s total, primitive calls included);
* ``host_reads``: tensor-to-Python reads, each a device sync on a GPU: ``float()``/``item()``
  (the aten op ``_local_scalar_dense``) plus ``tolist()`` calls (not an aten op on CPU, so
  counted from the profile).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .libs import plain_torch, toolkit
from .problems import build

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ("torchopt", "higher", "betty")
CASES = [("quadratic", 100, "unrolled"), ("quadratic", 100, "implicit_neumann"),
         ("quadratic", 100, "implicit_cg"), ("logistic", 100, "unrolled"),
         ("logistic", 100, "implicit_neumann"), ("logistic", 1000, "unrolled")]


def flagged_rows(paths: list[Path] | None = None) -> list[dict[str, Any]]:
    """The rows where bilevel (best-of seconds) is > 1.2× plain_torch or above the best peer."""
    out = []
    for path in paths or sorted(RESULTS.glob("hypergrad*.json")):
        groups: dict[tuple, dict[str, float]] = collections.defaultdict(dict)
        for r in json.loads(path.read_text())["records"]:
            if r.get("seconds_min") is not None:
                groups[(r["problem"], r["size"], r["method"], r["steps"])][r["library"]] = r["seconds_min"]
        for key, times in groups.items():
            if "bilevel" not in times or "plain_torch" not in times:
                continue
            peers = {k: v for k, v in times.items() if k in PEERS}
            best = min(peers, key=peers.__getitem__) if peers else None
            floor = times["bilevel"] / times["plain_torch"]
            vs_peer = times["bilevel"] / peers[best] if best else None
            if floor > 1.2 or (vs_peer is not None and vs_peer > 1.0):
                out.append({"file": path.name, "problem": key[0], "size": key[1], "method": key[2],
                            "bilevel_ms": 1e3 * times["bilevel"], "vs_floor": floor,
                            "best_peer": best, "vs_peer": vs_peer})
    return out


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count(run: Any) -> dict[str, Any]:
    """aten ops (total and by name), Python calls and host reads of one ``run()``."""
    run()  # warm-up: lazy imports and first-call caches are not per-call cost
    with _CountOps() as mode:
        run()
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    stats = pstats.Stats(prof)
    table = stats.stats  # type: ignore[attr-defined]
    tolist = sum(v[1] for k, v in table.items() if k[2] == "<method 'tolist' of 'torch._C.TensorBase' objects>")
    return {"aten": sum(mode.ops.values()), "ops": mode.ops,
            "py_calls": stats.total_calls,  # type: ignore[attr-defined]
            "host_reads": mode.ops["_local_scalar_dense"] + tolist}


def compare(problem: str, size: int, method: str, steps: int = 20) -> dict[str, dict[str, Any]]:
    """The counts of ``bilevel`` and ``plain_torch`` on the same float32 instance."""
    p = build(problem, size).cast(torch.float32)
    return {lib.__name__.rsplit(".", 1)[-1]: count(lib.build(p, method, steps, p.inner_lr))
            for lib in (plain_torch, toolkit)}


def _op_diff(a: collections.Counter, b: collections.Counter) -> str:
    diff = {k: b[k] - a[k] for k in set(a) | set(b) if b[k] != a[k]}
    return ", ".join(f"{k} {v:+d}" for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1])))


def main(argv: list[str] | None = None) -> None:
    """Print the flagged rows, and with ``--counts`` the per-call counts of each case."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", action="store_true", help="also count ops and calls")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for r in flagged_rows():
        peer = f"{r['vs_peer']:.2f}× {r['best_peer']}" if r["best_peer"] else "no peer"
        print(f"{r['file']:32} {r['problem']:9} {r['size']:>7} {r['method']:16} "
              f"{r['bilevel_ms']:9.2f} ms  {r['vs_floor']:.2f}× floor  {peer}")
    if not args.counts:
        return
    for case in CASES:
        c = compare(*case)
        fl, bl = c["plain_torch"], c["toolkit"]
        print(f"\n{' '.join(map(str, case))}: aten {fl['aten']} → bilevel {bl['aten']}, "
              f"Python calls {fl['py_calls']} → {bl['py_calls']}, "
              f"host reads {fl['host_reads']} → {bl['host_reads']}")
        print("  bilevel − floor:", _op_diff(fl["ops"], bl["ops"]))


if __name__ == "__main__":
    main()
