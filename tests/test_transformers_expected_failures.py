"""The checker of transformers' own model tests against the declared expected failures, and the CI check
(scripts/transformers_tests.sh) failing when a run differs from them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


# --- the whole check as CI runs it: scripts/transformers_tests.sh on a stand-in suite whose run.sh writes a report
REPO = Path(__file__).resolve().parent.parent
BLOOM_TEST = "tests.models.bloom.test_modeling_bloom.{}"


def junit(cases: dict[str, bool]) -> str:
    """A JUnit report with the given "Class::test" cases (True: failed)."""
    rows = []
    for name, failed in cases.items():
        cls, test = name.split("::")
        rows.append(f'<testcase classname="{BLOOM_TEST.format(cls)}" name="{test}">'
                    f'{"<failure/>" if failed else ""}</testcase>')
    return f"<testsuites><testsuite>{''.join(rows)}</testsuite></testsuites>"


def run_check(tmp_path, report: str | None) -> subprocess.CompletedProcess:
    suite = tmp_path / "suite"
    suite.mkdir()
    writes = f"cat > \"$OUT/$1-$2.xml\" <<'XML'\n{report}\nXML\n" if report is not None else "exit 3\n"
    (suite / "run.sh").write_text(f"echo '1 passed'\n{writes}")
    env = {**os.environ, "TRANSFORMERS_TESTS": str(suite), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(REPO / "scripts" / "transformers_tests.sh"), "bloom:alibi"], env=env,
                          capture_output=True, text=True, timeout=120)


AS_DECLARED = {**{name: True for name in EXPECTED_FAILURES["bloom", "alibi"]}, "BloomModelTest::test_training": False}


@pytest.mark.parametrize("change, rc, message", [
    ({}, 0, "as declared"),
    ({"BloomModelTest::test_training": True}, 1, "BloomModelTest::test_training failed (not declared"),
    ({"BloomIntegrationTest::test_logits": False}, 1, "BloomIntegrationTest::test_logits passes now"),
    (None, 1, "no report"),
])
def test_the_ci_check_fails_on_a_new_failure_a_declared_failure_that_passes_or_no_report(tmp_path, change, rc,
                                                                                      message):
    result = run_check(tmp_path, None if change is None else junit({**AS_DECLARED, **change}))
    assert result.returncode == rc, result.stdout + result.stderr
    assert message in result.stdout


def test_every_declared_failure_has_a_reason():
    for (family, method), failures in EXPECTED_FAILURES.items():
        assert family in ("llama", "gpt2", "bloom") and method, (family, method)
        for name, reason in failures.items():
            assert "::" in name and len(reason) > 20, (family, method, name)
