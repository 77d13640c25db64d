"""The vllm teacher backend: vLLM-shaped outputs -> the rows every backend streams (on CPU, with stand-ins built
exactly like vLLM's RequestOutput / CompletionOutput / Logprob / FlatLogprobs / SamplingParams), the whole teacher
stage through it, and a real vLLM run where vllm and a CUDA GPU are present."""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from drafter_lib.common.chat import encode_chat, prompt_messages, stop_token_ids
from drafter_lib.decoding import vllm_backend as vb
from drafter_lib.decoding.backends import make_backend
from drafter_lib.decoding.generate import topk_logprobs
from drafter_lib.teacher import targets as teacher
from drafter_lib.teacher.soft_labels import load_soft_labels, soft_dir_for

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_backend_topk import varied_model  # noqa: E402
from test_teacher import records, tiny_model, tiny_tokenizer  # noqa: E402

# ------------------------------------------------------------------ stand-ins shaped like vLLM's own classes
# (vllm/logprobs.py, vllm/outputs.py, vllm/sampling_params.py: the same field names, order and defaults)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:
    """vllm.logprobs.FlatLogprobs: flat lists, read back per position as {token_id: Logprob}."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, position):
        self.start_indices.append(len(self.logprobs))
        for token_id, lp in (position or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(lp.logprob)
            self.ranks.append(lp.rank)
            self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def __len__(self):
        return len(self.start_indices)

    def __getitem__(self, index: int):
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | FlatLogprobs | None
    routed_experts: object = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: object = None
    kv_transfer_params: dict | None = None


class RequestOutput:
    def __init__(self, request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, metrics=None,
                 lora_request=None, encoder_prompt=None, encoder_prompt_token_ids=None, num_cached_tokens=None,
                 **kwargs):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.prompt_logprobs, self.outputs, self.finished = prompt_logprobs, outputs, finished
        self.metrics, self.lora_request, self.num_cached_tokens = metrics, lora_request, num_cached_tokens


@dataclass
class SamplingParams:
    """The subset of vllm.SamplingParams the backend may set: an unknown keyword fails here as it would there."""

    n: int = 1
    temperature: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True


def position(logprobs_row: torch.Tensor, k: int, actual: int) -> dict:
    """One position as vLLM builds it (logprobs.append_logprobs_for_next_position): the token actually there first,
    with its vocabulary rank, then the top k by rank; a token of the top k appears once (k or k + 1 entries)."""
    order = torch.argsort(logprobs_row, descending=True, stable=True).tolist()
    rank = order.index(actual) + 1
    ids = [actual] + order[:k]
    ranks = itertools.chain((rank,), range(1, k + 1))
    return {t: Logprob(float(logprobs_row[t]), r, None) for t, r in zip(ids, ranks)}


class FakeLLM:
    """vllm.LLM's generate over a transformers model: greedy tokens (the model's own greedy generate, stopping at
    stop_token_ids unless told otherwise) and, per position, log-probs from one forward over prompt + answer,
    returned in vLLM's shapes (list of dicts, or FlatLogprobs with flat=True)."""

    def __init__(self, model, flat: bool = False, eos_id: int | None = None):
        self.model, self.flat, self.eos_id, self.calls = model.eval(), flat, eos_id, []

    @torch.no_grad()
    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        sp = sampling_params
        self.calls.append((len(prompts), sp))
        assert sp.temperature == 0 and sp.n == 1 and not sp.detokenize
        stops = list(sp.stop_token_ids or []) + ([] if sp.ignore_eos or self.eos_id is None else [self.eos_id])
        outs = []
        for rid, p in enumerate(prompts):
            ids = list(p["prompt_token_ids"])
            seq = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=sp.max_tokens, do_sample=False, eos_token_id=stops or None,
                                      pad_token_id=0, top_p=None, top_k=None, temperature=None)[0, len(ids):].tolist()
            new = teacher.cut_at_stop(seq, stops, sp.max_tokens) if stops else seq
            full = torch.tensor([ids + new])
            lp = torch.log_softmax(self.model(full).logits[0].float(), -1)  # [P + n, V]
            make = FlatLogprobs if self.flat else list
            sample = None
            if sp.logprobs is not None:
                sample = make()
                for j, t in enumerate(new):
                    sample.append(position(lp[len(ids) - 1 + j], sp.logprobs, t))
            plp = None
            if sp.prompt_logprobs is not None:
                plp = make()
                plp.append(None)  # nothing predicts the first prompt token
                for i in range(1, len(ids)):
                    plp.append(position(lp[i - 1], sp.prompt_logprobs, ids[i]))
            stopped = bool(new) and new[-1] in stops
            comp = CompletionOutput(0, "", new, None, sample, finish_reason="stop" if stopped else "length",
                                    stop_reason=new[-1] if stopped and new[-1] in (sp.stop_token_ids or []) else None)
            outs.append(RequestOutput(str(rid), None, ids, plp, [comp], True))
        return outs


