"""Load test for server.py on loopback: throughput and latency with 1 vs N concurrent clients.

Starts the server itself (subprocess, offline env) on a packed model dir, then for two request streams
  extend     - what a speculative decoding loop sends: each request = previous tokens + accepted draft tokens
               + 1 bonus token (acceptance simulated: each draft position accepted with probability --accept-p
               until the first rejection), so the server's prefix cache applies;
  unrelated  - a fresh random prompt every request (no cache reuse);
runs each client count for at most --requests requests or --duration seconds, and prints a side-by-side table
with requests/s, p50/p99 latency and the N-client / 1-client ratios (goal: throughput ratio >= 3 at 8 clients).

  python bench/server.py --model-dir model/
  python bench/server.py --tiny            # builds a small random packed model first (no trained model needed)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_lib.serve.client import SpeculativeClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_model(out: Path, vocab: int = 49152, hidden: int = 576, layers: int = 4) -> Path:
    """A random Llama shaped like the default drafter (SmolLM2 widths and vocab, few layers), packed like it
    (int4 linears, int8 embeddings): for running the bench before a trained model exists."""
    from drafter_lib.model.tiny_models import tiny_random_model
    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig

    model, _ = tiny_random_model("llama", vocab_size=vocab, tokenizer="bytes", hidden_size=hidden,
                                 num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=3,
                                 intermediate_size=hidden * 8 // 3, max_position_embeddings=4096)
    write_model_dir(out, model.config.to_dict(), model.state_dict(), QuantConfig.default_for(group_size=64),
                    copy_policy={"enabled": False})
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


class Stream:
    """Per-client request generator; `feedback` sees each draft (used by the extend stream)."""

    def __init__(self, kind: str, rng: random.Random, vocab: int, prompt_len: int, max_len: int, accept_p: float):
        self.kind, self.rng, self.vocab = kind, rng, vocab
        self.prompt_len, self.max_len, self.accept_p = prompt_len, max_len, accept_p
        self.seq = self._fresh()

    def _fresh(self) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.prompt_len)]

    def next_tokens(self) -> list[int]:
        if self.kind == "unrelated":
            self.seq = self._fresh()
        return self.seq

    def feedback(self, draft: list[int]) -> None:
        if self.kind != "extend":
            return
        n = 0
        while n < len(draft) and self.rng.random() < self.accept_p:
            n += 1
        self.seq = self.seq + draft[:n] + [self.rng.randrange(self.vocab)]  # accepted + the target's bonus token
        if len(self.seq) > self.max_len:  # this "generation" is done; start the next prompt
            self.seq = self._fresh()


async def run_phase(url: str, kind: str, clients: int, max_requests: int, duration: float, k: int, vocab: int,
                    prompt_len: int, max_len: int, accept_p: float, seed: int, min_confidence: float | None = 0.0
                    ) -> dict:
    latencies, batch_sizes, cached = [], [], []
    issued = rejected = 0
    deadline = time.perf_counter() + duration

    async def client(c: httpx.AsyncClient, cid: int):
        nonlocal issued, rejected
        stream = Stream(kind, random.Random(seed * 1000 + cid), vocab, prompt_len, max_len, accept_p)
        while issued < max_requests and time.perf_counter() < deadline:
            issued += 1
            tokens = stream.next_tokens()
            t0 = time.perf_counter()
            req = {"tokens": tokens, "num_draft_tokens": k}
            if min_confidence is not None:
                req["min_confidence"] = min_confidence
            r = await c.post("/draft", json=req)
            if r.status_code == 503:  # overloaded (MAX_QUEUE / REQUEST_TIMEOUT_S): counted, retried later
                rejected += 1
                await asyncio.sleep(min(1.0, float(r.headers.get("retry-after", 1))))
                continue
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            body = r.json()
            batch_sizes.append(body["batch_size"])
            if body.get("cached_prefix_len") is not None:
                cached.append(body["cached_prefix_len"] / max(len(tokens), 1))
            stream.feedback(body["draft"])

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*[client(c, i) for i in range(clients)])
        wall = time.perf_counter() - t0
    return {"stream": kind, "clients": clients, "requests": len(latencies), "wall_s": wall,
            "rps": len(latencies) / wall, "p50_ms": percentile(latencies, 50) * 1e3,
            "p99_ms": percentile(latencies, 99) * 1e3, "mean_batch": sum(batch_sizes) / max(len(batch_sizes), 1),
            "cached_frac": (sum(cached) / len(cached)) if cached else None, "rejected_503": rejected}


def print_table(results: list[dict], client_counts: list[int]) -> None:
    lo, hi = client_counts[0], client_counts[-1]
    cols = ["req/s", "p50 ms", "p99 ms", "batch"]
    block = 9 * len(cols)  # each number is 8 wide + 1 space

    def label(n):
        return f"{n} client" + ("s" if n > 1 else "")

    print(f"{'stream':<10}" + "".join(f"| {label(n):^{block}} " for n in client_counts) + f"| {f'ratio {hi}/{lo}':^21}")
    print(f"{'':<10}" + "".join("| " + "".join(f"{c:>8} " for c in cols) + " " for _ in client_counts)
          + f"| {'req/s':>10} {'p50':>10}")
    print("-" * (10 + (block + 3) * len(client_counts) + 23))
    for kind in dict.fromkeys(r["stream"] for r in results):
        rows = {r["clients"]: r for r in results if r["stream"] == kind}
        line = f"{kind:<10}"
        for n in client_counts:
            r = rows[n]
            line += f"| {r['rps']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['mean_batch']:>8.2f}  "
        line += f"| {rows[hi]['rps'] / rows[lo]['rps']:>9.2f}x {rows[hi]['p50_ms'] / rows[lo]['p50_ms']:>9.2f}x"
        print(line)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / "model"))
    ap.add_argument("--tiny", action="store_true", help="build and serve a random packed model of the default "
                    "drafter's widths (vocab 49152, hidden 576, --tiny-layers layers)")
    ap.add_argument("--tiny-layers", type=int, default=4)
    ap.add_argument("--url", help="use an already running server instead of starting one")
    ap.add_argument("--clients", default="1,8", help="comma-separated client counts (first is the baseline)")
    ap.add_argument("--requests", type=int, default=200, help="max requests per phase")
    ap.add_argument("--duration", type=float, default=20.0, help="max seconds per phase")
    ap.add_argument("--k", type=int, default=16, help="num_draft_tokens per request")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=384, help="extend stream: restart a client's sequence past this")
    ap.add_argument("--accept-p", type=float, default=0.7, help="extend stream: per-token acceptance probability")
    ap.add_argument("--streams", default="extend,unrelated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-confidence", type=float, default=0.0,
                    help="sent with every request (default 0: full k-token drafts, whatever the model dir's default "
                         "threshold; a negative value sends none, so that default applies)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    client_counts = [int(x) for x in args.clients.split(",")]

    proc = log = None
    tmp = tempfile.TemporaryDirectory()
    try:
        url = args.url
        if url is None:
            model_dir = (build_tiny_model(Path(tmp.name) / "tiny", layers=args.tiny_layers) if args.tiny
                         else Path(args.model_dir))
            if not (Path(model_dir) / "config.json").exists():
                sys.exit(f"{model_dir} holds no packed model (config.json missing); pass --model-dir or --tiny")
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = dict(os.environ, HOST="127.0.0.1", PORT=str(port), MODEL_DIR=str(model_dir), LOG_LEVEL="warning",
                       HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            log = open(Path(tmp.name) / "server.log", "w")
            proc = subprocess.Popen([sys.executable, str(ROOT / "server.py")], env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        with SpeculativeClient(url) as c:
            c.wait_ready(300, proc=proc)
            info = c.info()
        vocab = info["vocab_size"]
        max_len = min(args.max_len, info["max_context"] - args.k - 1)
        conf = None if args.min_confidence < 0 else args.min_confidence
        import torch

        print(f"cpu capability {torch.backends.cpu.get_cpu_capability()} (server side: the same machine)")
        print(f"server {url}  model {info['server']['model_dir']}  vocab {vocab}  k={args.k}  "
              f"prompt_len={args.prompt_len}  accept_p={args.accept_p}  min_confidence={conf}  "
              f"bounds: {args.requests} requests / {args.duration:.0f}s per phase", flush=True)
        # Warm-up (first-call allocations, thread pools) so the 1-client phase is not penalised.
        asyncio.run(run_phase(url, "unrelated", 2, 6, 30, args.k, vocab, args.prompt_len, max_len, args.accept_p,
                              seed=999, min_confidence=conf))
        results = []
        for kind in args.streams.split(","):
            for n in client_counts:
                r = asyncio.run(run_phase(url, kind, n, args.requests, args.duration, args.k, vocab,
                                          args.prompt_len, max_len, args.accept_p, args.seed, conf))
                print(f"  {kind:<9} {n:>2} clients: {r['requests']:>4} requests in {r['wall_s']:.1f}s  "
                      f"{r['rps']:.1f} req/s  p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms  "
                      f"mean batch {r['mean_batch']:.2f}  503s {r['rejected_503']}", flush=True)
                results.append(r)
        print()
        print_table(results, client_counts)
        if args.json:
            Path(args.json).write_text(json.dumps({"info": info, "results": results}, indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if log is not None:
            log.close()
        tmp.cleanup()


if __name__ == "__main__":
    main()
