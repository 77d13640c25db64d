"""Shared by test_server.py / test_client.py: a tiny packed model dir and a real server subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY_VOCAB = 512
TINY_MAX_POS = 512


def tiny_hf_model(seed: int = 0, vocab_size: int = TINY_VOCAB, std: float = 0.3, **shape):
    """Tiny random Llama. With HF's default init (std 0.02) greedy output is one token repeated, which would hide
    mixed-up rows or wrong positions; std 0.3 on the matrices gives varied, context-dependent continuations.
    `shape` overrides the config (e.g. more layers / KV heads for a model whose KV cache weighs something)."""
    import torch

    from drafter_lib.model.tiny_models import tiny_random_model

    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, max_position_embeddings=TINY_MAX_POS)
    cfg.update(shape)
    model, _tok = tiny_random_model("llama", vocab_size=vocab_size, seed=seed, tokenizer="bytes", **cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def write_tiny_model_dir(out_dir: Path, model, bits: int = 4, copy_enabled: bool = False) -> Path:
    """Pack an HF model: int4 (or int8) group-wise linears, int8 per-row embeddings."""
    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig, QuantSpec

    qconfig = QuantConfig.default_for(group_size=32)
    if bits == 8:
        qconfig.default = QuantSpec(8, 32, "float16")
    write_model_dir(out_dir, model.config.to_dict(), model.state_dict(), qconfig,
                    copy_policy={"enabled": copy_enabled})
    return Path(out_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Loaded via PYTHONPATH into the server process: any connection or name lookup that is not loopback raises and is
# logged, so "makes no network calls" is checked, not assumed.
NET_GUARD = textwrap.dedent('''
    import os, socket

    _LOG = os.environ.get("NET_GUARD_LOG")
    _LOCAL = {"127.0.0.1", "::1", "localhost", "0.0.0.0", "::", ""}

    def _local(host):
        host = str(host)
        return host in _LOCAL or host.startswith("127.")

    def _deny(what):
        if _LOG:
            with open(_LOG, "a") as f:
                f.write(what + "\\n")
        raise OSError("network access blocked by test guard: " + what)

    _connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            _deny("connect %r" % (address,))
        return _connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            _deny("connect_ex %r" % (address,))
        return _connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and not _local(host.decode() if isinstance(host, bytes) else host):
            _deny("getaddrinfo %r" % (host,))
        return _getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
''')


def guarded_env(guard_dir: Path, log: Path, **extra) -> dict:
    guard_dir.mkdir(parents=True, exist_ok=True)
    (guard_dir / "sitecustomize.py").write_text(NET_GUARD)
    env = dict(os.environ)
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # serve.sh must set these itself
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(guard_dir), str(ROOT)] + ([env["PYTHONPATH"]]
                                                                       if env.get("PYTHONPATH") else []))
    env["NET_GUARD_LOG"] = str(log)
    # the server's torch threads = this process's, so both time and cache their kernel plan under one key
    # (kernels.machine_key): a test that compares served drafts with an in-process engine's sees one plan, not two
    # measured apart (on a busy machine they differed: fp16 for a shape on one side, fp32 on the other)
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    env.update({k: str(v) for k, v in extra.items()})
    return env


# A real server process whose engine sleeps `TEST_ENGINE_DELAY_S` before each batch: overload, timeouts and
# shutdown become deterministic to test. Same app and the same draining uvicorn server as server.py.
DELAYED_SERVER = textwrap.dedent('''
    import os, time
    from drafter_lib.serve.app import Settings, create_app, load_engine, serve

    settings = Settings.from_env()
    engine = load_engine(settings)
    delay, run = float(os.environ["TEST_ENGINE_DELAY_S"]), engine.draft_batch

    def slow_draft_batch(requests, k, **options):
        time.sleep(delay)
        return run(requests, k, **options)

    engine.draft_batch = slow_draft_batch
    serve(create_app(settings, engine=engine), settings)
''')


def proc_status_kib(pid: int, field: str) -> int:
    """A `/proc/<pid>/status` memory field (VmRSS = resident now, VmHWM = peak resident) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class ServerProcess:
    """`./serve.sh` (or `python server.py`, or `python -c <code>`) on a free loopback port; stopped on exit. Output
    goes to a log file."""

    def __init__(self, model_dir: Path, log_path: Path, env: dict | None = None, via_serve_sh: bool = True,
                 code: str | None = None, **settings):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        env = dict(env if env is not None else os.environ)
        env.update(HOST="127.0.0.1", PORT=str(self.port), MODEL_DIR=str(model_dir), LOG_LEVEL="warning",
                   PYTHON=sys.executable)
        env.update({k: str(v) for k, v in settings.items()})  # a setting given here wins over the defaults above
        if code is not None:
            cmd = [sys.executable, "-c", code]
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        elif via_serve_sh:
            cmd = ["bash", str(ROOT / "serve.sh")]
        else:
            cmd = [sys.executable, str(ROOT / "server.py")]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout: float = 120.0):
        from drafter_lib.serve.client import SpeculativeClient

        with SpeculativeClient(self.url) as c:
            try:
                return c.wait_ready(timeout, proc=self.proc)
            except Exception as e:
                raise RuntimeError(f"{e}\n--- server log ---\n{self.log()}") from e

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        self.wait_ready()
        return self

    def __exit__(self, *exc):
        self.stop()
