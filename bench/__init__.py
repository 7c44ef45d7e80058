"""``wsync bench``: what one weight sync costs, per method, against the raw transport on the same bytes.

- :mod:`bench.run`: the driver (:class:`BenchConfig`, :func:`run_bench`): models, server, etcd, watchers,
  one torchrun trainer job per model size.
- :mod:`bench.worker`: the trainer ranks; rank 0 times every method and floor.
- :mod:`bench.report`: rows, table, target checks, plot.
- The raw broadcast floor uses the reference server's
  ``POST /wsync/bench/recv_raw`` route (:mod:`inference_adapter.bench_routes`).
"""

from bench.run import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