# ------------------------------------------------------------------ the conversion


def test_topk_from_position_keeps_exactly_k_by_logprob():
    # the sampled/prompt token (rank 9) first, then the top 3: four entries -> the top 3, most likely first
    pos = {50: Logprob(-7.0, 9), 4: Logprob(-0.5, 1), 8: Logprob(-1.5, 2), 6: Logprob(-2.0, 3)}
    assert vb.topk_from_position(pos, 3) == ([4, 8, 6], [-0.5, -1.5, -2.0])
    # the sampled token inside the top 3: three entries, listed first -> reordered
    pos = {8: Logprob(-1.5, 2), 4: Logprob(-0.5, 1), 6: Logprob(-2.0, 3)}
    assert vb.topk_from_position(pos, 3) == ([4, 8, 6], [-0.5, -1.5, -2.0])
    # ties follow vLLM's rank
    pos = {9: Logprob(-1.0, 2), 3: Logprob(-1.0, 1), 5: Logprob(-3.0, 3)}
    assert vb.topk_from_position(pos, 2)[0] == [3, 9]
    with pytest.raises(ValueError, match="need >= 4"):
        vb.topk_from_position(pos, 4)


def test_sampling_kwargs_are_vllm_names():
    kw = vb.sampling_kwargs(12, [2, 7], top_k=5, prompt_top_k=True)
    sp = SamplingParams(**kw)  # the stand-in takes only vLLM's field names
    assert (sp.temperature, sp.max_tokens, sp.stop_token_ids, sp.ignore_eos) == (0.0, 12, [2, 7], True)
    assert (sp.logprobs, sp.prompt_logprobs, sp.detokenize) == (5, 5, False)
    assert "prompt_logprobs" not in vb.sampling_kwargs(12, [2], top_k=5)
    assert "logprobs" not in vb.sampling_kwargs(12, [2])


@pytest.mark.parametrize("flat", [False, True])
def test_finished_from_output_positions_and_order(flat):
    """Known log-prob rows -> exactly topk_logprobs of the right rows: prompt positions 0..P-2, then P-1.."""
    g = torch.Generator().manual_seed(0)
    V, K, prompt, new = 40, 4, [1, 17, 5, 9], [12, 30, 2]  # 2: the stop id
    lp = torch.log_softmax(torch.randn(len(prompt) + len(new), V, generator=g) * 3, -1)
    make = FlatLogprobs if flat else list
    sample, plp = make(), make()
    for j, t in enumerate(new):
        sample.append(position(lp[len(prompt) - 1 + j], K, t))
    plp.append(None)
    for i in range(1, len(prompt)):
        plp.append(position(lp[i - 1], K, prompt[i]))
    out = RequestOutput("0", None, prompt, plp, [CompletionOutput(0, "", new, None, sample, finish_reason="stop",
                                                                  stop_reason=2)], True)
    f = vb.finished_from_output(3, prompt, out, max_new_tokens=8, stop_ids=[2], top_k=K, prompt_top_k=True)
    ids, lps = topk_logprobs(lp[:-1], K)  # positions 0 .. P+n-2: each predicts the token after it
    assert f.index == 3 and f.tokens == new and f.soft_start == 0
    assert f.soft_ids.dtype == torch.int32 and f.soft_logprobs.dtype == torch.float32
    assert f.soft_ids.shape == (len(prompt) - 1 + len(new), K)
    assert torch.equal(f.soft_ids, ids) and torch.allclose(f.soft_logprobs, lps)
    # without prompt positions: starts at P - 1, one entry per new token
    f = vb.finished_from_output(0, prompt, out, 8, [2], top_k=K)
    assert f.soft_start == len(prompt) - 1 and torch.equal(f.soft_ids, ids[len(prompt) - 1:])
    # no top-K: tokens only
    f = vb.finished_from_output(0, prompt, out, 8, [2])
    assert f.tokens == new and f.soft_ids is None
    # tokens past a stop id or past max_new_tokens are cut, as the other backends cut them
    out.outputs[0].token_ids = [12, 2, 30]
    assert vb.finished_from_output(0, prompt, out, 8, [2]).tokens == [12, 2]
    assert vb.finished_from_output(0, prompt, out, 1, [2]).tokens == [12]
    # a reply for another prompt is refused
    with pytest.raises(ValueError, match="another prompt"):
        vb.finished_from_output(0, prompt[:-1], out, 8, [2])


