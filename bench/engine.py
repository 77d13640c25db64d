"""Engine vs transformers `generate` on the same weights: 16-token draft latency, warm-prefix gain, memory, and
warm-decode tokens/s against the machine's bandwidth limit.

    python bench/engine.py                      # default drafter: SmolLM2-135M-Instruct pruned to --keep, packed
    python bench/engine.py --model-dir model/   # an existing packed model dir
    python bench/engine.py --tiny               # tiny random model (no teacher needed; smoke run)

The engine is loaded from a packed model dir (int4 linears / int8 embeddings restored) once per --modes entry
("auto": the kernel paths measured fastest on this machine, cached in ~/.cache/specdraft/kernels.json; with
--fresh-kernels they are measured again), without the copy prior, so every case is k model-drafted tokens;
the HF baseline gets the same restored weights in fp32. Cases per context length n (all k-token greedy drafts):
- HF: `generate` on the n-token prompt (no cache reuse).
- cold: the engine with nothing cached for the request (a new first token each rep).
- warm: the speculative-decoding pattern: request i+1 = request i + --accepted draft tokens + 1 bonus token,
  so the engine reuses request i's KV and computes only the new tail.
- branch: a request sharing all but the last 8 tokens with a cached one (shared system prompt, new user turn);
  the shared prefix's KV is copied.
- decode: request i+1 = request i + its whole draft, so all but its last token are cached: k one-row forward
  passes per call. Its tokens/s is compared with the bandwidth limit: bytes read per token (the weights as held,
  `kernels.decode_read_bytes`, + the K/V of the context) / the copy bandwidth measured here (a 1 GiB `copy_`,
  read + written bytes per second). A decode step whose weights stay in a large last-level cache can beat it.
Systems are interleaved round by round and the median of --reps is reported (other processes may share the CPU).
Goals (reported, not asserted): engine >= 3x faster than HF generate, warm >= 5x faster than cold at 1k context,
loaded weights <= 0.4x the fp32 size, warm decode >= 50% of the bandwidth limit.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter_lib.common.openmp_wait import bounded_spin

# The server's OpenMP wait (set before torch loads): threads spin a bounded while between ops, then sleep. Sleeping at
# once wakes a thread for every op; spinning without bound, under CPU oversubscription, waits a whole time slice
# for a descheduled worker (a warm 16-token draft at 1k context: 150 ms sleeping against 1,650 ms spinning).
WAIT = bounded_spin()

import argparse
import ctypes
import gc
import random
import statistics
import tempfile
import time

import torch

from drafter_lib.common.measured_choice import cache_file, cpu_model
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.engine.kernels import decode_read_bytes
from drafter_lib.engine.weight_formats import weight_bytes


def rss_mb() -> float:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed arenas back so RSS reflects live memory
    except OSError:
        pass
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bandwidth(nbytes: int, copy: bool = True, reps: int = 5) -> float:
    """GB/s, best of reps: a `copy_` of nbytes ((bytes read + bytes written) / time), or (copy=False) a `sum`
    re-reading the same nbytes (bytes read / time; a size that fits the last-level cache is read from it)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    op = (lambda: dst.copy_(src)) if copy else src.sum
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - t)
    return (2 if copy else 1) * nbytes / best / 1e9


