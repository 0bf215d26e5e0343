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


def test_verified_rows_are_added_up_and_published_by_flush():
    """NodeMetrics.record_step / record_source: a step's verified rows are summed per counter and
    published together by `flush` (the decode engine's, before it hands the step's events to the
    streams); the accept-length histogram takes every row."""
    metrics = NodeMetrics("decode", 2)

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, labels) or 0.0

    rows = [(False, 4, 2, 3, [0, 0]), (False, 2, 0, 1, []), (True, 3, 3, 4, [0, 1, 0])]  # a tree goes past K = 2
    for do_sample, drafts, accepted, emitted, ranks in rows:
        metrics.record_step(do_sample, drafts, accepted, emitted, ranks)
        metrics.record_source("prompt-lookup", drafts, accepted)
    assert value("pdspec_spec_verify_steps_total", do_sample="false") == 0  # not yet published
    assert value("pdspec_spec_accept_length_count", do_sample="false") == 2
    metrics.flush()
    assert value("pdspec_spec_verify_steps_total", do_sample="false") == 2
    assert value("pdspec_spec_verify_steps_total", do_sample="true") == 1
    assert value("pdspec_spec_draft_tokens_total", do_sample="false") == 6
    assert value("pdspec_spec_accepted_tokens_total", do_sample="false") == 2
    assert value("pdspec_spec_emitted_tokens_total", do_sample="true") == 4
    name = "pdspec_spec_accepted_tokens_per_position_total"
    assert [value(name, do_sample="true", position=str(p)) for p in range(3)] == [1, 1, 1]
    assert value("pdspec_spec_accepted_tokens_per_rank_total", do_sample="true", rank="1") == 1
    assert value("pdspec_spec_source_draft_tokens_total", source="prompt-lookup") == 9
    assert value("pdspec_spec_source_accepted_tokens_total", source="prompt-lookup") == 5
    metrics.flush()  # nothing pending: nothing added twice
    assert value("pdspec_spec_draft_tokens_total", do_sample="false") == 6
