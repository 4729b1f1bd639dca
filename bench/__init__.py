"""Benchmarks: the bilevel toolkit against its peers and a plain-PyTorch floor (issue 5).

Run from the repository root, e.g. ``python -m bench.hypergrad --quick``. Results go to
``bench/results/`` (JSON records + a markdown table); docs/performance.md reports them.
Peers (torchopt, higher, betty) are imported lazily by the bench scripts only.
"""
