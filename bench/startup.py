"""How long `./serve.sh` takes to be ready on a machine that has never timed the engine, with and without the
warm-up that setup.sh runs.

With empty caches (a fresh SPECDRAFT_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR), it times, side by side in one run:
  cold      ./serve.sh from launch to /health 200 (the load times every weight format and compiles its steps)
  warm-up   `python server.py --warm-up` (what setup.sh runs: the same load, then exit)
  after     ./serve.sh from launch to /health 200 once the warm-up has filled the caches
and prints the CPU capability first, as every benchmark does.

  python bench/startup.py [--model-dir model]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # server_helpers: a free loopback port, as the tests use

from server_helpers import free_port


def time_to_ready(model_dir: str, env: dict, timeout_s: float = 900) -> float:
    """Seconds from launching ./serve.sh to its first /health 200; the server is stopped afterwards."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(["bash", str(ROOT / "serve.sh")], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**env, "PORT": str(port), "MODEL_DIR": model_dir})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
            while time.perf_counter() - t0 < timeout_s:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
                try:
                    if c.get("/health").status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise SystemExit(f"not ready after {timeout_s:.0f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / "model"))
    args = ap.parse_args(argv)

    import torch

    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as warm:
        def fresh(root: str) -> dict:
            return {**os.environ, "SPECDRAFT_CACHE_DIR": f"{root}/specdraft", "TORCHINDUCTOR_CACHE_DIR": f"{root}/ind"}

        cold_s = time_to_ready(args.model_dir, fresh(cold))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "server.py"), "--warm-up"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**fresh(warm), "MODEL_DIR": args.model_dir, "HF_HUB_OFFLINE": "1"})
        warm_up_s = time.perf_counter() - t0
        after_s = time_to_ready(args.model_dir, fresh(warm))
    print(f"cold start to ready: {cold_s:.1f} s")
    print(f"warm-up (setup.sh):  {warm_up_s:.1f} s")
    print(f"after the warm-up:   {after_s:.1f} s  ({cold_s / after_s:.1f}x sooner than cold)")


if __name__ == "__main__":
    main()
