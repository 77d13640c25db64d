"""The teacher stage's vLLM backend: vLLM's offline engine (`vllm.LLM`) writes the greedy continuations, with
tensor parallelism over `tensor_parallel_size` GPUs, and streams the same `Finished` rows as the other backends
(`drafter_lib.decoding.backends`), so `drafter_lib.teacher.targets` writes the same sharded, resumable, hashed
targets and soft labels whichever backend ran.

What it asks vLLM for (vLLM's own names):
    LLM(model=<the teacher's HF folder>, tensor_parallel_size=N, dtype=<the teacher's dtype>,
        max_logprobs=max(20, K), max_num_seqs=batch_size, seed=0[, enable_prefix_caching=False with prompt logprobs])
    LLM.generate([{"prompt_token_ids": ids}, ...], SamplingParams(temperature=0, max_tokens=max_new_tokens,
        stop_token_ids=stop_ids, ignore_eos=True, logprobs=K, prompt_logprobs=K (soft_prompt only),
        detokenize=False))
`ignore_eos=True` with our stop ids: the row stops at exactly the stop ids the other backends stop at (vLLM
would otherwise also stop at the EOS ids of the model's generation config).

What comes back (`RequestOutput`): `outputs[0].token_ids` (the stop token that ended a row included),
`outputs[0].logprobs` - one {token_id: Logprob(logprob, rank, decoded_token)} per generated token, the
distribution at the position before it - and `prompt_logprobs`: None for the first prompt token, then one such
dict per prompt token, the distribution at the position before it. Each dict holds the top-K and also the token
actually there (the sampled / prompt token), so K or K+1 entries; `topk_from_position` keeps exactly the top K by
log-probability, most likely first, as int32 ids and float32 log-probs - what `generate.topk_logprobs` gives the
other backends. vLLM's default logprobs mode is the log-softmax of the raw logits (before any processor), the
same quantity. The containers may be lists of dicts or vLLM's `FlatLogprobs` (both index and iterate as dicts).

vllm is imported only when this backend is made (the engine itself on the first `stream`); without it the error
says how to get it.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from drafter_lib.common.chat import cut_at_stop
from drafter_lib.decoding.generate import Finished

__all__ = ["VLLMBackend", "make_llm", "sampling_kwargs", "topk_from_position", "finished_from_output",
           "require_vllm", "vllm_installed", "VLLM_MISSING"]

VLLM_MISSING = ("teacher.backend='vllm' needs the vllm package and a CUDA GPU: `pip install vllm` on a machine "
                "with NVIDIA GPUs (a CUDA build of torch), or use teacher.backend='hf' / 'native'")


def vllm_installed() -> bool:
    """Whether vllm can be imported here (without importing it: that initialises CUDA)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm():
    """The vllm module, or ImportError with what to do."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{VLLM_MISSING} ({e})") from e
    return vllm


def _rank_key(item) -> tuple:
    token_id, lp = item
    rank = getattr(lp, "rank", None)
    value = float(lp.logprob)
    return (-value if not math.isnan(value) else math.inf, rank if rank is not None else math.inf, int(token_id))


def topk_from_position(position: Mapping, k: int, where: str = "") -> tuple[list[int], list[float]]:
    """One position's {token_id: Logprob} -> (ids, log-probs) of exactly the top `k` by log-probability, most
    likely first (ties: vLLM's rank, then the smaller id). vLLM adds the token actually there when it is outside
    the top k, so a position holds k or k + 1 entries; fewer than k is an error."""
    if position is None or len(position) < k:
        raise ValueError(f"vLLM returned {0 if position is None else len(position)} log-probs{where}, need >= {k}")
    items = sorted(position.items(), key=_rank_key)[:k]
    return [int(t) for t, _ in items], [float(lp.logprob) for _, lp in items]


def _positions_to_tensors(positions, k: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids, lps = [], []
    for j, pos in enumerate(positions):
        a, b = topk_from_position(pos, k, f" at {where} position {j}")
        ids.append(a)
        lps.append(b)
    return (torch.tensor(ids, dtype=torch.int32).reshape(-1, k),
            torch.tensor(lps, dtype=torch.float32).reshape(-1, k))


def finished_from_output(index: int, prompt: Sequence[int], output, max_new_tokens: int, stop_ids: Sequence[int],
                         top_k: int = 0, prompt_top_k: bool = False) -> Finished:
    """One vLLM `RequestOutput` -> the `Finished` row the other backends yield for the same prompt: new tokens cut
    at the first stop id (kept) and at max_new_tokens; with top_k the distributions at positions
    len(prompt) - 1 .. (one per new token), with prompt_top_k from position 0 (one per prompt token after the
    first, then one per new token)."""
    if output.prompt_token_ids is not None and list(output.prompt_token_ids) != list(prompt):
        raise ValueError(f"row {index}: vLLM answered another prompt ({len(output.prompt_token_ids)} tokens, "
                         f"sent {len(prompt)})")
    comp = output.outputs[0]
    toks = cut_at_stop(list(comp.token_ids), stop_ids, max_new_tokens)
    if not top_k:
        return Finished(index, toks)
    sample = comp.logprobs
    if sample is None or len(sample) < len(toks):
        raise ValueError(f"row {index}: vLLM returned {0 if sample is None else len(sample)} log-prob positions "
                         f"for {len(toks)} tokens (SamplingParams.logprobs not set?)")
    sid, slp = _positions_to_tensors((sample[j] for j in range(len(toks))), top_k, f"row {index} generated")
    start = len(prompt) - 1
    if prompt_top_k:
        start = 0
        if len(prompt) > 1:
            plist = output.prompt_logprobs
            if plist is None or len(plist) < len(prompt):
                raise ValueError(f"row {index}: vLLM returned {0 if plist is None else len(plist)} prompt log-prob "
                                 f"positions for a {len(prompt)}-token prompt (SamplingParams.prompt_logprobs not "
                                 "set?)")
            # plist[0] is None (nothing predicts the first token); plist[i] is the distribution at position i - 1
            pid, plp = _positions_to_tensors((plist[i] for i in range(1, len(prompt))), top_k, f"row {index} prompt")
            sid, slp = torch.cat([pid, sid]), torch.cat([plp, slp])
    return Finished(index, toks, start, sid, slp)


def sampling_kwargs(max_new_tokens: int, stop_ids: Sequence[int], top_k: int = 0, prompt_top_k: bool = False
                    ) -> dict:
    """The `vllm.SamplingParams` arguments of a greedy teacher pass."""
    kw = {"n": 1, "temperature": 0.0, "max_tokens": max_new_tokens, "stop_token_ids": [int(t) for t in stop_ids],
          "ignore_eos": True, "detokenize": False}
    if top_k:
        kw["logprobs"] = top_k
        if prompt_top_k:
            kw["prompt_logprobs"] = top_k
    return kw


def make_llm(model_path: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", revision: str | None = None,
             max_logprobs: int = 20, max_num_seqs: int | None = None, seed: int = 0, **llm_kwargs):
    """vllm.LLM for the teacher (imports vllm)."""
    vllm = require_vllm()
    kw = {"model": model_path, "tensor_parallel_size": tensor_parallel_size, "dtype": dtype, "seed": seed,
          "max_logprobs": max(20, max_logprobs)}
    if revision:
        kw["revision"] = revision
    if max_num_seqs:
        kw["max_num_seqs"] = max_num_seqs
    kw.update(llm_kwargs)
    return vllm.LLM(**kw)


class VLLMBackend:
    """vLLM offline generation, greedy. `llm` may be given (tests pass a stand-in with vLLM's `generate`, and
    `sampling_params` a stand-in for `vllm.SamplingParams`); otherwise it is made on the first `stream` call, with
    max_num_seqs = that call's batch_size.

    chunk_rows: prompts per `LLM.generate` call (default 8 x batch_size): vLLM schedules them itself (continuous
    batching); rows reach the targets file after each chunk, so a killed run loses at most one chunk."""

    name = "vllm"

    def __init__(self, model_path: str | None = None, *, tensor_parallel_size: int = 1, dtype: str = "auto",
                 revision: str | None = None, chunk_rows: int | None = None, llm=None, sampling_params=None,
                 **llm_kwargs):
        if llm is None and not model_path:
            raise ValueError("VLLMBackend needs the teacher's model folder (or hub id) or an llm")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if llm is None:
            require_vllm()  # fail here, before the teacher stage writes anything, not at the first batch
        self.model_path, self.tensor_parallel_size, self.dtype, self.revision = (model_path, tensor_parallel_size,
                                                                                 dtype, revision)
        self.chunk_rows, self.llm, self.llm_kwargs = chunk_rows, llm, llm_kwargs
        self.sampling_params = sampling_params

    def _llm(self, batch_size: int, top_k: int, prompt_top_k: bool):
        if self.llm is None:
            kw = dict(self.llm_kwargs)
            if prompt_top_k:  # some vLLM versions refuse prompt_logprobs with prefix caching (a cached prefix has none)
                kw.setdefault("enable_prefix_caching", False)
            self.llm = make_llm(self.model_path, tensor_parallel_size=self.tensor_parallel_size, dtype=self.dtype,
                                revision=self.revision, max_logprobs=top_k, max_num_seqs=batch_size, **kw)
        return self.llm

    def _params(self, kw: dict):
        cls = self.sampling_params or require_vllm().SamplingParams
        return cls(**kw)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        return [f.tokens for f in self.stream(prompts, max_new_tokens, stop_ids, batch_size=max(len(prompts), 1))]

    def stream(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], batch_size: int,
               top_k: int = 0, prompt_top_k: bool = False) -> Iterator[Finished]:
        if not prompts:
            return
        llm = self._llm(batch_size, top_k, prompt_top_k)
        params = self._params(sampling_kwargs(max_new_tokens, stop_ids, top_k, prompt_top_k))
        chunk = self.chunk_rows or 8 * batch_size
        for c0 in range(0, len(prompts), chunk):
            part = prompts[c0:c0 + chunk]
            # outputs come back in the order of the prompts (LLM.generate sorts them by request)
            outs = llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in part], params, use_tqdm=False)
            if len(outs) != len(part):
                raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(part)} prompts")
            for i, out in enumerate(outs):
                yield finished_from_output(c0 + i, part[i], out, max_new_tokens, stop_ids, top_k, prompt_top_k)