def test_one_token_prompt_and_missing_logprobs():
    lp = torch.log_softmax(torch.randn(3, 10), -1)
    sample = [position(lp[j], 3, t) for j, t in enumerate([4, 5])]
    out = RequestOutput("0", None, [7], [None], [CompletionOutput(0, "", [4, 5], None, sample)], True)
    f = vb.finished_from_output(0, [7], out, 5, [2], top_k=3, prompt_top_k=True)
    assert f.soft_start == 0 and f.soft_ids.shape == (2, 3)
    out.outputs[0].logprobs = None
    with pytest.raises(ValueError, match="logprobs not set"):
        vb.finished_from_output(0, [7], out, 5, [2], top_k=3)


# ------------------------------------------------------------------ the backend and the whole teacher stage


def _prompts(tok, n):
    return [encode_chat(tok, prompt_messages(r)) for r in records(n)]




@pytest.mark.parametrize("flat", [False, True])
def test_stream_matches_hf_backend(flat):
    """Through the backend's chunks: the same tokens as the hf backend, the same top-K ids where the top-K has no
    near-tie, log-probs within float noise (the stand-in scores a whole sequence in one forward)."""
    model, tok = varied_model(), tiny_tokenizer()
    prompts, stop, K = _prompts(tok, 9), stop_token_ids(tok), 5
    fake = FakeLLM(model, flat=flat)
    be = make_backend("vllm", model, tok, vllm_options={"llm": fake, "sampling_params": SamplingParams,
                                                        "chunk_rows": 4})
    got = sorted(be.stream(prompts, 10, stop, batch_size=2, top_k=K, prompt_top_k=True), key=lambda f: f.index)
    assert [n for n, _ in fake.calls] == [4, 4, 1]  # chunks of chunk_rows prompts
    ref = sorted(make_backend("hf", model, tok).stream(prompts, 10, stop, 4, top_k=K, prompt_top_k=True),
                 key=lambda f: f.index)
    assert [f.index for f in got] == list(range(9))
    assert any(f.tokens[-1] in stop for f in got) and any(f.tokens[-1] not in stop for f in got)
    for a, b in zip(got, ref):
        assert a.tokens == b.tokens and a.soft_start == b.soft_start == 0
        assert a.soft_ids.shape == b.soft_ids.shape
        torch.testing.assert_close(a.soft_logprobs, b.soft_logprobs, atol=1e-4, rtol=1e-4)
        clear = (b.soft_logprobs[:, :-1] - b.soft_logprobs[:, 1:]).min(1).values > 1e-3
        assert torch.equal(a.soft_ids[clear], b.soft_ids[clear])


def test_stops_at_our_stop_ids_not_the_models_eos():
    """ignore_eos=True: only stop_token_ids end a row (the model's own EOS id must not)."""
    model, tok = tiny_model(), tiny_tokenizer()
    be = vb.VLLMBackend(llm=FakeLLM(model, eos_id=7), sampling_params=SamplingParams)
    rows = list(be.stream(_prompts(tok, 3), 6, stop_token_ids(tok), batch_size=3))
    assert be.llm.calls[0][1].ignore_eos is True and be.llm.calls[0][1].stop_token_ids == stop_token_ids(tok)
    assert len(rows) == 3


