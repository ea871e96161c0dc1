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

# A method that replaces LLaMA's RoPE removes what these tests are about.
NO_ROPE = "the method replaces RoPE: the rope_parameters these tests scale no longer change the model"
REPLACES_LLAMA_ROPE = {
    **{f"LlamaModelTest::test_model_rope_scaling_from_config_{case}": NO_ROPE
       for case in ("0_linear", "1_dynamic", "2_yarn")},
    "LlamaModelTest::test_init_weights_can_init_buffers": (
        "the method removes the rotary embedding and its buffers (rotary_emb.inv_freq); the test compares a model "
        "built by __init__ (patched by the plugin) with one built on the meta device (which the plugin cannot patch)"),
}
# A method with weights of its own (T5's bucket table, FIRE's MLP, KERPLE's ...), outside transformers' architecture.
OWN_WEIGHTS = {
    "LlamaModelTest::test_from_pretrained_no_checkpoint": (
        "the patch's own weights (posenc.*) are not part of the architecture transformers builds from "
        "from_pretrained(None, state_dict=...): it reports them unexpected and the plugin applies a fresh, "
        "randomly initialised patch (a saved folder restores them: hf_posenc.from_pretrained, test_checkpoint.py)"),
    "LlamaModelTest::test_model_weights_reload_no_missing_tied_weights": (
        "the plugin re-applies the saved patch after transformers computed its loading info, which cannot list "
        "weights outside its architecture; hf_posenc.from_pretrained reports the missing posenc.* weights "
        "(test_checkpoint.py::test_missing_positional_weights_are_initialised_and_reported_as_transformers_does)"),
}

# A method other than `learned` on GPT-2 removes its position table wpe (checkpoints keep wpe.weight, for unpatching).
REPLACES_GPT2_WPE = {
    "GPT2ModelTest::test_model_weights_reload_no_missing_tied_weights": (
        "the method removes GPT-2's wpe: transformers' loading info (computed before the plugin re-applies the saved "
        "patch) lists wpe.weight missing, a weight the patched model no longer has"),
}

# (family, method) -> {"Class::test": reason}; a (family, method) not listed here is expected to pass everything.
EXPECTED_FAILURES: dict[tuple[str, str], dict[str, str]] = {
    ("llama", "none"): {},
    ("gpt2", "none"): {},
    ("bloom", "none"): dict(BLOOM_BASELINE),
    # identity patches: what the unpatched model passes
    ("llama", "rope"): {},
    ("gpt2", "learned"): {},
    ("bloom", "alibi"): dict(BLOOM_BASELINE),
    # other methods (scripts/transformers_tests.sh --all)
    ("llama", "alibi"): dict(REPLACES_LLAMA_ROPE),
    ("llama", "t5"): {**REPLACES_LLAMA_ROPE, **OWN_WEIGHTS},
    ("gpt2", "alibi"): dict(REPLACES_GPT2_WPE),
    ("gpt2", "rope"): dict(REPLACES_GPT2_WPE),
    ("bloom", "rope"): dict(BLOOM_BASELINE),
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
    if not junit_xml.is_file():
        return [f"{family} + {method}: no report {junit_xml} (the run stopped before writing it: see its log)"]
    if not any(True for _ in ElementTree.parse(junit_xml).getroot().iter("testcase")):
        return [f"{family} + {method}: {junit_xml} holds no test (the run collected nothing: see its log)"]
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
