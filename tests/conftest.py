"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def dist():
    """A one-process torch.distributed world (gloo) for a module's tests, torn down after them."""
    from streamrft.runtime.distributed import destroy_distributed, init_distributed

    info = init_distributed(timeout_s=60)
    yield info
    destroy_distributed()


def pytest_collection_modifyitems(config, items):
    """Files with slow tests run first. `make test` runs two xdist workers, a file each (--dist loadfile):
    starting the long files first lets the many short ones fill the end, instead of one worker finishing
    a long file alone while the other idles. The sort is stable and by file, so a file's tests stay
    together and in their order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