def test_teacher_stage_through_vllm_writes_the_same_files(tmp_path):
    """generate_targets(backend="vllm"): the same targets rows and soft-label layout as the hf backend, resumable;
    the meta records the backend and its tensor parallelism."""
    model, tok = varied_model(), tiny_tokenizer()
    recs = records(10)
    opts = {"llm": FakeLLM(model), "sampling_params": SamplingParams, "tensor_parallel_size": 2}
    out, ref = tmp_path / "v" / "t.jsonl", tmp_path / "h" / "t.jsonl"
    kw = dict(max_new_tokens=8, batch_size=4, soft_topk=4, soft_prompt=True, progress=False)
    def stop_after_first(i, rows):  # killed right after the first flush
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        teacher.generate_targets(recs, model, tok, out, backend="vllm", vllm_options=opts, on_batch=stop_after_first,
                                 **kw)
    stats = teacher.generate_targets(recs, model, tok, out, backend="vllm", vllm_options=opts, **kw)
    assert stats["backend"] == "vllm" and stats["already_done"] == 4 and stats["written"] == 6
    teacher.generate_targets(recs, model, tok, ref, backend="hf", **kw)
    rows = {r["id"]: r for r in teacher.read_rows(out)}
    assert rows == {r["id"]: r for r in teacher.read_rows(ref)}
    soft, soft_ref = load_soft_labels(soft_dir_for(out)), load_soft_labels(soft_dir_for(ref))
    assert soft.keys() == soft_ref.keys() == rows.keys()
    for rid, r in soft.items():
        assert r.start == soft_ref[rid].start == 0 and r.ids.shape == soft_ref[rid].ids.shape
        assert len(r) == len(rows[rid]["prompt_ids"]) - 1 + len(rows[rid]["continuation_ids"])
        torch.testing.assert_close(r.logprobs.float(), soft_ref[rid].logprobs.float(), atol=2e-3, rtol=1e-3)
    meta = json.loads(teacher.meta_path(out).read_text())
    assert meta["generation"]["backend"] == "vllm" and meta["generation"]["tensor_parallel_size"] == 2
    assert meta["output"]["rows"] == 10 and meta["output"]["soft"]["rows"] == 10
    assert "backend" not in json.loads(teacher.meta_path(ref).read_text())["generation"]
    # a vllm file is not resumed by another backend (its kernels give other bits)
    with pytest.raises(ValueError, match="different generation"):
        teacher.generate_targets(recs, model, tok, out, backend="hf", **kw)


def test_vllm_backend_needs_a_model_folder_and_says_how_to_get_vllm(tmp_path, monkeypatch):
    model, tok = tiny_model(), tiny_tokenizer()
    with pytest.raises(ValueError, match="HF folder"):
        make_backend("vllm", model, tok)
    model.save_pretrained(tmp_path / "m")
    model.config._name_or_path = str(tmp_path / "m")
    with pytest.raises(ValueError, match="native backend"):
        make_backend("vllm", model, tok, dtype="bfloat16")
    with pytest.raises(ValueError, match="vllm backend"):
        make_backend("hf", model, tok, vllm_options={"tensor_parallel_size": 2})
    if importlib.util.find_spec("vllm") is None:
        # without vllm the teacher stage stops before it writes anything
        out = tmp_path / "t" / "targets.jsonl"
        with pytest.raises(ImportError, match="pip install vllm"):
            teacher.generate_targets(records(2), model, tok, out, backend="vllm", progress=False)
        assert not out.exists() and not teacher.meta_path(out).exists()
        monkeypatch.setattr(vb, "require_vllm", lambda: None)
    be = make_backend("vllm", model, tok, vllm_options={"tensor_parallel_size": 2})
    assert (be.model_path, be.dtype, be.tensor_parallel_size) == (str(tmp_path / "m"), "float32", 2)


