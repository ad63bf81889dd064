"""Fixtures of the ModelManager tests: a recording maker and a manager over it."""

from __future__ import annotations

import pytest

from servex.loader import ModelManager
from tests.loader.manager_fakes import Recorder


@pytest.fixture
def rec():
    return Recorder()


@pytest.fixture
def manager(rec):
    m = ModelManager(rec.make, rec.close, max_num_load_retries=2, load_retry_interval_s=0)
    yield m
    m.unload_all()
