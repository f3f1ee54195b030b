"""`make test` runs two pytest-xdist workers with `--dist loadgroup`; conftest.py puts each test file's
tests in one group, so that a file's module and session fixtures are built on one worker only."""

from __future__ import annotations

import re

import pytest

from batch_assets_tests.conftest import REPO_ROOT, xdist_group

TESTS = REPO_ROOT / "batch_assets_tests"
# A test's argument or a `request.getfixturevalue` of the session's `vllm serve`.
USES_VLLM_SERVER = re.compile(r"\bvllm_server: |getfixturevalue\(\"vllm_server\"\)")


def test_a_test_is_in_the_group_of_its_file(request: pytest.FixtureRequest) -> None:
    assert [mark.args for mark in request.node.iter_markers("xdist_group")] == [("test_xdist_groups",)]


def test_the_files_that_share_the_vllm_server_are_one_group_and_the_others_their_own() -> None:
    files = sorted(TESTS.glob("test_*.py"))
    users = [path.name for path in files if USES_VLLM_SERVER.search(path.read_text(encoding="utf-8"))]
    assert users == ["test_batch_api_server.py", "test_openai_engine.py"]
    assert {xdist_group(TESTS / name) for name in users} == {"vllm_server"}
    others = [xdist_group(path) for path in files if path.name not in users]
    assert len(set(others)) == len(others) and "vllm_server" not in others
