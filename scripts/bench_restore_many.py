"""Restoring a model of many variables: load time and first answer, lazy and eager, in process (no gRPC).

    python scripts/bench_restore_many.py [--variables 300,2000] [--runs 3] [--workdir /tmp/servex-bench]

Exports (once) a TF2 SavedModel whose serving_default reads N float32[16] variables, then, in a fresh process per
measurement, times load_saved_model, the restore of every variable (``VariableStore.ensure``: with
``--lazy_restore=false`` that is part of the load) and the first answer through GraphExecutor (which builds the
client graph). Medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

EXPORT = """
import sys
import tensorflow as tf
n = int(sys.argv[2])
module = tf.Module()
module.vs = [tf.Variable(tf.fill([16], float(i)), name=f"v{i}") for i in range(n)]
module.f = tf.function(
    lambda x: {"y": x + tf.add_n([tf.reduce_sum(v) for v in module.vs])}, input_signature=[tf.TensorSpec([None])]
)
tf.saved_model.save(module, sys.argv[1], signatures={"serving_default": module.f})
"""


def child(path: str, lazy: bool) -> dict:
    sys.path.insert(0, str(REPO))
    import numpy as np

    from servex.executor import GraphExecutor
    from servex.loader import load_saved_model

    start = time.perf_counter()
    model = load_saved_model(path, lazy_restore=lazy)
    loaded = time.perf_counter()
    ready = model.variables.ensure(list(model.variables.records))
    if ready is not None:
        ready.result()
    restored = time.perf_counter()
    sig = model.signatures["serving_default"]
    y = GraphExecutor(model).run({sig.inputs["x"].name: np.zeros(1, np.float32)}, [sig.outputs["y"].name])[0]
    answered = time.perf_counter()
    n = len(model.variables.records)
    assert float(y[0]) == 16 * n * (n - 1) / 2, y  # every variable holds its checkpoint value
    return {"load": loaded - start, "restore": restored - loaded, "first answer": answered - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variables", default="300,2000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/servex-bench")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1] == "lazy")))
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    print("| variables | mode | load s | restore s | first answer s (from load) |")
    print("| --- | --- | --- | --- | --- |")
    for n in (int(v) for v in a.variables.split(",")):
        path = Path(a.workdir) / f"many_variables_{n}" / "1"
        if not (path / "saved_model.pb").exists():
            subprocess.run([sys.executable, "-c", EXPORT, str(path), str(n)], check=True, env=env, capture_output=True)
        for mode in ("lazy", "eager"):
            runs = []
            for _ in range(a.runs):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(path), mode],
                    check=True, env=env, capture_output=True, text=True,
                )  # fmt: skip
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"| {n:,} | {mode} | {med['load']:.2f} | {med['restore']:.2f} | {med['first answer']:.2f} |")


if __name__ == "__main__":
    main()
