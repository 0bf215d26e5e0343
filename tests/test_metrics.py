"""NodeMetrics.streamed: the one rule both nodes record a streamed message by (time to first
token, the gap per token of every later message, tokens streamed), read back from the registry."""

from __future__ import annotations

import pytest

from pdspec.metrics import NodeMetrics


@pytest.mark.parametrize("node", ["prefill", "decode"])
def test_a_stream_records_its_first_token_time_each_tokens_gap_and_its_tokens(node):
    metrics = NodeMetrics(node, 4)

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"node": node}) or 0.0

    metrics.streamed(1, 0.25, first=True)
    metrics.streamed(3, 0.03, first=False)  # a message that caught up three steps: 10 ms per token
    metrics.streamed(0, 0.5, first=False)  # a finish with no tokens: no gap
    assert value("pdspec_time_to_first_token_seconds_count") == 1
    assert value("pdspec_time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value("pdspec_inter_token_latency_seconds_count") == 3
    assert value("pdspec_inter_token_latency_seconds_sum") == pytest.approx(0.03)
    assert value("pdspec_generated_tokens_total") == 4
