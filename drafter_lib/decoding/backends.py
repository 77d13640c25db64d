"""The teacher stage's generation backends. Each streams `Finished` rows (`drafter_lib.decoding.generate`): new tokens
cut at the first stop token, and with top_k > 0 the teacher's top-K log-probabilities at each stored position.

  "native": the hand-written decoder (`drafter_lib.model.transformer`) with continuous batching
  (`generate.stream_generate`),
            fp32 by default - the fast path on CPU. Waiting prompts of similar length share a prefill, and the
            head runs in vocabulary slices where this machine gives the same bits faster (`sliced_head`).
            `dtype="bfloat16"`/`"float16"` hold the weights in that precision (activations stay fp32); only
            worth it where the CPU has fast kernels for it, and only where its tokens equal the fp32 ones
            (bench/teacher.py measures both).
  "hf":     `transformers` generate with left padding, one static batch at a time - for architectures/devices
            the native path lacks (GPU). With top_k > 0 a logits processor keeps each step's top-K and lets the
            step's full-vocabulary logits go (`TopKRecorder`): what it holds grows as steps x batch x K.
  "vllm":   vLLM's offline engine (`drafter_lib.decoding.vllm_backend`), GPU only, tensor parallel across GPUs;
            vllm is imported only when this backend is made.
  "runtime": the target runtime (`drafter_lib.decoding.runtime`: W8A8 / W4A8 / fp32 linears, row-exact
            attention) with continuous batching, CPU: each row is exactly the runtime's own plain greedy answer to
            its prompt (the answers a drafter is verified against when the runtime serves), whatever rows share its
            passes, and its top-K come from the same logits.

The native, runtime and hf backends also `score` finished sequences teacher-forced (the teacher stage's scoring mode,
`drafter_lib.teacher.scoring`): one right-padded forward per batch, the head only at the positions asked for.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from drafter_lib.common.chat import cut_at_stop
from drafter_lib.decoding.generate import Finished, topk_logprobs
from drafter_lib.model.transformer import SUPPORTED_ARCHS

__all__ = ["HFBackend", "NativeBackend", "RuntimeBackend", "TopKRecorder", "Scored", "score_positions", "make_backend",
           "NATIVE_DTYPES", "BACKEND_NAMES"]

NATIVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKEND_NAMES = ("auto", "native", "hf", "vllm", "runtime")


class TopKRecorder:
    """A logits processor for `generate` that records, at each step, the top-K (ids int32, log-probs float32) of
    the scores it is handed and returns them unchanged; the step's [batch, vocab] logits are not kept. With greedy
    decoding and no other processor (HFBackend passes do_sample=False and no sampling settings) those scores are
    the raw logits, the ones `output_logits=True` would have stored for every step.

    ids[j] / logprobs[j]: [batch, K] of generated position j (j = input length - prompt width)."""

    def __init__(self, k: int, prompt_width: int):
        self.k, self.prompt_width = k, prompt_width
        self.ids: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        if step != len(self.ids):
            raise RuntimeError(f"TopKRecorder: called for step {step} after {len(self.ids)} recorded steps")
        sid, slp = topk_logprobs(scores, self.k)
        self.ids.append(sid)
        self.logprobs.append(slp)
        return scores

    def row(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's first n steps: ([n, K] ids, [n, K] log-probs)."""
        return (torch.stack([self.ids[j][i] for j in range(n)]), torch.stack([self.logprobs[j][i] for j in range(n)]))

    def stored_floats(self) -> int:
        """Numbers held (ids and log-probs): steps x batch x K each."""
        return sum(t.numel() for t in self.ids) + sum(t.numel() for t in self.logprobs)


@dataclass
class Scored:
    """A scored row's distributions at sequence positions start, start + 1, ...: the greedy token at each
    (`argmax` [n] long) and, with top_k > 0, the top-K (`ids` [n, K] int32, `logprobs` [n, K] float32)."""

    argmax: torch.Tensor
    ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None


def right_padded(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, T] of sequences padded on the right: every row starts at position 0, and a
    pad sits after its row's real tokens, so under a causal mask no real token attends to it."""
    T = max(len(p) for p in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, :len(p)] = 1
    return ids, mask


