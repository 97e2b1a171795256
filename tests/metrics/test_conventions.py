"""afore.metrics.conventions: the checker flags each broken rule (and passes a clean family)."""

from afore.metrics.conventions import check_exposition


def problems(text: str) -> list[str]:
    return check_exposition(text.strip() + "\n")


def test_clean_families_pass_and_others_are_not_judged():
    assert problems("""
# TYPE afore_ffn_copy_seconds histogram
afore_ffn_copy_seconds_bucket{worker="0",le="+Inf"} 1
afore_ffn_copy_seconds_sum{worker="0"} 0.1
afore_ffn_copy_seconds_count{worker="0"} 1
# TYPE afore_scheduler_plans_total counter
afore_scheduler_plans_total{policy="afore"} 3
# TYPE vllm:foo_ms gauge
vllm:foo_ms{anything="x"} 1
""") == []


def test_each_rule_is_checked():
    got = problems("""
# TYPE afore_ffn_stage_ms histogram
afore_ffn_stage_ms_bucket{le="+Inf"} 1
afore_ffn_stage_ms_sum 1
afore_ffn_stage_ms_count 1
# TYPE afore_x_bytes_in_flight gauge
afore_x_bytes_in_flight 1
# TYPE afore_y_total gauge
afore_y_total 1
# TYPE afore_z gauge
afore_z{target="12345"} 1
afore_z{layer="first"} 1
afore_z{policy="mine"} 1
""")
    text = "\n".join(got)
    assert "afore_ffn_stage_ms (histogram): abbreviated unit" in text
    assert "afore_x_bytes_in_flight (gauge): the unit bytes" in text
    assert "afore_y_total (gauge): only counters end in _total" in text
    assert "label 'target' outside" in text
    assert "label 'layer' expects small integers" in text
    assert "label 'policy' expects a placement policy" in text
