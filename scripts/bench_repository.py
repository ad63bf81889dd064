"""The MLP served two ways, in alternating rounds: from a TensorFlow Serving base path with --enable_batching, and
from a Triton model repository (config.pbtxt: max_batch_size 32, dynamic_batching), both batching up to 32 rows.

    python scripts/bench_repository.py [--rounds 3] [--seconds 8] [--workdir /tmp/servex-bench-repository]

Each round starts each daemon in turn and drives batch-1 KServe v2 ModelInfer with the kit's h2load driver
(h2grpc.py, at 1 and 32 callers); prints one JSON line per daemon and round.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO.parent / "shared" / "bench"
sys.path.insert(0, str(KIT))

from h2grpc import run as h2load_run  # noqa: E402  (the kit's driver)
from loadgen import build  # noqa: E402

PORT = 18500


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/servex-bench-repository")
    a = ap.parse_args()
    work = Path(a.workdir)
    if not (work / "mlp" / "1").is_dir():
        subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True)
    repository = work / "repository"
    if not repository.is_dir():
        shutil.copytree(work / "mlp" / "1", repository / "mlp" / "1" / "model.savedmodel")
        (repository / "mlp" / "config.pbtxt").write_text("max_batch_size: 32\ndynamic_batching {}\n")
    commands = {
        "base_path": [
            f"--model_base_path={work / 'mlp'}",
            "--model_name=mlp",
            "--enable_batching",
            f"--port={PORT}",
            "--rest_api_port=0",
            "--metrics_port=0",
        ],  # fmt: skip
        "repository": [
            f"--model-repository={repository}",
            f"--grpc-port={PORT}",
            "--allow-http=false",
            "--allow-metrics=false",
        ],  # fmt: skip
    }
    payload = work / "payload.bin"
    message = build("mlp", "features", [1, 64], "FP32")
    payload.write_bytes(b"\0" + len(message).to_bytes(4, "big") + message)
    for round_ in range(1, a.rounds + 1):
        for name, args in commands.items():
            log = open(work / f"{name}.log", "w")
            proc = subprocess.Popen([sys.executable, "-m", "servex.server", *args], cwd=REPO, stdout=log, stderr=log)
            deadline = time.monotonic() + 180
            while "servex ready" not in (work / f"{name}.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.5)
            results = [h2load_run(PORT, str(payload), c, a.seconds, "/inference.GRPCInferenceService/ModelInfer")
                       for c in (1, 32)]  # fmt: skip
            print(json.dumps({"round": round_, "served_from": name, "levels": results}), flush=True)
            proc.terminate()
            proc.wait(60)
            log.close()


if __name__ == "__main__":
    main()
