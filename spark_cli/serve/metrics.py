"""/metrics: Prometheus text with llama-server's metric names plus Spark's expert cache."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .stats import ServerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Collector:
    def __init__(self, stats: ServerStats):
        self.stats = stats

    def collect(self):
        s = self.stats.snapshot()
        counters = (
            ("llamacpp:prompt_tokens", "Number of prompt tokens processed.", s.prompt_tokens),
            ("llamacpp:prompt_seconds", "Prompt process time.", s.prompt_seconds),
            ("llamacpp:tokens_predicted", "Number of generation tokens processed.", s.predicted_tokens),
            ("llamacpp:tokens_predicted_seconds", "Predict process time.", s.predicted_seconds),
            ("llamacpp:n_decode_total", "Total number of llama_decode() calls.", s.decodes),
            ("spark:requests", "Generations served (finished, stopped or cancelled).", s.requests),
            ("spark:requests_rejected", "Requests refused because the queue was full.", s.rejected),
            ("spark:expert_cache_hits", "Routed experts found on the device (distinct per step).", s.cache.hits),
            ("spark:expert_cache_misses", "Routed experts not on the device (distinct per step).", s.cache.misses),
            ("spark:expert_cache_uploads", "Expert uploads host to device, pinned ones at start included.",
             s.cache.uploads),
            ("spark:expert_cache_uploaded_bytes", "Bytes of expert uploads host to device.", s.cache.bytes_uploaded),
            ("spark:expert_cache_cpu_experts", "Missed experts computed on the CPU (distinct per step).",
             s.cache.cpu_experts),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        gauges = (
            ("llamacpp:requests_processing", "Number of requests processing.", s.processing),
            ("llamacpp:requests_deferred", "Number of requests deferred.", s.deferred),
            ("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call.",
             s.busy_slots_per_decode),
            ("spark:slots", "Slots (-np): sequences decoded together.", s.slots),
            ("spark:expert_cache_hit_ratio", "hits / (hits + misses) since start (0 before any step).",
             s.hit_ratio),
            ("spark:device_bytes_planned", "Device bytes the placement plan budgets (0: no plan).",
             s.planned_bytes),
            ("spark:expert_cache_device_bytes", "Device bytes held by the expert banks.", s.device_bytes),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)


def registry_for(stats: ServerStats) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(stats))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