@torch.inference_mode()
def score_positions(hidden: torch.Tensor, head, starts: list[int], lens: list[int], top_k: int,
                    head_rows: int = 512) -> list[Scored]:
    """The head over final hidden states [B, T, H] at positions starts[i] .. lens[i] - 1 of each row only, `head_rows`
    positions at a time (a [positions, V] product of a large vocabulary is big); its argmax and top-K there."""
    flat = torch.cat([hidden[i, s:n] for i, (s, n) in enumerate(zip(starts, lens))])
    arg, ids, lps = [], [], []
    for s in range(0, len(flat), head_rows):
        logits = head(flat[s:s + head_rows]).float()
        arg.append(logits.argmax(-1))
        if top_k:
            a, b = topk_logprobs(logits, top_k)
            ids.append(a)
            lps.append(b)
    arg = torch.cat(arg)
    ids, lps = (torch.cat(ids), torch.cat(lps)) if top_k else (None, None)
    out, e = [], 0
    for s, n in zip(starts, lens):
        b, e = e, e + n - s
        out.append(Scored(arg[b:e], ids[b:e] if top_k else None, lps[b:e] if top_k else None))
    return out


def left_padded(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, T] of prompts padded on the left, as `generate` wants a batch."""
    T = max(len(p) for p in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    return ids, mask


class HFBackend:
    """transformers generate, greedy, left-padded static batches."""

    name = "hf"

    def __init__(self, model, pad_id: int):
        self.model = model.eval()
        self.pad_id = pad_id
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        return [f.tokens for f in self.stream(prompts, max_new_tokens, stop_ids, batch_size=len(prompts))]

    @torch.inference_mode()
    def stream(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], batch_size: int,
               top_k: int = 0, prompt_top_k: bool = False) -> Iterator[Finished]:
        stop = set(stop_ids)
        for b0 in range(0, len(prompts), batch_size):
            batch = prompts[b0:b0 + batch_size]
            ids, mask = left_padded(batch, self.pad_id)
            T = ids.shape[1]
            extra = {}
            recorder = None
            if top_k:
                from transformers import LogitsProcessorList

                recorder = TopKRecorder(top_k, T)  # each step's top-K only: never all steps' [B, V] logits
                extra["logits_processor"] = LogitsProcessorList([recorder])
                self.last_recorder = recorder  # tests read its size
            # the sequences only (no dict): neither the steps' logits nor the KV cache outlive generate
            seqs = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=stop_ids, pad_token_id=self.pad_id, top_p=None, top_k=None,
                temperature=None, return_dict_in_generate=False, **extra,
            )
            for i, row in enumerate(seqs[:, T:].tolist()):
                toks = cut_at_stop(row, stop, max_new_tokens)
                if not top_k:
                    yield Finished(b0 + i, toks)
                    continue
                # the logits of each generated position (greedy, no other logits processor: the raw logits)
                sid, slp = recorder.row(i, len(toks))
                start = len(batch[i]) - 1
                if prompt_top_k and len(batch[i]) > 1:
                    full = self.model(input_ids=torch.tensor([batch[i]], device=self.device),
                                      use_cache=False).logits[0, :-1]
                    pid, plp = topk_logprobs(full, top_k)
                    sid, slp, start = torch.cat([pid, sid]), torch.cat([plp, slp]), 0
                elif prompt_top_k:
                    start = 0
                yield Finished(b0 + i, toks, start, sid.cpu(), slp.float().cpu())


    @torch.inference_mode()
    def score(self, sequences: list[list[int]], starts: list[int], top_k: int = 0) -> list[Scored]:
        """One teacher-forced forward over the right-padded `sequences`; row i's distributions at positions
        starts[i] .. len(sequences[i]) - 1 (`score_positions`)."""
        ids, mask = right_padded(sequences, self.pad_id)
        h = self.model.get_decoder()(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
                                     ).last_hidden_state
        return score_positions(h, self.model.get_output_embeddings(), starts, [len(s) for s in sequences], top_k)


class NativeBackend:
    """The project's hand-written decoder with the teacher's weights, continuous batching (fast greedy on CPU)."""

    name = "native"

    def __init__(self, hf_model, dtype: str = "float32", schedule: str = "continuous", prefill_group: int = 8,
                 sliced_head: bool = True, row_blocks: int = 16):
        """prefill_group: waiting prompts one prefill may take (`generate.stream_generate`; 1: one by one).
        sliced_head: compute the head in vocabulary slices where this machine gives the same bits faster
        (`sliced_head.hold_sliced_head`, measured once per machine).
        row_blocks: decode attention per block of this many rows kept sorted by position (0: one block)."""
        from drafter_lib.decoding.sliced_head import hold_sliced_head
        from drafter_lib.model.transformer import Transformer

        if dtype not in NATIVE_DTYPES:
            raise ValueError(f"native dtype must be one of {sorted(NATIVE_DTYPES)}, got {dtype!r}")
        if schedule not in ("continuous", "static"):
            raise ValueError(f"schedule must be 'continuous' or 'static', got {schedule!r}")
        self.model = Transformer.from_hf_model(hf_model).to(NATIVE_DTYPES[dtype]).eval()
        self.dtype, self.schedule, self.prefill_group, self.row_blocks = dtype, schedule, prefill_group, row_blocks
        if sliced_head:
            hold_sliced_head(self.model)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        outs: list[list[int]] = [[] for _ in prompts]
        for f in self.stream(prompts, max_new_tokens, stop_ids, batch_size=len(prompts)):
            outs[f.index] = f.tokens
        return outs

    def stream(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], batch_size: int,
               top_k: int = 0, prompt_top_k: bool = False) -> Iterator[Finished]:
        from drafter_lib.decoding.generate import stream_generate

        yield from stream_generate(self.model, prompts, max_new_tokens, stop_ids, batch_size, topk=top_k,
                                   prompt_topk=prompt_top_k, refill=self.schedule == "continuous",
                                   prefill_group=self.prefill_group, row_blocks=self.row_blocks)

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], starts: list[int], top_k: int = 0) -> list[Scored]:
        """One teacher-forced forward over the right-padded `sequences` (no KV cache: each row attends to its own
        earlier positions); row i's distributions at positions starts[i] .. len(sequences[i]) - 1."""
        ids, _ = right_padded(sequences, 0)
        h = self.model.hidden(ids, torch.arange(ids.shape[1]).expand_as(ids))
        return score_positions(h, self.model.lm_head, starts, [len(s) for s in sequences], top_k)


