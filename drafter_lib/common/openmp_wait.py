"""How torch's idle OpenMP threads wait between ops: spin a bounded while, then sleep.

torch's CPU ops run on libgomp's thread pool, which reads its wait settings once, when torch is imported; so an
entry point calls `bounded_spin()` before importing torch (`drafter_lib` itself imports nothing heavy).
The three ways to wait, measured on 2-core machines (docs/engine.md):
- sleep at once (`OMP_WAIT_POLICY=PASSIVE`): every op of a decode step
  first wakes the other thread. On a KVM guest (AMD EPYC, AVX-512) a one-row compiled draft step took 3.8-5.9 ms
  against 1.3-1.9 ms with spinning threads, and a warm 16-token draft 81-108 ms against 29-49 ms.
- spin without bound (`OMP_WAIT_POLICY=ACTIVE`, or libgomp's default of 300,000 spins, near that): a thread spinning
  for a worker that another process has descheduled holds its core for a time slice (a warm draft under CPU
  oversubscription: 1,650 ms against 150 ms sleeping).
- spin `BOUNDED_SPINS` times, then sleep (`GOMP_SPINCOUNT`): the ops of one step find the other thread awake, and
  once a draft ends the thread soon sleeps, leaving the cores to the target, which verifies while the drafter idles.
  End to end against the transformers target in another process it gave the most tokens/s of 10k, 30k and 100k
  spins and of sleeping at once. Beside a process that computes all the time, sleeping at once is still better
  (warm drafts 90-174 ms against 146-526 ms): set `OMP_WAIT_POLICY=PASSIVE` there.
A wait setting the user gave (either variable) is kept. libgomp cuts every spin to 1,000 iterations once a process
holds more OpenMP threads than cores, so a process should run its torch ops on one thread (`batching.EngineThread`).
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

BOUNDED_SPINS = 100_000  # libgomp pause-loop iterations before a waiting thread sleeps (its default: 300,000)


def bounded_spin(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set GOMP_SPINCOUNT unless a wait setting is given; returns the setting in force (`setting`).
    Call before torch is imported (later it changes nothing in this process, only in its children)."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = str(BOUNDED_SPINS)
    return setting(environ)


def setting(environ: MutableMapping[str, str] = os.environ) -> str:
    """The wait settings given, e.g. "GOMP_SPINCOUNT=30000", or "OpenMP default wait": part of the kernel cache's
    machine key (an op's cost, and so which path wins, depends on it) and of every benchmark's header."""
    given = [f"{name}={environ[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in environ]
    return " ".join(given) or "OpenMP default wait"
