"""``wsync bench``: what one weight sync costs, per method, against the raw transport on the same bytes.

- :mod:`bench.run`: the driver (:class:`BenchConfig`, :func:`run_bench`): models, server, etcd, watchers,
  one torchrun trainer job per model size.
- :mod:`bench.worker`: the trainer ranks; rank 0 times every method, its gather alone, and every floor.
- :mod:`bench.report`: rows (end to end and transfer only, each against its floor), table, target
  checks, plot.
- :mod:`bench.profile`: where one method's sync time goes (``python -m bench.profile``).
- ``bench/gpu.sh``: the NCCL figures and the ``gpu``-marked tests in one call on a CUDA host.
- The raw broadcast floor uses the reference server's
  ``POST /wsync/bench/recv_raw`` route (:mod:`inference_adapter.bench_routes`).
"""

from bench.run import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
