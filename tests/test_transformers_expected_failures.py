"""The checker of transformers' own model tests against the declared expected failures."""

from transformers_expected_failures import EXPECTED_FAILURES, check

REPORT = """<testsuites><testsuite>
<testcase classname="tests.models.bloom.test_modeling_bloom.BloomIntegrationTest" name="test_logits"><failure/></testcase>
<testcase classname="tests.models.bloom.test_modeling_bloom.BloomModelTest" name="test_save_load"><error/></testcase>
<testcase classname="tests.models.bloom.test_modeling_bloom.BloomModelTest" name="test_training"/>
</testsuite></testsuites>"""


def test_undeclared_failures_and_declared_passes_are_reported(tmp_path):
    report = tmp_path / "bloom-alibi.xml"
    report.write_text(REPORT)
    problems = check(report)
    assert "bloom + alibi: BloomModelTest::test_save_load failed (not declared" in problems[0]
    declared_passing = set(EXPECTED_FAILURES["bloom", "alibi"]) - {"BloomIntegrationTest::test_logits"}
    assert len(problems) == 1 + len(declared_passing)
    assert all("passes now" in problem for problem in problems[1:])
