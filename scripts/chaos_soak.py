"""Chaos soak: servex's soak traffic (scripts/soak.py's call mix, over every API) while faults strike at random.

    python scripts/chaos_soak.py --minutes 30 [--seed 1] [--processes 2] [--fault_every 8] [--callers 6]
                                 [--flood_calls 12] [--flood_mb 32] [--faults kill,storage,...]
                                 [--servex_flag=--max_memory_bytes=...]

Starts servex as a group of ``--processes`` serving processes (--serving_processes) on the kit's MLP, TensorFlow
Serving's half_plus_two and ``tables`` (a model of 24 variables, each read by its own signature, so lazily), and
``--callers`` threads send the soak's mix plus calls of ``tables``. Every ``--fault_every`` seconds on average
(exponentially distributed) one fault strikes, the kinds dealt from a shuffled deck so that each comes as often:

- ``kill``: a serving process killed with SIGKILL; the supervisor starts another (the next kill or storage fault
  waits until every process serves again);
- ``storage``: a new version of ``tables`` published, then its checkpoint's data file removed, truncated, made
  unreadable (EACCES) or failing (EIO) for 3-8 s, then put back (tests/support/faults.c, preloaded into servex);
- ``trickle``: 5-30 REST clients sending their bodies a byte every 0.25 s (servex answers them 408);
- ``slow_grpc``: 2-8 connections that grant a window of 8 bytes, start three Predict calls and never read;
- ``flood``: ``--flood_calls`` calls of ``--flood_mb`` MB each at once (Predict and ModelInfer of half_plus_two).

Every answer is classified (scripts/chaos_outcomes.py): as expected; as an error a fault explains, by its kind
(UNAVAILABLE by a kill, INTERNAL naming the variable by a storage fault, RESOURCE_EXHAUSTED by a flood, 408 by a
trickle); or unexpected. The RSS, threads and descriptors of the supervisor and its serving processes are
sampled every ``--sample_s`` seconds (JSON lines). At the end a JSON summary; the exit code is 1 when anything
unexpected happened, servex died, or the group did not serve whole again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from chaos_clients import flood, slow_grpc, trickle
from chaos_faults import SIGNATURES, Group, Storage, kill, tables_call
from chaos_outcomes import Tally
from soak_sampling import process_sample
from soak_traffic import KIT, Traffic, call_loop

from tests.conftest import HALF_PLUS_TWO_TF1
from tests.support.daemon import Daemon, model_config_file

KINDS = ("kill", "storage", "trickle", "slow_grpc", "flood")
DISRUPTIVE = ("kill", "storage")  # one at a time, and only while every serving process serves


class ChaosTraffic(Traffic):
    """The soak's mix, and calls of ``tables``: ``tables_read`` (a signature whose variable may be unread when its
    checkpoint fails) and ``tables_default`` (v_0, read before any fault: it must always serve)."""

    def tables_read(self):
        return tables_call(self.tfs, self.rng.randrange(1, SIGNATURES))

    def tables_default(self):
        return tables_call(self.tfs, 0)

    def calls(self):
        return [*super().calls(), (self.tables_read, 3), (self.tables_default, 1)]


def sample(daemon: Daemon, group: Group, start: float, calls: int) -> dict:
    """The supervisor's and each serving process's RSS (MB), and the group's threads and descriptors."""
    supervisor = process_sample(daemon.proc.pid)
    workers = []
    for pid in group.workers():
        try:
            workers.append(process_sample(pid))
        except (OSError, KeyError):  # gone between the listing and the read, or killed and not yet reaped
            pass
    every = [supervisor, *workers]
    return {
        "t": round(time.monotonic() - start, 1),
        "calls": calls,
        "rss_mb": round(sum(s["rss_mb"] for s in every), 1),
        "supervisor_mb": supervisor["rss_mb"],
        "workers_mb": [s["rss_mb"] for s in workers],
        "threads": sum(s["threads"] for s in every),
        "fds": sum(s["fds"] for s in every),
    }


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.machine())  # fmt: skip
    memory = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return f"{os.cpu_count()} CPUs ({model}), {memory / 2**20:.0f} GiB, Python {platform.python_version()}"


