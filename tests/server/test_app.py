"""server/app.py: per-model batching parameters read from the version folder as a version loads, and the start-up
heap freeze."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest

from servex.executor.batching import BatchingOptions
from servex.loader.config import ModelSpec
from servex.loader.manager import END
from servex.server.app import make_manager, settle_heap
from servex.server.config.batching import PER_MODEL_BATCHING_FILE
from servex.server.config.settings import ServerSettings
from tests.conftest import HALF_PLUS_TWO_TF1


@pytest.fixture
def base(tmp_path):
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", tmp_path / "m" / "1")
    return tmp_path / "m"


def _load(base, **settings):
    manager = make_manager(ServerSettings(**settings))
    problems = manager.apply_config([ModelSpec("m", str(base))])
    return manager, problems


def test_a_version_s_batching_params_file_is_its_batching(base):
    (base / "1" / PER_MODEL_BATCHING_FILE).write_text("max_batch_size { value: 4 }\nallowed_batch_sizes: [2, 4]\n")
    manager, problems = _load(base, enable_batching=True, enable_per_model_batching_params=True)
    try:
        assert problems == []
        assert manager.get("m").servable.batching == BatchingOptions(max_batch_size=4, allowed_batch_sizes=(2, 4))
    finally:
        manager.unload_all()


@pytest.mark.parametrize("flags", [{"enable_batching": True}, {"enable_per_model_batching_params": True}])
def test_the_file_is_read_only_with_both_flags(base, flags):
    (base / "1" / PER_MODEL_BATCHING_FILE).write_text("max_batch_size { value: 4 }\n")
    manager, problems = _load(base, **flags)
    try:
        assert problems == [] and manager.get("m").servable.batching is None
    finally:
        manager.unload_all()


def test_a_bad_batching_params_file_fails_the_load_naming_it(base):
    (base / "1" / PER_MODEL_BATCHING_FILE).write_text("max_batch_size { value: 4 }\nallowed_batch_sizes: [2, 3]\n")
    manager, problems = _load(base, enable_batching=True, enable_per_model_batching_params=True)
    try:
        assert len(problems) == 1
        assert PER_MODEL_BATCHING_FILE in problems[0] and "must increase and end with max_batch_size 4" in problems[0]
        assert [sv.state for sv in manager.statuses("m")] == [END]
    finally:
        manager.unload_all()


class _Node:
    pass


def test_settle_heap_collects_start_up_garbage_then_freezes_what_survives():
    survivor = _Node()
    survivor.me = survivor  # a cycle, as TensorFlow's graphs are full of
    garbage = _Node()
    garbage.me = garbage
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = settle_heap()
        assert gone() is None  # collected before the freeze, not kept forever
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is survivor for o in gc.get_objects())  # out of every generation the collector scans
    finally:
        gc.unfreeze()
    assert any(o is survivor for o in gc.get_objects())


# -- Lifecycle: config changes -----------------------------------------------------------------------------


class _Health:
    async def set(self, name, status) -> None:
        pass


def _label_config(root, version: int) -> str:
    return (
        f'model_config_list {{ config {{ name: "a" base_path: "{root}/a" model_platform: "tensorflow" '
        f'model_version_policy {{ all {{}} }} version_labels {{ key: "stable" value: {version} }} }} }}'
    )


def test_a_refused_config_file_is_tried_again_at_each_poll(tmp_path):
    """A label moved to a version that is not served yet is refused; the file is read again at the next poll, as
    TensorFlow Serving re-applies it, and takes once the version serves (it was never tried again)."""
    import asyncio

    from servex.loader import ModelManager
    from servex.loader.config import parse_model_config
    from servex.server.lifecycle import Lifecycle

    (tmp_path / "a" / "1").mkdir(parents=True)
    config = tmp_path / "models.config"
    config.write_text(_label_config(tmp_path, 1))
    manager = ModelManager(lambda name, version, path: object())
    settings = ServerSettings(model_config_file=str(config), model_config_file_poll_wait_seconds=0.05)
    lifecycle = Lifecycle(manager, _Health(), settings)

    async def scenario():
        await lifecycle.apply(parse_model_config(config.read_text(), "config"))
        poller = asyncio.ensure_future(lifecycle.poll_config(config.read_text()))
        (tmp_path / "a" / "2").mkdir()
        config.write_text(_label_config(tmp_path, 2))  # the new version folder and the label move, together
        await asyncio.sleep(0.3)  # polled: version 2 is not served yet, refused
        refused = manager.spec("a").labels
        await asyncio.get_running_loop().run_in_executor(None, manager.poll)  # version 2 loads
        await asyncio.sleep(0.3)
        poller.cancel()
        return refused, manager.spec("a").labels, [s.labels for s in lifecycle.specs]

    refused, after, specs = asyncio.run(scenario())
    assert refused == {"stable": 1} and after == {"stable": 2} and specs == [{"stable": 2}]


def test_overlapping_config_changes_leave_the_specs_served(tmp_path):
    """One change at a time: a refused change restoring its previous specs cannot undo one that took meanwhile."""
    import asyncio
    import time

    from servex.loader import ModelManager
    from servex.loader.config import ModelSpec, VersionPolicy
    from servex.loader.errors import FailedPrecondition
    from servex.server.lifecycle import Lifecycle

    for folder in ("a/1", "a/2", "b/1"):
        (tmp_path / folder).mkdir(parents=True)

    def slow_load(name, version, path):
        time.sleep(0.2)
        return object()

    manager = ModelManager(slow_load)
    lifecycle = Lifecycle(manager, _Health(), ServerSettings())
    first = [ModelSpec("a", str(tmp_path / "a"), VersionPolicy("specific", versions=frozenset({1})), {"stable": 1})]
    moved = [ModelSpec("a", str(tmp_path / "a"), VersionPolicy("all"), {"stable": 2})]  # 2 not served: refused
    added = [*first, ModelSpec("b", str(tmp_path / "b"))]

    async def scenario():
        await lifecycle.apply(first)
        return await asyncio.gather(lifecycle.apply(moved), lifecycle.apply(added), return_exceptions=True)

    refused, took = asyncio.run(scenario())
    assert isinstance(refused, FailedPrecondition) and took == []
    assert manager.model_names() == ["a", "b"] and [s.name for s in lifecycle.specs] == ["a", "b"]
