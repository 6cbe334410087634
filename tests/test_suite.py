"""The test suite's own machinery: `make test` keeps each group of tests on one worker."""

from __future__ import annotations


def test_the_workers_keep_each_group_together(request):
    """`make test` spreads the suite by group (pytest-xdist's --dist loadgroup; tests/conftest.py
    says which tests share a group). pytest-xdist marks a test's group in its node id; a pytest
    that ignores that (9.x, with pytest-xdist 3.8) splits every group over the workers, and the
    engines and trainers that a group's tests share start once per worker instead (minutes)."""
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@test_suite"), request.node.nodeid
