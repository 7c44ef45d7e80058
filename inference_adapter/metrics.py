"""The reference server's ``/metrics`` (started with SGLang's ``--enable-metrics``): Prometheus' text format,
read from the served state at each scrape.

SGLang's names (and its ``model_name``/``engine_type`` labels) for what both servers count: running and queued
requests, requests ended and aborted, prompt and generated tokens. The project's own for what SGLang does not
export: the served weight version (NaN when the label is not a number), whether generation is paused, and whether
the weights are torn (tensors loaded in place since the last label: a failed bucket-by-bucket sync). The bridge's
own metrics (publisher, watcher) are :mod:`bridge.metrics`.
"""

from __future__ import annotations

import math

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "server_metrics"]


class _ServerCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        s = self.state
        names, values = ["model_name", "engine_type"], [s.served_model_name, "unified"]
        counts = s.request_counts()

        def family(kind, name: str, doc: str, value: float):
            metric = kind(name, doc, labels=names)
            metric.add_metric(values, value)
            return metric

        yield family(GaugeMetricFamily, "sglang:num_running_reqs", "The number of running requests.", counts["running"])
        yield family(GaugeMetricFamily, "sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                     counts["waiting"])
        yield family(CounterMetricFamily, "sglang:num_requests", "The number of processed requests.", counts["requests"])
        yield family(CounterMetricFamily, "sglang:num_aborted_requests", "Number of requests aborted.",
                     counts["aborted"])
        yield family(CounterMetricFamily, "sglang:prompt_tokens", "Number of prefill tokens processed.",
                     counts["prompt_tokens"])
        yield family(CounterMetricFamily, "sglang:generation_tokens", "Number of generation tokens processed.",
                     counts["generation_tokens"])
        yield family(GaugeMetricFamily, "wsync_server_weight_version",
                     "The weight version served, when its label is a number (NaN otherwise)", _number(s.version))
        yield family(GaugeMetricFamily, "wsync_server_paused", "1 while generation is paused", float(s.paused))
        yield family(GaugeMetricFamily, "wsync_server_torn", "1 while tensors loaded in place since the last label "
                                                             "are served (a failed bucket-by-bucket sync)",
                     float(s.updates.torn is not None))


def _number(label: str) -> float:
    try:
        value = float(label)
    except (TypeError, ValueError):
        return math.nan
    return value if math.isfinite(value) else math.nan


def server_metrics(state) -> bytes:
    """One scrape of ``state`` (a :class:`~inference_adapter.model_state.ModelState`), in Prometheus' text
    format (:data:`CONTENT_TYPE_LATEST`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ServerCollector(state))
    return generate_latest(registry)
