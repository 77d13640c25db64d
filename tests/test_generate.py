"""greedy_generate / verify_draft_on_model vs transformers greedy generate on a tiny random model."""
import pytest
import torch
from test_model import tiny_hf

from drafter_lib.decoding.generate import greedy_generate, verify_draft_on_model
from drafter_lib.model.transformer import Transformer


def hf_greedy(hf, prompt, n, stop=None):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def models(request):
    hf = tiny_hf(request.param, tie_word_embeddings=True, vocab_size=61, num_hidden_layers=2)
    hf.generation_config.eos_token_id = None
    return hf, Transformer.from_hf(hf.config.to_dict(), hf.state_dict())


def test_greedy_generate_matches_hf(models):
    hf, ours = models
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (5, 23, 1, 11, 40)]
    got = greedy_generate(ours, prompts, 12, batch_size=3)
    for p, out in zip(prompts, got):
        assert out == hf_greedy(hf, p, 12)


def test_stop_ids_end_rows_individually(models):
    hf, ours = models
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (7, 19, 3, 30)]
    free = greedy_generate(ours, prompts, 15)
    # pick a stop token that occurs mid-way in some row's free run
    stop = free[0][4]
    got = greedy_generate(ours, prompts, 15, stop_ids=[stop])
    stopped_early = 0
    for p, f, out in zip(prompts, free, got):
        if stop in f:
            assert out == f[: f.index(stop) + 1]
            stopped_early += 1
        else:
            assert out == f
        assert out == hf_greedy(hf, p, 15, stop=stop)
    assert stopped_early >= 1


def test_generate_bad_input(models):
    _, ours = models
    with pytest.raises(ValueError, match="empty"):
        greedy_generate(ours, [[]], 3)
    with pytest.raises(ValueError, match="vocabulary"):
        greedy_generate(ours, [[1, 61]], 3)


def test_verify_greedy(models):
    _, ours = models
    ctx = list(range(3, 20))
    target = greedy_generate(ours, [ctx], 8)[0]
    # perfect draft: all accepted, bonus token = the 9th greedy token
    n, toks = verify_draft_on_model(ours, ctx, target[:7])
    assert n == 7 and toks == target[:8]
    # wrong 4th token: 3 accepted, the target's correction at index 3
    bad = target[:7].copy()
    bad[3] = (bad[3] + 1) % 61
    n, toks = verify_draft_on_model(ours, ctx, bad)
    assert n == 3 and toks[:4] == target[:4]
    # with a cache reused across steps (speculative loop) = plain greedy output
    cache = ours.new_cache(1, 8)
    seq, cached = list(ctx), 0
    while len(seq) < len(ctx) + 8:
        draft = [5, 6, 7] if len(seq) % 2 else target[len(seq) - len(ctx):len(seq) - len(ctx) + 3]
        n, toks = verify_draft_on_model(ours, seq, draft, cache=cache, cached_len=cached)
        seq += draft[:n] + [toks[n]]
        cached = len(seq) - 1  # cache holds everything but the bonus token
    assert seq[len(ctx):len(ctx) + 8] == target


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def lively(request):
    """Larger random weights: continuations that do not just repeat one token, so stops land at many steps."""
    hf = tiny_hf(request.param, tie_word_embeddings=True, vocab_size=61, num_hidden_layers=2, initializer_range=0.3)
    hf.generation_config.eos_token_id = None
    return hf, Transformer.from_hf(hf.config.to_dict(), hf.state_dict())


def test_continuous_batching_equals_static_and_hf(lively):
    """More prompts than slots: finished rows are refilled mid-run; rows equal the static schedule and HF."""
    from drafter_lib.decoding.generate import stream_generate

    hf, ours = lively
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 61, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (11,), generator=g)]
    free = greedy_generate(ours, prompts, 14, batch_size=11)

    def spread(t):  # distinct row lengths if t were the stop token
        return len({f.index(t) if t in f else 14 for f in free})

    stop = [max(range(61), key=spread)]  # the stop token that ends rows at the most different steps
    cont = list(stream_generate(ours, prompts, 14, stop, batch_size=3))
    static = list(stream_generate(ours, prompts, 14, stop, batch_size=3, refill=False))
    assert sorted(f.index for f in cont) == list(range(11)) == sorted(f.index for f in static)
    by_c, by_s = {f.index: f.tokens for f in cont}, {f.index: f.tokens for f in static}
    lengths = set()
    for i, p in enumerate(prompts):
        want = teacher_cut(hf_greedy(hf, p, 14, stop=stop), stop)
        assert by_c[i] == by_s[i] == want, i
        lengths.add(len(want))
    assert len(lengths) >= 3  # the schedule was really exercised
    assert [f.index for f in cont] != sorted(f.index for f in cont) or len(lengths) == 1  # yielded as they finish


