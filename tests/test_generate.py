"""greedy_generate / verify_greedy vs transformers greedy generate on a tiny random model."""
import pytest
import torch
from test_model import tiny_hf

from drafter_lib.generate import greedy_generate, verify_greedy
from drafter_lib.model import Transformer


def hf_greedy(hf, prompt, n, stop=None):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
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
    n, toks = verify_greedy(ours, ctx, target[:7])
    assert n == 7 and toks == target[:8]
    # wrong 4th token: 3 accepted, the target's correction at index 3
    bad = target[:7].copy()
    bad[3] = (bad[3] + 1) % 61
    n, toks = verify_greedy(ours, ctx, bad)
    assert n == 3 and toks[:4] == target[:4]
    # with a cache reused across steps (speculative loop) = plain greedy output
    cache = ours.new_cache(1, 8)
    seq, cached = list(ctx), 0
    while len(seq) < len(ctx) + 8:
        draft = [5, 6, 7] if len(seq) % 2 else target[len(seq) - len(ctx):len(seq) - len(ctx) + 3]
        n, toks = verify_greedy(ours, seq, draft, cache=cache, cached_len=cached)
        seq += draft[:n] + [toks[n]]
        cached = len(seq) - 1  # cache holds everything but the bonus token
    assert seq[len(ctx):len(ctx) + 8] == target
