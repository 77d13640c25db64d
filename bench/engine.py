"""Engine vs transformers `generate` on the same weights: 16-token draft latency, warm-prefix gain, memory.

    python bench/engine.py                      # default drafter: SmolLM2-135M-Instruct pruned to --keep, packed
    python bench/engine.py --model-dir model/   # an existing packed model dir
    python bench/engine.py --tiny               # tiny random model (no teacher needed; smoke run)

The engine is loaded from a packed model dir (int4 linears / int8 embeddings restored, held in --dtype); the HF
baseline gets the same restored weights in fp32. Goals (reported, not asserted): engine >= 3x faster than HF
generate, warm prefix >= 5x faster than cold at 1k context, loaded weights <= 0.4x the fp32 size.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter_lib.engine import DraftEngine, weight_bytes  # noqa: E402


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


def timeit(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def build_hf_and_pack(args, out_dir: Path):
    """Returns (hf_model_with_restored_weights, model_dir)."""
    import transformers

    from drafter_lib.model_dir import read_model_dir, write_model_dir
    from drafter_lib.quantization import QuantConfig

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        if args.tiny:
            from drafter_lib.hf_models import tiny_random_model

            hf = tiny_random_model("llama")
            hf = hf[0] if isinstance(hf, tuple) else hf
            cfg = hf.config.to_dict()
            cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), 2048)
        else:
            from drafter_lib.hf_models import load_default_teacher, prune_layers

            teacher, _ = load_default_teacher()
            hf, cfg = prune_layers(teacher, args.keep)
            del teacher
        model_dir = out_dir / "packed"
        write_model_dir(model_dir, cfg, hf.state_dict(), QuantConfig.default_for(group_size=args.group_size),
                        copy_policy={"enabled": False})
        del hf
    packed = read_model_dir(model_dir)
    hf_cfg = transformers.AutoConfig.for_model(**packed.config)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    sd = dict(packed.state_dict)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"], missing
    hf.generation_config.eos_token_id = None
    return hf, model_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="packed model dir (default: pack the pruned default teacher)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model instead of the default drafter")
    ap.add_argument("--keep", default="even:8", help="layers of the teacher kept in the default drafter")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32", "int8"])
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tmp = tempfile.TemporaryDirectory()
    hf, model_dir = build_hf_and_pack(args, Path(tmp.name))
    V, k = hf.config.vocab_size, args.k

    before = rss_mb()
    eng = DraftEngine(model_dir, dtype=args.dtype)
    after = rss_mb()
    loaded = weight_bytes(eng.model) / 2**20
    fp32 = sum(p.numel() * 4 for p in {id(p): p for p in hf.parameters()}.values()) / 2**20

    rows = []
    for n in args.contexts:
        prompt = torch.randint(0, V, (n,)).tolist()

        def hf_gen():
            with torch.inference_mode():
                hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, n, dtype=torch.long),
                            max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)

        def cold():
            eng.clear_cache()
            return eng.draft(prompt, k)

        t_hf = timeit(hf_gen, args.reps)
        t_cold = timeit(cold, args.reps)
        # warm: the typical next request = previous request + 4 accepted draft tokens + 1 bonus token
        state = {"p": list(prompt)}

        def warm():
            d = eng.draft(state["p"], k)
            state["p"] = state["p"][:n] + d[:4] + [1]  # same extension each rep (cache holds prompt + draft)
            return d

        eng.clear_cache()
        eng.draft(prompt, k)
        t_warm = timeit(warm, args.reps)
        # decode-only rate: draft of 1 vs k tokens on a warm prefix
        rows.append((n, t_hf, t_cold, t_warm))

    cfg = eng.config
    print(f"\nmodel: {cfg.arch} layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} vocab={cfg.vocab_size} "
          f"engine dtype={args.dtype} threads={torch.get_num_threads()} k={k} (median of {args.reps})")
    print(f"{'ctx':>6} | {'HF generate':>12} {'tok/s':>7} | {'engine cold':>12} {'tok/s':>7} | "
          f"{'engine warm':>12} {'tok/s':>7} | {'HF/cold':>7} {'HF/warm':>7} {'cold/warm':>9}")
    for n, t_hf, t_cold, t_warm in rows:
        print(f"{n:>6} | {t_hf * 1e3:>9.1f} ms {k / t_hf:>7.1f} | {t_cold * 1e3:>9.1f} ms {k / t_cold:>7.1f} | "
              f"{t_warm * 1e3:>9.1f} ms {k / t_warm:>7.1f} | {t_hf / t_cold:>6.2f}x {t_hf / t_warm:>6.2f}x "
              f"{t_cold / t_warm:>8.2f}x")
    print(f"memory: engine weights {loaded:.1f} MiB (RSS +{after - before:.1f} MiB after load) vs fp32 "
          f"{fp32:.1f} MiB -> {loaded / fp32:.2f}x (RSS {(after - before) / fp32:.2f}x)")
    print("goals: engine >= 3x HF generate (HF/warm), warm >= 5x cold at 1k, weights <= 0.4x fp32")


if __name__ == "__main__":
    main()