def test_engine_arguments(monkeypatch):
    """The engine is made on the first stream: the teacher's folder and dtype, tensor parallelism, room for K
    log-probs, batch_size sequences at once, and no prefix caching when prompt log-probs are asked for."""
    made = []

    def fake_make_llm(path, **kw):
        made.append((path, kw))
        return FakeLLM(tiny_model())

    monkeypatch.setattr(vb, "make_llm", fake_make_llm)
    monkeypatch.setattr(vb, "require_vllm", lambda: None)
    tok = tiny_tokenizer()
    be = vb.VLLMBackend("teacher/", tensor_parallel_size=2, dtype="bfloat16", sampling_params=SamplingParams)
    assert not made
    list(be.stream(_prompts(tok, 2), 3, stop_token_ids(tok), batch_size=64, top_k=24, prompt_top_k=True))
    list(be.stream(_prompts(tok, 2), 3, stop_token_ids(tok), batch_size=64, top_k=24, prompt_top_k=True))
    assert made == [("teacher/", {"tensor_parallel_size": 2, "dtype": "bfloat16", "revision": None,
                                  "max_logprobs": 24, "max_num_seqs": 64, "enable_prefix_caching": False})]
    made.clear()
    list(vb.VLLMBackend("t", sampling_params=SamplingParams).stream(_prompts(tok, 1), 2, [2], 8, top_k=4))
    assert "enable_prefix_caching" not in made[0][1]


# ------------------------------------------------------------------ real vLLM (GPU machines)

HAVE_VLLM_GPU = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM_GPU, reason="needs the vllm package and a CUDA GPU (pip install vllm on a GPU "
                    "machine); the vllm teacher path is untested until such a run is recorded (docs/scale_out.md)")
def test_real_vllm_matches_hf_on_a_tiny_model(tmp_path):
    from drafter_lib.model.tiny_models import tiny_random_model

    model, tok = tiny_random_model("llama", tokenizer="bytes", seed=0, hidden_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=512)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    from drafter_lib.model import hf_models

    model, tok = hf_models.load_teacher(str(tmp_path / "teacher"), dtype=torch.bfloat16)
    recs = records(12)
    kw = dict(max_new_tokens=16, batch_size=8, soft_topk=8, soft_prompt=True, progress=False)
    teacher.generate_targets(recs, model, tok, tmp_path / "v.jsonl", backend="vllm",
                             vllm_options={"tensor_parallel_size": 1, "gpu_memory_utilization": 0.3,
                                           "enforce_eager": True}, **kw)
    teacher.generate_targets(recs, model.to("cuda"), tok, tmp_path / "h.jsonl", backend="hf", **kw)
    v = {r["id"]: r for r in teacher.read_rows(tmp_path / "v.jsonl")}
    h = {r["id"]: r for r in teacher.read_rows(tmp_path / "h.jsonl")}
    assert v.keys() == h.keys() and all(v[i]["prompt_ids"] == h[i]["prompt_ids"] for i in v)
    same = [i for i in v if v[i]["continuation_ids"] == h[i]["continuation_ids"]]
    assert len(same) >= len(v) // 2, "bf16 kernels may split near-ties, but most greedy rows must agree"
    sv, sh = load_soft_labels(soft_dir_for(tmp_path / "v.jsonl")), load_soft_labels(soft_dir_for(tmp_path / "h.jsonl"))
    for i in same:
        assert sv[i].start == sh[i].start == 0 and sv[i].ids.shape == sh[i].ids.shape
        assert (sv[i].ids[:, 0] == sh[i].ids[:, 0]).float().mean() > 0.9
        torch.testing.assert_close(sv[i].logprobs[:, 0].float(), sh[i].logprobs[:, 0].float(), atol=0.1, rtol=0.05)


def test_stand_ins_have_vllms_field_names():
    """The stand-ins keep vLLM's names (read from vllm/outputs.py, vllm/logprobs.py, vllm/sampling_params.py)."""
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]
    assert [f.name for f in dataclasses.fields(CompletionOutput)][:5] == ["index", "text", "token_ids",
                                                                          "cumulative_logprob", "logprobs"]
    if importlib.util.find_spec("vllm") is not None:  # where vllm is installed, check against it
        import vllm.outputs

        real = [f.name for f in dataclasses.fields(vllm.outputs.CompletionOutput)]
        assert real[:5] == [f.name for f in dataclasses.fields(CompletionOutput)][:5]
        import vllm

        vllm.SamplingParams(**vb.sampling_kwargs(4, [2], top_k=3, prompt_top_k=True))
