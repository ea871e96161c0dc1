"""transformers' own model tests (../shared/transformers-tests) against patched models: the ONE declared list of the
tests each (family, method) is expected to fail, with the reason. Identity patches (a family's own mechanism) must
pass what the unpatched model passes; other methods may fail only tests whose premise the method removes.

    bash ../shared/transformers-tests/run.sh llama rope          # writes runs/transformers-tests/llama-rope.xml
    python tests/transformers_expected_failures.py runs/transformers-tests/llama-rope.xml

The check (exit 1) reports tests that failed without being declared, and declared failures that now pass (so the
list stays true). `scripts/transformers_tests.sh` runs both for the identity patches (CI: .ci/run).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

IDENTITY_PATCHES = [("llama", "rope"), ("gpt2", "learned"), ("bloom", "alibi")]

NEEDS_HUB = "an integration test that downloads bigscience weights: fails unpatched too (no Hub here)"
BLOOM_BASELINE = {
    "BloomIntegrationTest::test_embeddings": NEEDS_HUB,
    "BloomIntegrationTest::test_hidden_states_transformers": NEEDS_HUB,
    "BloomIntegrationTest::test_logits": NEEDS_HUB,
}

# (family, method) -> {"Class::test": reason}; a (family, method) not listed here is expected to pass everything.
EXPECTED_FAILURES: dict[tuple[str, str], dict[str, str]] = {
    ("llama", "none"): {},
    ("gpt2", "none"): {},
    ("bloom", "none"): dict(BLOOM_BASELINE),
    ("llama", "rope"): {},
    ("gpt2", "learned"): {},
    ("bloom", "alibi"): dict(BLOOM_BASELINE),
}


def failed_tests(junit_xml: Path) -> set[str]:
    """"Class::test" of every failed or erroring test case in a JUnit report."""
    failed = set()
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}")
    return failed


def check(junit_xml: Path) -> list[str]:
    """Problems with one run (its file is named FAMILY-METHOD.xml by run.sh); empty when it is as declared."""
    family, method = junit_xml.stem.split("-", 1)
    expected = EXPECTED_FAILURES.get((family, method), {})
    failed = failed_tests(junit_xml)
    problems = [f"{family} + {method}: {name} failed (not declared in tests/transformers_expected_failures.py)"
                for name in sorted(failed - set(expected))]
    problems += [f"{family} + {method}: {name} passes now; remove it from the declared failures"
                 for name in sorted(set(expected) - failed)]
    return problems


def main(paths: list[str]) -> int:
    problems = [problem for path in paths for problem in check(Path(path))]
    for problem in problems:
        print(problem)
    print(f"{len(paths)} run(s) checked: {'as declared' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