def thin(samples: list[dict], most: int = 40) -> list[dict]:
    step = max(1, -(-len(samples) // most))
    kept = samples[::step]
    return kept if kept[-1] is samples[-1] else [*kept, samples[-1]]


def over_time(s: dict) -> str:
    workers = " + ".join(f"{w:.0f}" for w in s["workers_mb"])
    return f"{s['t']:.0f} s: {s['rss_mb']:.0f} MB (supervisor {s['supervisor_mb']:.0f}, serving {workers})"


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--processes", type=int, default=2, help="--serving_processes")
    ap.add_argument("--callers", type=int, default=6)
    ap.add_argument("--fault_every", type=float, default=8, help="mean seconds between faults")
    ap.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated kinds of fault, of {', '.join(KINDS)}")
    ap.add_argument("--flood_calls", type=int, default=12)
    ap.add_argument("--flood_mb", type=int, default=32)
    ap.add_argument("--body_timeout_ms", type=int, default=2000, help="--rest_api_body_timeout_in_ms")
    ap.add_argument("--reload_every", type=float, default=20, help="seconds between model config changes; 0: none")
    ap.add_argument("--sample_s", type=float, default=10)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-chaos"))
    ap.add_argument("--servex_flag", action="append", default=[], help="extra servex flag, repeatable")
    a = ap.parse_args()
    a.faults = [k for k in a.faults.split(",") if k]
    if not a.faults or any(k not in KINDS for k in a.faults):
        ap.error(f"--faults: of {', '.join(KINDS)}")
    return a


def start(a, work: Path, storage: Storage) -> tuple[Daemon, Group, Path, dict]:
    subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True, capture_output=True)
    models = {"mlp": work / "mlp", "hp2": Path(HALF_PLUS_TWO_TF1), "tables": storage.base}
    config = model_config_file(work, models)
    flags = [f"--model_config_file={config}", "--model_config_file_poll_wait_seconds=2",
             f"--serving_processes={a.processes}", f"--rest_api_body_timeout_in_ms={a.body_timeout_ms}",
             "--prefetch_variables=tables=v_0", *a.servex_flag]  # fmt: skip
    preload = storage.environment()
    os.environ.update(preload)  # servex's processes preload the shim; this one does not
    try:
        daemon = Daemon(flags, work, rest=True).wait_serving(300)
    finally:
        for key in preload:
            os.environ.pop(key, None)
    group = Group(daemon, a.processes)
    if not group.wait_serving(timeout=300):
        daemon.stop()
        raise SystemExit(f"servex's {a.processes} processes did not all serve within 300 s:\n{daemon.log()[-3000:]}")
    return daemon, group, config, models


def main() -> None:
    a = arguments()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    storage = Storage(work)
    daemon, group, config, models = start(a, work, storage)
    try:
        summary = soak(a, work, storage, daemon, group, config, models)
    finally:
        code = daemon.stop()
    print(json.dumps({"servex_exit_code": code}), flush=True)
    if summary["unexpected"] or summary["servex_died"]:
        sys.exit(1)


def soak(a, work: Path, storage: Storage, daemon: Daemon, group: Group, config: Path, models: dict) -> dict:
    """The run itself: callers, faults and samples for ``--minutes``; its summary, printed."""
    tally, stop, disruptive = Tally(), threading.Event(), threading.Lock()
    rng = random.Random(a.seed)
    threads, faults = [], []

    def reloader() -> None:  # HandleReloadConfigRequest reaches one process of a group: the file reaches them all
        with_copy = False
        while not stop.wait(a.reload_every):
            with_copy = not with_copy
            (work / "next").mkdir(exist_ok=True)
            wanted = dict(models, **({"hp2_copy": Path(HALF_PLUS_TWO_TF1)} if with_copy else {}))
            os.replace(model_config_file(work / "next", wanted), config)
            tally.note("model config changes")

    def strike(kind: str, r: random.Random) -> None:
        try:
            if kind == "kill" and group.wait_serving(stop):
                kill(group, tally, r, stop)
            elif kind == "storage" and group.wait_serving(stop):
                storage.episode(group, tally, r, stop)
            elif kind == "trickle":
                trickle(daemon.rest_port, tally, r, stop)
            elif kind == "slow_grpc":
                slow_grpc(daemon.port, tally, r, stop)
            elif kind == "flood":
                flood(daemon.address, tally, r, a.flood_calls, a.flood_mb)
        except Exception as e:  # noqa: BLE001  (a fault that could not be made is reported, not fatal)
            tally.fail(f"{kind} fault: {type(e).__name__}: {e}")
        finally:
            if kind in DISRUPTIVE:
                disruptive.release()

    def scheduler() -> None:
        deck: list[str] = []
        while not stop.wait(min(rng.expovariate(1 / a.fault_every), 4 * a.fault_every)):
            if not deck:
                deck = list(a.faults)
                rng.shuffle(deck)
            kind = deck.pop()
            if kind in DISRUPTIVE and not disruptive.acquire(blocking=False):
                deck.insert(0, kind)  # one is under way: later
                continue
            fault = threading.Thread(target=strike, args=(kind, random.Random(rng.random())), daemon=True)
            faults.append(fault)
            fault.start()

    for i in range(a.callers):
        traffic = ChaosTraffic(daemon, a.seed * 1000 + i)
        threads.append(threading.Thread(target=call_loop, args=(traffic, traffic.calls(), stop, tally.record)))
    if a.reload_every > 0:
        threads.append(threading.Thread(target=reloader))
    threads.append(threading.Thread(target=scheduler))
    began = time.monotonic()
    samples = [sample(daemon, group, began, 0)]
    print(json.dumps(samples[0]), flush=True)
    for t in threads:
        t.daemon = True
        t.start()
    end = began + a.minutes * 60
    died = None
    try:
        while time.monotonic() < end:
            time.sleep(min(a.sample_s, max(0.0, end - time.monotonic())))
            if daemon.proc.poll() is not None:
                died = daemon.proc.returncode
                tally.fail(f"servex exited with {died}")
                break
            samples.append(sample(daemon, group, began, tally.calls))
            print(json.dumps(samples[-1]), flush=True)
    finally:
        stop.set()
        for t in threads + faults:
            t.join(timeout=200)
    elapsed = time.monotonic() - began
    whole = died is None and group.wait_serving(timeout=300)
    if died is None and not whole:
        tally.fail(f"the group did not serve with {a.processes} processes again within 300 s of the end")
    restarts = group.metric("servex_serving_process_restarts_total") if died is None else None
    summary = {
        "minutes": round(elapsed / 60, 2),
        "seed": a.seed,
        "machine": machine(),
        **tally.summary(),
        "calls_per_s": round(tally.calls / elapsed),
        "serving_process_restarts": restarts,
        "servex_died": died is not None,
        "rss_mb": {  # the supervisor and its serving processes together (a killed one's replacement starts anew)
            "start": samples[0]["rss_mb"],
            "end": samples[-1]["rss_mb"],
            "max": max(s["rss_mb"] for s in samples),
            "supervisor": {"start": samples[0]["supervisor_mb"], "end": samples[-1]["supervisor_mb"]},
            "over_time": [over_time(s) for s in thin(samples)],
        },
        "fds": {"start": samples[0]["fds"], "end": samples[-1]["fds"]},
        "threads": {"start": samples[0]["threads"], "end": samples[-1]["threads"]},
        "log_tracebacks": daemon.log().count("Traceback"),
        "servex_flags": a.servex_flag,
    }
    print(json.dumps({"summary": summary}, indent=1), flush=True)
    return summary


if __name__ == "__main__":
    main()
