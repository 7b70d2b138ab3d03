"""tests/tiers.py on small suites of its own (pytester, in this process): each test lands in exactly one tier, a
test claiming two fails the collection naming it, and a unit test that starts a process or a server fails."""

from __future__ import annotations

import pytest

from tiers import TIER_FIXTURES, fixture_tier

CONFTEST = '''
import pytest

pytest_plugins = ["tiers"]


@pytest.fixture
def subprocesses():
    """Marks a test that starts processes."""


@pytest.fixture
def vllm_python():
    return "python"
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    return pytester


def test_the_heaviest_tier_of_the_fixtures_wins() -> None:
    assert fixture_tier(["tmp_path"]) is None
    assert fixture_tier(["tmp_path", "prefect_harness"]) == "integration"
    assert fixture_tier(["subprocesses", "vllm_python"]) == "engine"
    assert set(TIER_FIXTURES.values()) == {"integration", "engine"}


def test_each_test_lands_in_its_fixtures_tier_or_unit(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_sample='''
        import pytest

        def test_plain():
            assert True

        def test_spawning(subprocesses):
            assert True

        def test_serving(vllm_python):
            assert vllm_python

        @pytest.mark.integration
        def test_written():
            assert True
    ''')
    selected = {tier: suite.runpytest_inprocess("-m", tier, "-q") for tier in ("unit", "integration", "engine")}
    selected["unit"].assert_outcomes(passed=1, deselected=3)
    selected["integration"].assert_outcomes(passed=2, deselected=2)
    selected["engine"].assert_outcomes(passed=1, deselected=3)


def test_a_test_in_two_tiers_fails_the_collection_naming_it(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_sample='''
        import pytest

        @pytest.mark.integration
        def test_claims_two(vllm_python):
            assert True

        @pytest.mark.unit
        @pytest.mark.engine
        def test_marked_twice():
            assert True
    ''')
    result = suite.runpytest_inprocess("-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = result.stderr.str() + result.stdout.str()
    assert "every test must be in exactly one tier" in output
    assert "test_claims_two: tiers ['engine', 'integration']" in output
    assert "test_marked_twice: tiers ['engine', 'unit']" in output


def test_a_unit_test_that_starts_a_process_or_listens_fails_naming_what_it_did(suite: pytest.Pytester,
                                                                               subprocesses: None) -> None:
    """(Integration itself: the inner suite's allowed test really starts python.)"""
    suite.makepyfile(test_sample='''
        import socket
        import subprocess
        import sys

        def test_runs_python():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_serves():
            with socket.socket() as server:
                server.bind(("127.0.0.1", 0))
                server.listen()

        def test_allowed_to_run(subprocesses):
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    ''')
    result = suite.runpytest_inprocess("-q")
    result.assert_outcomes(passed=1, failed=2)
    output = result.stdout.str()
    assert "test_runs_python is a unit test but starts a process" in output
    assert "test_serves is a unit test but listens on a socket" in output
