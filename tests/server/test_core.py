"""ServingCore's leases: a version stays loaded until the work that uses it is over, even when the caller that
started the work is cancelled first."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

import pytest

from servex.loader import ModelManager
from servex.loader.config import ModelSpec
from servex.server.core import Lease


@dataclass(eq=False)
class Servable:
    version: int


@pytest.fixture
def manager(tmp_path):
    closed = []
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "saved_model.pb").write_bytes(b"x")
    manager = ModelManager(lambda name, version, path: Servable(version), closed.append)
    manager.apply_config([ModelSpec("m", str(tmp_path / "m"))])
    manager.closed = closed
    yield manager
    manager.unload_all()


def _retire_all(manager: ModelManager) -> None:
    manager.apply_config([])  # the model leaves the config: it closes once its leases end


def test_a_lease_ended_by_its_caller_lets_the_version_close(manager):
    lease = Lease(manager, manager.acquire("m"))
    _retire_all(manager)
    assert manager.closed == []
    lease.end()
    lease.end()  # ending twice releases once
    assert [s.version for s in manager.closed] == [1]


def test_a_handed_off_lease_ends_when_the_work_calls_back(manager):
    lease = Lease(manager, manager.acquire("m"))
    done = lease.hand_off()
    lease.end()  # the caller's finally: no longer its lease to end
    _retire_all(manager)
    assert manager.closed == []
    done()
    assert [s.version for s in manager.closed] == [1]
    with pytest.raises(RuntimeError):
        lease.hand_off()


def test_a_cancelled_wait_ends_the_lease_only_when_the_work_ends(manager):
    work: concurrent.futures.Future = concurrent.futures.Future()
    work.set_running_or_notify_cancel()  # running on some thread: it cannot be cancelled any more

    async def main():
        lease = Lease(manager, manager.acquire("m"))

        async def request():
            try:
                await lease.wait(work)
            finally:
                lease.end()

        task = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not work.cancelled()  # the caller's cancellation did not reach the shared work
    _retire_all(manager)
    assert manager.closed == []  # the restore still runs: the version must stay
    work.set_result(None)
    assert [s.version for s in manager.closed] == [1]