class RuntimeBackend:
    """The target runtime as the teacher: the teacher's weights converted to `numerics` as the server's runtime
    converts them (`runtime.runtime_target`: smoothed on the tokenizer's calibration rows; "gguf" and "auto" take
    the blocks of `spec`'s GGUF file where it has one, `runtime.gguf_blocks`), decoded with continuous batching.
    `numerics` then names what runs ("auto" resolved)."""

    name = "runtime"

    def __init__(self, hf_model, tokenizer, numerics: str | None = None, spec: str | None = None,
                 prefill_group: int = 8):
        from drafter_lib.decoding.runtime import NUMERICS, block_kernel_runs, gguf_blocks, runtime_target
        from drafter_lib.decoding.smoothing import calibration_rows
        from drafter_lib.model.transformer import Transformer

        numerics = numerics or NUMERICS[0]
        blocks = gguf_blocks(spec) if spec and numerics in ("gguf", "auto") and block_kernel_runs() else None
        model = Transformer.from_hf_model(hf_model)
        self.model = runtime_target(model, numerics, calibration=calibration_rows(tokenizer), blocks=blocks).model
        self.numerics, self.prefill_group = self.model.numerics, prefill_group

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        outs: list[list[int]] = [[] for _ in prompts]
        for f in self.stream(prompts, max_new_tokens, stop_ids, batch_size=len(prompts)):
            outs[f.index] = f.tokens
        return outs

    def stream(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], batch_size: int,
               top_k: int = 0, prompt_top_k: bool = False) -> Iterator[Finished]:
        from drafter_lib.decoding.generate import stream_generate

        yield from stream_generate(self.model, prompts, max_new_tokens, stop_ids, batch_size, topk=top_k,
                                   prompt_topk=prompt_top_k, prefill_group=self.prefill_group)

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], starts: list[int], top_k: int = 0) -> list[Scored]:
        """One teacher-forced, row-exact forward over the right-padded `sequences` (through a cache, as the
        runtime's own passes); row i's distributions at positions starts[i] .. len(sequences[i]) - 1."""
        ids, _ = right_padded(sequences, 0)
        cache = self.model.new_cache(ids.shape[0], ids.shape[1])
        h = self.model.hidden(ids, torch.arange(ids.shape[1]).expand_as(ids), cache)
        return score_positions(h, self.model.lm_head, starts, [len(s) for s in sequences], top_k)


