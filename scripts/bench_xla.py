"""What XLA's compiled program saves against TensorFlow's kernels, by batch size: TensorFlow in process, one fresh
process per model and thread count.

Each child loads one of scripts/suite_models.py's models (exported if missing) with ``N`` intra-op and inter-op
threads, wraps its ``serving_default`` signature in a ``tf.function`` twice, plain and with ``jit_compile=True`` (as
servex's XLA session marks its function calls), and at each batch size of ``--batches`` times both on the same
random rows, in turns: the median of the timed calls after three warm ones, each form's first call (XLA's: its
compile) apart. Prints one line per model, thread count and batch size: ms a call and a row, and what XLA saved.
Used for docs/scheduling.md's XLA section (why a program must save 40% of a lone run to be kept).

    python scripts/bench_xla.py --models gru,transformer --threads 1 --batches 1,8,16,32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_suite import PY, rows  # noqa: E402
from scripts.suite_models import MODELS, export  # noqa: E402


def child(spec: dict) -> None:
    """In a fresh process: one model at one thread count, one JSON line per batch size."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    tf.config.threading.set_inter_op_parallelism_threads(spec["threads"])
    loaded = tf.saved_model.load(spec["path"])  # kept: its variables live as long as it does
    signature = loaded.signatures["serving_default"]
    forms = {
        "tf": tf.function(lambda feed: signature(**feed)),
        "xla": tf.function(lambda feed: signature(**feed), jit_compile=True),
    }
    rng = np.random.default_rng(0)
    for batch in spec["batches"]:
        feed = {i.name: tf.constant(rows(i, batch, rng)) for i in MODELS[spec["model"]].inputs}
        first, times = {}, {name: [] for name in forms}
        for name, fn in forms.items():
            started = time.perf_counter()
            fn(feed)
            first[name] = time.perf_counter() - started
            for _ in range(3):
                fn(feed)
        for _ in range(max(5, 40 // batch)):  # in turns
            for name, fn in forms.items():
                started = time.perf_counter()
                fn(feed)
                times[name].append(time.perf_counter() - started)
        ms = {name: float(np.median(t)) * 1000 for name, t in times.items()}
        print(json.dumps({"batch": batch, "tf_ms": ms["tf"], "xla_ms": ms["xla"], "compile_s": first["xla"]}),
              flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gru,transformer")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--models_dir", default=str(Path(tempfile.gettempdir()) / "suite"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    models = a.models.split(",")
    bases = export(Path(a.models_dir), models)
    batches = [int(b) for b in a.batches.split(",")]
    for model in models:
        for threads in (int(t) for t in a.threads.split(",")):
            spec = {"model": model, "path": str(bases[model] / "1"), "threads": threads, "batches": batches}
            out = subprocess.run([str(PY), __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
            if out.returncode:
                print(f"{model}, {threads} thread(s): failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            for line in out.stdout.splitlines():
                r = json.loads(line)
                b = r["batch"]
                print(f"{model}, {threads} thread(s), batch {b}: TensorFlow's kernels {r['tf_ms']:.1f} ms "
                      f"({r['tf_ms'] / b:.2f} a row), XLA {r['xla_ms']:.1f} ms ({r['xla_ms'] / b:.2f} a row; "
                      f"compiled in {r['compile_s']:.2f} s): XLA saved {1 - r['xla_ms'] / r['tf_ms']:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