def build_hf_and_pack(args, out_dir: Path):
    """Returns (hf_model_with_restored_weights, model_dir)."""
    from drafter_lib.interop.hf_export import export_hf
    from drafter_lib.packed.model_dir import write_model_dir
    from drafter_lib.quantization import QuantConfig

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        if args.tiny:
            from drafter_lib.model.tiny_models import tiny_random_model

            hf = tiny_random_model("llama")
            hf = hf[0] if isinstance(hf, tuple) else hf
            cfg = hf.config.to_dict()
            cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), 2048)
        else:
            from drafter_lib.model.hf_models import load_default_teacher, prune_layers

            teacher, _ = load_default_teacher()
            hf, cfg = prune_layers(teacher, args.keep)
            del teacher
        model_dir = out_dir / "packed"
        write_model_dir(model_dir, cfg, hf.state_dict(), QuantConfig.default_for(group_size=args.group_size),
                        copy_policy={"enabled": False})
        del hf
    # the same weights in transformers (a reduced draft vocabulary travels as a full head + suppressed tokens)
    hf = export_hf(model_dir, out_dir / "hf").eval()
    hf.generation_config.eos_token_id = None
    return hf, model_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="packed model dir (default: pack the pruned default teacher)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model instead of the default drafter")
    ap.add_argument("--keep", default="even:8", help="layers of the teacher kept in the default drafter")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["auto", "float16", "int8"],
                    choices=["auto", "auto-approx", "float16", "float32", "bfloat16", "int8", "int8w"],
                    help="engine weight modes compared side by side")
    ap.add_argument("--fresh-kernels", action="store_true", help="measure the auto paths again (temporary cache)")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--accepted", type=int, default=4, help="draft tokens accepted per step in the warm case")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0 = leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rnd = random.Random(0)
    tmp = tempfile.TemporaryDirectory()
    if args.fresh_kernels:
        os.environ["SPECDRAFT_CACHE_DIR"] = str(Path(tmp.name) / "kernel-cache")
    hf, model_dir = build_hf_and_pack(args, Path(tmp.name))
    V, k = hf.config.vocab_size, args.k
    fp32 = sum(p.numel() * 4 for p in {id(p): p for p in hf.parameters()}.values()) / 2**20

    engines, mem, load_s = {}, {}, {}
    for mode in args.modes:
        before = rss_mb()
        t = time.perf_counter()
        engines[mode] = DraftEngine.from_dir(model_dir, dtype=mode, copy_policy={"enabled": False},
                                            min_confidence=0)  # always k tokens: the pack's threshold off
        load_s[mode] = time.perf_counter() - t
        mem[mode] = (weight_bytes(engines[mode].model) / 2**20, rss_mb() - before)

    results, decode_ctx = {}, {}  # (n, system) -> median seconds; (n, mode) -> mean context of the decode case
    for n in args.contexts:
        prompt = torch.randint(0, V, (n,)).tolist()

        def hf_gen(prompt=prompt, n=n):
            with torch.inference_mode():
                hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, n, dtype=torch.long),
                            max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)

        cases = {"HF": hf_gen}
        for mode, eng in engines.items():
            eng.clear_cache()
            eng.draft(prompt, k)  # seeds the warm and branch cases
            state = {"req": list(prompt)}

            def cold(eng=eng, prompt=prompt):  # a new conversation: nothing of it is cached
                eng.draft([rnd.randrange(V)] + prompt[1:], k)

            def warm(eng=eng, state=state):
                d = eng.draft(state["req"], k)
                state["req"] = state["req"] + d[:args.accepted] + [rnd.randrange(V)]

            def branch(eng=eng, prompt=prompt, n=n):
                eng.draft(prompt[:n - 8] + [rnd.randrange(V) for _ in range(8)], k)

            dstate = {"req": list(prompt), "ctx": []}

            def decode(eng=eng, st=dstate):
                st["req"] = st["req"] + eng.draft(st["req"], k)
                st["ctx"].append(len(st["req"]) - k / 2)

            cases.update({(mode, "cold"): cold, (mode, "warm"): warm, (mode, "branch"): branch,
                          (mode, "decode"): decode})
            decode_ctx[n, mode] = dstate["ctx"]
        times = {name: [] for name in cases}
        names = list(cases)
        for r in range(args.reps + 1):  # round 0 warms up; order rotates so no system always runs first
            for name in names[r % len(names):] + names[:r % len(names)]:
                t = time.perf_counter()
                cases[name]()
                if r:
                    times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            results[n, name] = statistics.median(ts)

    cfg = next(iter(engines.values())).config
    first = next(iter(engines.values()))
    ws_bytes = decode_read_bytes(first.model)
    bw, bw_ws = bandwidth(1 << 30), bandwidth(max(ws_bytes, 1 << 20), copy=False)
    print(f"\nmodel: {cfg.arch} layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} vocab={cfg.vocab_size}")
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads={torch.get_num_threads()} OpenMP wait: {WAIT}")
    print(f"copy bandwidth: {bw:.1f} GB/s (1 GiB copy_, read + written bytes); re-reading {ws_bytes / 2**20:.0f} "
          f"MiB (the first mode's decode weights) {bw_ws:.1f} GB/s (from the last-level cache where they fit)")
    for mode, eng in engines.items():
        if eng.kernels:
            paths = "  ".join(f"{s} {e['path']}" + (" (" + " ".join(f"{p} {us:.0f}" for p, us in
                                                             e["us_per_call"].items()) + " us)"
                                                    if "us_per_call" in e else "")
                              for s, e in eng.kernels.items())
            print(f"kernels {mode} (load {load_s[mode]:.1f} s, cache {cache_file()}): {paths}; "
                  f"cached steps {eng.step_plan}")
        steps = "" if eng.kernels else f"cached steps {eng.step_plan}; "
        print(f"{mode}: {steps}head {eng.head_plan} (us per one-row greedy token with its probability)")
    print(f"\nk={k}, warm: +{args.accepted} accepted +1 bonus per request (median of {args.reps}, interleaved)")
    print(f"{'ctx':>5} {'system':>14} | {'latency':>10} {'tok/s':>7} | {'HF/this':>7} {'cold/this':>9}")
    for n in args.contexts:
        t_hf = results[n, "HF"]
        print(f"{n:>5} {'HF generate':>14} | {t_hf * 1e3:>7.1f} ms {k / t_hf:>7.1f} |")
        for mode in engines:
            t_cold = results[n, (mode, "cold")]
            for case in ("cold", "warm", "branch"):
                t = results[n, (mode, case)]
                print(f"{n:>5} {mode + ' ' + case:>14} | {t * 1e3:>7.1f} ms {k / t:>7.1f} | {t_hf / t:>6.2f}x "
                      f"{t_cold / t:>8.2f}x")
    print("\nwarm decode (k one-row passes per call) vs the bandwidth limit = copy bandwidth / bytes read per token")
    print(f"{'ctx':>5} {'mode':>12} | {'tok/s':>7} | {'weights MiB':>11} {'KV MiB':>7} | {'limit tok/s':>11} "
          f"{'fraction':>8}")
    for n in args.contexts:
        for mode, eng in engines.items():
            ctx = statistics.mean(decode_ctx[n, mode])
            w, kv = decode_read_bytes(eng.model), eng.kv_bytes_per_token * ctx
            rate, limit = k / results[n, (mode, "decode")], bw * 1e9 / (w + kv)
            print(f"{n:>5} {mode:>12} | {rate:>7.1f} | {w / 2**20:>11.1f} {kv / 2**20:>7.1f} | {limit:>11.1f} "
                  f"{rate / limit:>8.0%}")
    for mode, (loaded, rss) in mem.items():
        print(f"memory {mode:>8}: weights {loaded:.1f} MiB (RSS +{rss:.1f} MiB after load) vs fp32 {fp32:.1f} MiB "
              f"-> {loaded / fp32:.2f}x (RSS {rss / fp32:.2f}x)")
    print("goals: engine warm >= 3x HF generate (HF/this), warm >= 5x cold at 1k (cold/this), weights <= 0.4x fp32, "
          "warm decode >= 50% of the bandwidth limit")


if __name__ == "__main__":
    main()
