"""sliced_head: the head in vocabulary slices equals the whole product, is held only where it is exact and faster,
and the teacher's generation with it equals generation without it."""
import json

import pytest
import torch
import torch.nn.functional as F
from test_model import tiny_hf

from drafter_lib.common import measured_choice
from drafter_lib.decoding import sliced_head
from drafter_lib.decoding.generate import stream_generate
from drafter_lib.decoding.sliced_head import SlicedHead, choose_slice, hold_sliced_head
from drafter_lib.model.transformer import Transformer


def test_slices_cover_the_whole_product():
    """Slices that do not divide the vocabulary, leading batch dims: the same values as one product."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 24, generator=g)
    x = torch.randn(3, 5, 24, generator=g)
    for rows in (1, 7, 256, 999, 1000, 4096):
        out = SlicedHead(w, rows)(x)
        assert out.shape == (3, 5, 1000)
        torch.testing.assert_close(out, F.linear(x, w))  # fp32 tolerances: the sum order may differ


def test_a_slice_size_is_held_only_where_exact_and_faster(monkeypatch):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8192, 64, generator=g)
    fake = {"whole": 1.0, "slices:512": 0.5, "slices:1024": 0.97, "slices:2048": 0.6, "slices:4096": 0.7}
    timed = []

    def timings(calls, rounds):
        timed.append(sorted(calls))
        for f in calls.values():
            f()
        return {k: fake[k] for k in calls}

    class OtherOrderAt512(SlicedHead):  # as if this machine's BLAS summed 512-wide products in another order
        def forward(self, x):
            out = super().forward(x)
            return out + 1e-6 * out.abs().max() if self.rows == 512 else out

    monkeypatch.setattr(sliced_head, "interleaved_median", timings)
    monkeypatch.setattr(sliced_head, "SlicedHead", OtherOrderAt512)
    choice = choose_slice(w, batch_rows=16)
    assert timed == [["slices:1024", "slices:2048", "slices:4096", "whole"]]  # 512 was never a candidate
    assert choice["path"] == "slices:2048"
    # cached per machine: a second choice times nothing
    assert choose_slice(w, batch_rows=16)["path"] == "slices:2048" and len(timed) == 1
    entry = json.loads(measured_choice.cache_file().read_text())[measured_choice.machine_key()]
    assert any(k.startswith("head 8192x64") for k in entry)
    # within MIN_GAIN of the whole product: keep the whole product
    fake.update({"slices:1024": 0.97, "slices:2048": 0.98, "slices:4096": 0.99})
    assert choose_slice(w, batch_rows=17)["path"] == "whole"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_generation_with_a_sliced_head_is_unchanged(arch, monkeypatch):
    """The tied head held in slices (forced): logits, greedy rows and soft labels equal the unsliced model's, and
    the slices read the embedding itself (no copy)."""
    hf = tiny_hf(arch, tie_word_embeddings=True, vocab_size=300, num_hidden_layers=2, initializer_range=0.3)
    plain = Transformer.from_hf(hf.config.to_dict(), hf.state_dict())
    sliced = Transformer.from_hf(hf.config.to_dict(), hf.state_dict())
    monkeypatch.setattr(sliced_head, "choose_slice", lambda w, rows: dict(path="slices:64"))
    assert hold_sliced_head(sliced)["path"] == "slices:64"
    assert isinstance(sliced.lm_head, SlicedHead) and sliced.lm_head.weight is sliced.model.embed_tokens.weight
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (9,), generator=g)]
    ids = torch.tensor([prompts[0][:5]])
    with torch.no_grad():
        torch.testing.assert_close(sliced(ids, torch.arange(5)[None]), plain(ids, torch.arange(5)[None]),
                                   rtol=1e-6, atol=1e-6)
    runs = [{f.index: f for f in stream_generate(m, prompts, 10, (), batch_size=4, topk=3, prompt_topk=True)}
            for m in (plain, sliced)]
    for i in range(len(prompts)):
        assert runs[0][i].tokens == runs[1][i].tokens
        assert torch.equal(runs[0][i].soft_ids, runs[1][i].soft_ids)
        torch.testing.assert_close(runs[0][i].soft_logprobs, runs[1][i].soft_logprobs, rtol=0, atol=1e-5)


def test_low_precision_heads_are_left_alone():
    hf = tiny_hf("llama", tie_word_embeddings=True)
    m = Transformer.from_hf(hf.config.to_dict(), hf.state_dict()).to(torch.bfloat16)
    assert hold_sliced_head(m)["path"] == "whole" and not isinstance(m.lm_head, SlicedHead)
