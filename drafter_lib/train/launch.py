"""Training over several processes: `accelerate launch` of `python -m drafter_lib.train` with the same TrainConfig
the in-process path runs, from the study's train stage (`drafter_lib.study.stages.train_drafter`).

    train(cfg)  num_processes == 1: `trainer.run_training(cfg)` in this process;
                num_processes  > 1: `launch_training(cfg)`, i.e.
        python -m accelerate.commands.launch --num_processes N --num_machines 1 --mixed_precision <bf16|no>
            --dynamo_backend no --multi_gpu --main_process_port 0 -m drafter_lib.train --config <cfg.json>

`--multi_gpu` is accelerate's data-parallel launcher (torchrun): one process per GPU (cuda:0..N-1, NCCL), or on a
machine without CUDA N CPU processes over gloo (how the tests run it; `accelerate launch --cpu` would start one
process unless given an MPI hostfile). The trainer under it is the same loop as in process: DDP or FSDP (per
`distributed`; the trainer shards the model itself, so both take this command), each process its micro-batches of
every global step, rank-0-only writes, and it resumes from the run's checkpoints as the in-process
path does (a checkpoint records the global data position, so N may even change between runs). The config travels
as a temporary JSON file (it holds this machine's paths; train_config.json in the run keeps the portable copy), and
the result is read back from the main process's last stdout line plus history.json, so `train` returns the same
{"step", "done", "best", "out_dir", "history"} either way.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path

from drafter_lib.common.files import read_json
from drafter_lib.common.layout import TrainLayout
from drafter_lib.train.trainer import TrainConfig, run_training

__all__ = ["launch_command", "launch_training", "train"]


def launch_command(cfg: TrainConfig, config_path: str | os.PathLike, python: str | None = None) -> list[str]:
    """The `accelerate launch` command line that trains `cfg` (saved as JSON at config_path) over
    cfg.num_processes processes."""
    cfg.validate()
    cmd = [python or sys.executable, "-m", "accelerate.commands.launch",
           "--num_processes", str(cfg.num_processes), "--num_machines", "1",
           "--mixed_precision", cfg.mixed_precision, "--dynamo_backend", "no"]
    if cfg.num_processes > 1:  # cfg.validate: distributed is "ddp" or "fsdp" (the trainer applies FSDP itself)
        cmd += ["--multi_gpu", "--main_process_port", "0"]  # port 0: accelerate picks a free one
    return cmd + ["-m", "drafter_lib.train", "--config", str(config_path)]


def _child_env() -> dict:
    """This environment, with this checkout's package importable by the children whatever their directory."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _stop(proc: subprocess.Popen) -> None:
    """End the launcher and the training processes it started (its own process group, and only that)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _result_line(line: str) -> dict | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and {"step", "done", "best"} <= obj.keys() else None


def launch_training(cfg: TrainConfig, timeout: float | None = None, echo: bool = True) -> dict:
    """Run `cfg` under `accelerate launch` (blocking). Child stdout is echoed line by line (echo=True); stderr (the
    progress bar, warnings) is kept and its tail raised with the exit status if the launch fails. timeout (seconds):
    the launcher and its processes are stopped after it (the run resumes from its last checkpoint).
    -> {"step", "done", "best", "out_dir", "history"} as `run_training` returns."""
    cfg.validate()
    with tempfile.TemporaryDirectory(prefix="specdraft-launch-") as tmp:
        cfg_path = Path(tmp) / "train_config.json"
        cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
        err_path = Path(tmp) / "stderr.log"
        result = None
        with open(err_path, "w") as err:
            proc = subprocess.Popen(launch_command(cfg, cfg_path), stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=_child_env(), start_new_session=True)
            timer = threading.Timer(timeout, _stop, (proc,)) if timeout else None
            if timer is not None:
                timer.start()
            try:
                for line in proc.stdout:
                    if echo:
                        print(line, end="", flush=True)
                    result = _result_line(line.strip()) or result
                rc = proc.wait()
            except BaseException:
                _stop(proc)
                raise
            finally:
                if timer is not None:
                    timer.cancel()
        if rc != 0:
            tail = "".join(deque(err_path.read_text(errors="replace").splitlines(keepends=True), maxlen=40))
            raise RuntimeError(f"accelerate launch of {cfg.num_processes} training processes exited with status "
                               f"{rc}; the end of its stderr:\n{tail}")
    if result is None:
        raise RuntimeError("the launched training finished without printing its result line")
    history_path = TrainLayout(Path(cfg.out_dir)).history
    history = read_json(history_path) if history_path.is_file() else []
    return {"step": result["step"], "done": result["done"], "best": result["best"], "out_dir": str(cfg.out_dir),
            "history": history}


def train(cfg: TrainConfig | dict) -> dict:
    """Train (or resume) per `cfg`: in this process when cfg.num_processes == 1, else through `accelerate launch`."""
    if isinstance(cfg, dict):
        cfg = TrainConfig.from_dict(cfg)
    if cfg.num_processes > 1:
        return launch_training(cfg)
    return run_training(cfg)
