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

