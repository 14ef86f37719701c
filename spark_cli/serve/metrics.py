"""/metrics: Prometheus text with llama-server's llamacpp:* series (its names, types and help
texts) plus Spark's expert cache."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .stats import ServerStats, Snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# llama-server's series (server-task.cpp, server_task_result_metrics::to_metrics): name, help, value
LLAMACPP_COUNTERS = (
    ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
     lambda s: s.prompt_tokens),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", lambda s: s.prompt_cached),
    ("prompt_seconds_total", "Total time spent processing prompts", lambda s: s.prompt_seconds),
    ("tokens_predicted_total", "Number of generation tokens processed", lambda s: s.predicted_tokens),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens", lambda s: s.predicted_seconds),
    ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal "
     "decoding", lambda s: s.decodes),
    ("n_tokens_max", "Largest observed sequence length (prompt + generation)", lambda s: s.n_tokens_max),
    # NOTE: Spark has no speculative decoding: always 0, as llama-server's without a draft model
    ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", lambda s: 0),
    ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
     lambda s: 0),
    ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", lambda s: 0),
)
LLAMACPP_GAUGES = (
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", lambda s: s.prompt_tokens_seconds),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
     lambda s: s.predicted_tokens_seconds),
    ("requests_processing", "Number of requests processing", lambda s: s.processing),
    ("requests_deferred", "Number of requests deferred", lambda s: s.deferred),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
     lambda s: s.busy_slots_per_decode),
)


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def llamacpp_text(s: Snapshot) -> str:
    """llama-server's llamacpp:* series, written as it writes them (a counter keeps its own name:
    n_tokens_max has no _total, which prometheus_client would add)."""
    out = []
    for kind, items in (("counter", LLAMACPP_COUNTERS), ("gauge", LLAMACPP_GAUGES)):
        for name, doc, value in items:
            out += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {_number(value(s))}"]
    return "\n".join(out) + "\n"


class _Collector:
    """Spark's own series (the expert cache, the plan, the slots)."""

    def __init__(self, stats: ServerStats):
        self.stats = stats
        self.snap: Snapshot | None = None  # the scrape's snapshot (render), else a fresh one

    def collect(self):
        s = self.snap or self.stats.snapshot()
        counters = (
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
            ("spark:slots", "Slots (-np): sequences decoded together.", s.slots),
            ("spark:expert_cache_hit_ratio", "hits / (hits + misses) since start (0 before any step).",
             s.hit_ratio),
            ("spark:device_bytes_planned", "Device bytes the placement plan budgets (0: no plan).",
             s.planned_bytes),
            ("spark:expert_cache_device_bytes", "Device bytes held by the expert banks.", s.device_bytes),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """The /metrics page: llama-server's series, then Spark's."""

    def __init__(self, stats: ServerStats):
        self.stats = stats
        self._spark = _Collector(stats)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._spark)

    def render(self) -> bytes:
        """One scrape: the throughput gauges' window starts again (as llama-server's)."""
        s = self.stats.take_rates()
        self._spark.snap = s
        try:
            return llamacpp_text(s).encode() + generate_latest(self.registry)
        finally:
            self._spark.snap = None