def test_shared_prefills_change_no_row(lively, monkeypatch):
    """Waiting prompts prefilled together (right-padded; refills wait for a group of free slots), one by one, or
    alone because they are long: the same rows and soft labels, equal to HF greedy."""
    from drafter_lib.decoding import generate

    hf, ours = lively
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 61, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (44,), generator=g)]
    free = greedy_generate(ours, prompts, 12, batch_size=44)
    stop = [max(range(61), key=lambda t: len({f.index(t) if t in f else 12 for f in free}))]  # ends rows at many steps
    groups = []

    def spy(model, cache, rows, ps, **kw):
        groups.append(len(ps))
        return prefill_rows(model, cache, rows, ps, **kw)

    prefill_rows = generate.prefill_rows
    monkeypatch.setattr(generate, "prefill_rows", spy)
    runs = {}
    for name, kw in {"shared": {}, "one by one": dict(prefill_group=1), "long alone": dict(prefill_tokens=20)}.items():
        groups.clear()
        runs[name] = {f.index: f for f in generate.stream_generate(ours, prompts, 12, stop, batch_size=32, topk=4,
                                                                   prompt_topk=True, **kw)}
        sizes = list(groups)
        if name == "shared":  # 32 slots: refills wait for 2 free ones and share their prefill, 8 at most
            assert sum(sizes[:4]) == 32 and 2 in sizes[4:] and max(sizes) == 8
        elif name == "one by one":
            assert set(sizes) == {1}
        else:
            assert sum(sizes) < len(prompts)  # the prompts over 20 tokens went through prefill_row
    lengths = assert_runs_equal_hf(hf, prompts, 12, stop, runs, "one by one")
    assert len(lengths) >= 3  # rows finished at different steps: the refills were exercised


def test_row_blocks_sorted_by_position_change_no_row(lively, monkeypatch):
    """Decode attention per block of rows, each reading keys up to its own longest position, with the slots (and
    the cache's rows) re-sorted by position every few steps: the same rows and soft labels as one block over the
    whole batch, equal to HF greedy, while reading far fewer keys."""
    from drafter_lib.decoding import generate
    from drafter_lib.model.kv_cache import KVCache
    from drafter_lib.model.transformer import Attention

    hf, ours = lively
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 61, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (30,), generator=g)]
    free = greedy_generate(ours, prompts, 16, batch_size=30)
    stop = [max(range(61), key=lambda t: len({f.index(t) if t in f else 16 for f in free}))]
    keys_read, orders = [], []
    attend, select_rows = Attention._attend, KVCache.select_rows

    def count(self, q, k, v, mask):
        if q.shape[2] == 1 and self.layer_idx == 0:  # decode steps: rows x keys read
            keys_read[-1] += q.shape[0] * k.shape[2]
        return attend(self, q, k, v, mask)

    def record(self, rows):
        orders.append(list(rows))
        return select_rows(self, rows)

    monkeypatch.setattr(Attention, "_attend", count)
    monkeypatch.setattr(KVCache, "select_rows", record)
    runs, reorders = {}, {}
    for name, kw in {"blocks": dict(row_blocks=4, resort_every=3), "one block": dict(row_blocks=0)}.items():
        keys_read.append(0)
        orders.clear()
        runs[name] = {f.index: f for f in generate.stream_generate(ours, prompts, 16, stop, batch_size=12, topk=4,
                                                                   prompt_topk=True, **kw)}
        reorders[name] = sum(o != sorted(o) for o in orders)
    assert reorders == {"blocks": reorders["blocks"], "one block": 0} and reorders["blocks"] >= 3
    assert keys_read[0] < 0.9 * keys_read[1]  # here 0.88; blocks without the re-sorts: 0.92
    lengths = assert_runs_equal_hf(hf, prompts, 16, stop, runs, "one block")
    assert len(lengths) >= 3  # rows finished at different steps: slots were refilled between re-sorts


def assert_runs_equal_hf(hf, prompts, n, stop, runs, ref_name):
    """Every run's rows {index: Finished} equal HF greedy (cut at the stop token), with the soft labels of
    `runs[ref_name]`; returns the set of row lengths (how varied the finishing steps were)."""
    lengths = set()
    for i, p in enumerate(prompts):
        want = teacher_cut(hf_greedy(hf, p, n, stop=stop), stop)
        lengths.add(len(want))
        for name, rows in runs.items():
            f, ref = rows[i], runs[ref_name][i]
            assert f.tokens == want, (name, i)
            assert torch.equal(f.soft_ids, ref.soft_ids), (name, i)
            torch.testing.assert_close(f.soft_logprobs, ref.soft_logprobs, atol=1e-5, rtol=0)
    return lengths


def teacher_cut(tokens, stop):
    for j, t in enumerate(tokens):
        if t in stop:
            return tokens[:j + 1]
    return tokens


def test_stream_soft_labels_equal_full_logits(lively):
    """top-K at every prompt and continuation position == top-K of HF's full-sequence logits (teacher forcing)."""
    from drafter_lib.decoding.generate import stream_generate

    hf, ours = lively
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (6, 1, 17, 9, 12)]
    K = 5
    for prompt_topk in (False, True):
        for f in stream_generate(ours, prompts, 8, (), batch_size=2, topk=K, prompt_topk=prompt_topk):
            p = prompts[f.index]
            seq = p + f.tokens
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
            start = 0 if prompt_topk else len(p) - 1
            assert f.soft_start == start and f.soft_ids.shape == (len(seq) - 1 - start, K)
            assert f.soft_ids.dtype == torch.int32
            want = ref[start:len(seq) - 1]
            torch.testing.assert_close(f.soft_logprobs, want.topk(K, -1).values, atol=1e-4, rtol=0)
            torch.testing.assert_close(want.gather(1, f.soft_ids.long()), f.soft_logprobs, atol=1e-4, rtol=0)
            # the greedy token is the top-1 of the distribution that produced it
            assert f.soft_ids[len(p) - 1 - start:, 0].tolist() == f.tokens
