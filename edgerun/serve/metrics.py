"""What /metrics reports, in Prometheus' text format (prometheus_client, one registry per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: a first token on a CPU takes from tens of milliseconds to a long prompt's minute
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
# seconds per output token: an H200 step is about 2 ms, a 2-core CPU's 1.5B about 40 ms
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("edgerun_requests_running", "Requests holding a slot", registry=r)
        self.queued = Gauge("edgerun_requests_queued", "Requests waiting for a slot", registry=r)
        self.requests = Counter("edgerun_requests", "Finished requests by finish reason", ["finish"], registry=r)
        self.generated_tokens = Counter("edgerun_generated_tokens", "Completion tokens generated", registry=r)
        self.prompt_tokens = Counter("edgerun_prompt_tokens_evaluated",
                                     "Prompt tokens evaluated (the prompt cache's tokens are not)", registry=r)
        self.ttft = Histogram("edgerun_time_to_first_token_seconds", "From submission to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("edgerun_time_per_output_token_seconds", "Per reply: (end - first token) / (tokens - 1)",
                              buckets=TPOT_BUCKETS, registry=r)
        self.kv_cells_total = Gauge("edgerun_kv_cells", "KV cache cells of the shared context", registry=r)
        self.kv_cells_used = Gauge("edgerun_kv_cells_used",
                                   "KV positions held by every slot, running or cached (a shared prefix counts per slot)",
                                   registry=r)
        self.kv_cells_running = Gauge("edgerun_kv_cells_running", "KV positions held by running requests", registry=r)
        self.prompt_cache_bytes = Gauge("edgerun_prompt_cache_bytes", "KV states kept in RAM for prompts that left their slot",
                                        registry=r)
        self.prompt_cache_restored = Counter("edgerun_prompt_cache_restored_tokens",
                                             "Tokens of KV restored from the prompt cache into a slot", registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