def _model_folder(model) -> str:
    """The folder the HF teacher was loaded from (a local dir, or the hub snapshot it was read from)."""
    from pathlib import Path

    path = getattr(model.config, "_name_or_path", None)
    if not path or not (Path(path) / "config.json").is_file():
        raise ValueError(f"the vllm backend loads the teacher from its HF folder, but this model was loaded from "
                         f"{path!r} (no config.json there): use a hub id or a local HF folder as study.teacher, or "
                         "teacher.backend='hf'")
    return str(path)


def make_backend(name: str, model, tokenizer, dtype: str = "float32", schedule: str = "continuous",
                 vllm_options: dict | None = None, numerics: str | None = None, spec: str | None = None,
                 **native_options):
    """"native", "hf", "vllm", "runtime" or "auto" (native on CPU for the hand-written decoder's SUPPORTED_ARCHS,
    else hf; never vllm or runtime). dtype/schedule and `native_options` (`NativeBackend`'s prefill_group,
    sliced_head, row_blocks): native only (prefill_group: runtime too). vllm_options (`VLLMBackend`'s
    tensor_parallel_size, chunk_rows, ...): vllm only; vLLM loads the weights itself from the folder `model` was
    loaded from, in `model`'s dtype, so the weights the teacher meta hashes are the ones used. numerics: runtime
    only (None: the runtime's default, `runtime.NUMERICS[0]`); spec: the teacher's spec, whose GGUF file the
    runtime's "gguf" / "auto" numerics read where it has one (runtime only)."""
    if name == "auto":
        on_cpu = next(model.parameters()).device.type == "cpu"
        name = "native" if on_cpu and model.config.model_type in SUPPORTED_ARCHS else "hf"
    if vllm_options and name != "vllm":
        raise ValueError("vllm_options are options of the vllm backend")
    if numerics is not None and name != "runtime":
        raise ValueError("numerics is an option of the runtime backend")
    if name == "runtime":
        if dtype != "float32" or schedule != "continuous" or set(native_options) - {"prefill_group"}:
            raise ValueError("the runtime backend takes numerics and prefill_group, not dtype, schedule or "
                             f"{sorted(set(native_options) - {'prefill_group'})}")
        return RuntimeBackend(model, tokenizer, numerics, spec, **native_options)
    if name == "native":
        return NativeBackend(model, dtype=dtype, schedule=schedule, **native_options)
    if name in ("hf", "vllm") and (dtype != "float32" or schedule != "continuous" or native_options):
        raise ValueError("dtype, schedule and native_options are options of the native backend")
    if name == "hf":
        from drafter_lib.common.chat import stop_token_ids

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_token_ids(tokenizer)[0]
        return HFBackend(model, pad)
    if name == "vllm":
        from drafter_lib.decoding.vllm_backend import VLLMBackend

        opts = dict(vllm_options or {})
        if opts.get("llm") is None:
            opts.setdefault("model_path", _model_folder(model))
        opts.setdefault("dtype", str(next(model.parameters()).dtype).removeprefix("torch."))
        return VLLMBackend(**opts)
    raise ValueError(f"unknown backend {name!r} (expected one of {BACKEND_NAMES})")
