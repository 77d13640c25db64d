"""DraftEngine: greedy equality with transformers, prefix cache reuse, batching, copy prior, errors."""
import pytest
import torch
from test_model import tiny_hf

from drafter_lib.decoding.generate import greedy_generate
from drafter_lib.engine.draft_engine import DraftEngine

V = 61


@pytest.fixture(scope="module")
def hf():
    m = tiny_hf("llama", vocab_size=V, num_hidden_layers=2, tie_word_embeddings=True)
    m.generation_config.eos_token_id = None
    return m


def make_engine(hf, **kw):
    kw.setdefault("dtype", "float32")
    return DraftEngine.from_state_dict(hf.config.to_dict(), hf.state_dict(), **kw)


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rand_tokens(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_draft_equals_hf_generate(hf):
    eng = make_engine(hf)
    for seed, n in enumerate((1, 9, 37)):
        p = rand_tokens(n, seed)
        assert eng.draft(p, k=16) == hf_greedy(hf, p, 16)


def test_warm_cache_equals_cold_and_reuses_prefix(hf):
    eng = make_engine(hf)
    p = rand_tokens(50, 3)
    d1 = eng.draft(p, 8)
    computed = eng.stats["computed_tokens"]
    assert computed == 50 + 7  # prompt + the 7 draft tokens fed back
    # the next request = prompt + 3 accepted draft tokens + a bonus token: only the tail is computed
    nxt = p + d1[:3] + [5]
    warm = eng.draft(nxt, 8)
    assert eng.stats["computed_tokens"] - computed == 1 + 7  # bonus token + 7 draft steps
    assert eng.stats["reused_tokens"] == 53
    assert eng.cache_info()["entries"] == 1  # the loop's entry was taken over in place, not copied and kept
    cold = make_engine(hf).draft(nxt, 8)
    assert warm == cold == hf_greedy(hf, nxt, 8)


def test_shared_prefix_branch_copies_and_keeps_entry(hf):
    eng = make_engine(hf)
    system = rand_tokens(40, 4)
    a, b = system + rand_tokens(5, 5), system + rand_tokens(6, 6)
    da = eng.draft(a, 4)
    before = eng.stats["computed_tokens"]
    db = eng.draft(b, 4)
    assert eng.stats["computed_tokens"] - before == 6 + 3  # only b's own tail is computed
    assert db == make_engine(hf).draft(b, 4)
    assert eng.cache_info()["entries"] == 2  # a branch copies the shared part and keeps the original entry
    before = eng.stats["computed_tokens"]
    assert eng.draft(a, 4) == da  # a's entry survived the branch: only the last token recomputed
    assert eng.stats["computed_tokens"] - before == 1 + 3


def test_cache_bound_evicts(hf):
    eng = make_engine(hf, max_cache_tokens=300)
    for s in range(6):
        eng.draft(rand_tokens(100, 10 + s), 4)
    info = eng.cache_info()
    assert info["cached_token_slots"] <= 300 and info["evictions"] >= 1


def test_draft_batch_equals_sequential(hf):
    reqs = [rand_tokens(n, 20 + n) for n in (3, 30, 12, 1)]
    for dtype in ("float32", "float16"):
        seq = [make_engine(hf, dtype=dtype).draft(r, 10) for r in reqs]
        assert make_engine(hf, dtype=dtype).draft_batch(reqs, 10) == seq
    # more rows than Linear.small_m: fp16 decode must still give each row the bits it gets alone
    # (weights with std 0.3 so that logits are far from uniform and rounding differences do flip tokens)
    sharp = tiny_hf("llama", vocab_size=V, num_hidden_layers=2, tie_word_embeddings=True)
    with torch.no_grad():
        for p in sharp.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    many = [rand_tokens(5 + 3 * i, 40 + i) for i in range(9)]
    seq16 = [make_engine(sharp, dtype="float16").draft(r, 10) for r in many]
    assert make_engine(sharp, dtype="float16").draft_batch(many, 10) == seq16
    # and the batched path leaves correct caches behind
    eng = make_engine(hf)
    eng.draft_batch(reqs, 10)
    before = eng.stats["computed_tokens"]
    ext = reqs[1] + seq[1][:4] + [7]
    assert eng.draft(ext, 10) == greedy_generate(eng.model, [ext], 10)[0]
    assert eng.stats["computed_tokens"] - before == 1 + 9


def test_short_feeds_share_one_prefill_pass(hf):
    """The next step of several speculative loops (a few uncached tokens each) runs as one padded pass, and each
    row drafts what it drafts alone and cold (the transformers greedy continuation)."""
    eng = make_engine(hf)
    reqs = [rand_tokens(n, 60 + n) for n in (20, 25, 33)]
    eng.draft_batch(reqs, 8)
    ext = [r + [5] + [6] * i for i, r in enumerate(reqs)]  # uncached tails of 1, 2 and 3 tokens
    shapes, hidden = [], eng.model.hidden

    def spy(ids, pos, cache=None, last_only=False):
        shapes.append(tuple(ids.shape))
        return hidden(ids, pos, cache, last_only)

    eng.model.hidden = spy
    got = eng.draft_batch(ext, 8)
    assert got == [hf_greedy(hf, e, 8) for e in ext]
    assert [d.cached_prefix_len for d in got] == [len(r) for r in reqs]
    assert shapes == [(3, 3)] + [(3, 1)] * 7  # one prefill pass (padded to the longest tail), then decode steps


def test_fp16_engine_close_to_fp32(hf):
    p = rand_tokens(30, 7)
    d16, d32 = make_engine(hf, dtype="float16").draft(p, 16), make_engine(hf).draft(p, 16)
    assert sum(a == b for a, b in zip(d16, d32)) >= 8  # fp16 weights: near-ties may flip late tokens


def test_copy_prior_modes(hf):
    p = rand_tokens(20, 8)
    req = p + p[:3]  # suffix p[:3] occurred at the start -> copy proposes p[3:]
    plain = make_engine(hf).draft(req, 12)
    off = make_engine(hf, copy_policy={"enabled": False, "min_ngram": 2}).draft(req, 12)
    assert off == plain
    pol = {"enabled": True, "max_ngram": 3, "min_ngram": 2, "max_copy": 5, "mode": "prefix"}
    pre = make_engine(hf, copy_policy=pol).draft(req, 12)
    assert pre[:5] == p[3:8]
    # after the copied tokens the model continues greedily from request + copy
    assert pre[5:] == greedy_generate(make_engine(hf).model, [req + p[3:8]], 7)[0]
    # accelerate: identical output to plain greedy, fewer forward calls when the guess is right
    acc = make_engine(hf, copy_policy={**pol, "mode": "accelerate", "max_copy": 16})
    assert acc.draft(req, 12) == plain
    rep = p * 3  # the model's own greedy output rarely copies; check a case where guesses are right
    g = greedy_generate(make_engine(hf).model, [rep], 12)[0]
    assert acc.draft(rep, 12) == g


def test_bad_input(hf):
    eng = make_engine(hf)
    with pytest.raises(ValueError, match="empty"):
        eng.draft([], 4)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.draft([1, V], 4)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.draft([-1], 4)
    with pytest.raises(ValueError, match="maximum context"):
        eng.draft([1] * eng.max_context, 4)
    assert eng.draft([1, 2], 0) == []
    info = eng.info()
    assert info["vocab_size"] == V and info["config"]["arch"] == "llama" and info["dtype"] == "float32"


def test_loads_packed_model_dir(hf, tmp_path):
    md = pytest.importorskip("drafter_lib.packed.model_dir")
    q = pytest.importorskip("drafter_lib.quantization")
    qc = q.QuantConfig.default_for(group_size=16)
    md.write_model_dir(tmp_path / "m", hf.config.to_dict(), hf.state_dict(), qc,
                       copy_policy={"enabled": True, "max_ngram": 3, "min_ngram": 2, "max_copy": 4, "mode": "prefix"})
    eng = DraftEngine.from_dir(tmp_path / "m", dtype="float32")
    packed = md.read_model_dir(tmp_path / "m")
    ref = DraftEngine.from_state_dict(packed.config, packed.state_dict, copy_policy=packed.copy_policy)
    p = rand_tokens(25, 9)
    assert eng.draft(p, 8) == ref.draft(p, 8)
    assert eng.info()["manifest_sha256"] == packed.manifest_sha256 and eng.copy_policy.enabled
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight


def test_int8_mode_close_and_small(hf):
    from drafter_lib.engine.weight_formats import weight_bytes

    e8, e32 = make_engine(hf, dtype="int8"), make_engine(hf)
    assert weight_bytes(e8.model) < 0.4 * weight_bytes(e32.model)
    agree = total = 0
    for s in range(4):
        p = rand_tokens(20, 40 + s)
        a, b = e8.draft(p, 8), e32.draft(p, 8)
        agree += sum(x == y for x, y in zip(a, b)) if a[0] == b[0] else 0
        total += 8
        assert e8.draft_batch([p, p[:5]], 8)[0] == a  # batched int8 decode = single
    assert agree >= total // 2


def test_int8_head_argmax_is_exact():
    """The int8 pre-pass only prunes candidates: the argmax equals that of the full fp32 logits."""
    from drafter_lib.engine.weight_formats import Int8Head, int8_rows
    g = torch.Generator().manual_seed(0)
    q, scale = int8_rows(torch.randn(4096, 96, generator=g) * 0.05)
    head = Int8Head(q, scale)
    w = q.float() * scale
    x = torch.randn(300, 96, generator=g)
    x[:100] *= 0.01  # flat logits: many near-ties the candidate set must keep
    assert torch.equal(head.argmax(x), (x @ w.t()).argmax(-1))


# ------------------------------------------------------------------ one numeric path, per-request stats, bounds

def _sharp_model(std: float):
    m = tiny_hf("llama", vocab_size=V, num_hidden_layers=2, tie_word_embeddings=True)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, std, generator=torch.Generator().manual_seed(p.numel()))
    return m


@pytest.mark.parametrize("dtype", ["float16", "int8", "auto"])
def test_same_request_same_draft_whatever_cache_and_batch(dtype):
    """DESIGN: the same request gets the same draft whatever the cache state and whatever shares its batch.
    Weights with std 1 make logits sharp enough that rounding differences flip greedy tokens: with fp16
    activations for <= 4 rows and fp32 for more (the old Linear path choice), 4 of these 100 requests drafted
    differently warm than cold; with a batch-wide int8 activation scale, batches changed drafts too."""
    m = _sharp_model(1.0)
    check_same_draft_whatever_cache_and_batch(lambda: make_engine(m, dtype=dtype))


def check_same_draft_whatever_cache_and_batch(make):
    """100 speculative-loop requests: warm = again = cold, and batched (cold, then warm, other neighbours) =
    alone, for engines from `make()`."""
    import random

    loop, cold, batched = make(), make(), make()
    rng = random.Random(0)
    reqs, answers = [], []
    for i in range(100):
        p = [rng.randrange(V) for _ in range(rng.randrange(5, 60))]
        d = loop.draft(p, 12)
        nxt = p + d[:i % 5] + [rng.randrange(V)]  # the speculative loop's next request: mostly cached
        warm, again = loop.draft(nxt, 12), loop.draft(nxt, 12)
        cold.clear_cache()
        ref = cold.draft(nxt, 12)
        assert warm == again == ref, (i, len(nxt))
        reqs.append(nxt)
        answers.append(ref)
    for s in range(0, 100, 12):
        assert batched.draft_batch(reqs[s:s + 12], 12) == answers[s:s + 12]  # cold rows, shared decode batch
    for s in range(0, 100, 9):
        assert batched.draft_batch(reqs[s:s + 9], 12) == answers[s:s + 9]  # now warm rows, other neighbours


def test_draft_batch_reports_cached_prefix_len_per_request(hf):
    import json

    eng = make_engine(hf)
    a = rand_tokens(40, 11)
    first = eng.draft(a, 6)
    assert first.cached_prefix_len == 0 and first == first.tokens and json.loads(json.dumps(first)) == first
    reqs = [a[:30] + rand_tokens(5, 12),  # a branch: shares 30 tokens with a's entry (copied, entry kept)
            a + first[:2] + [3],  # the loop's next step: a + 2 accepted + bonus, all but the bonus cached
            rand_tokens(20, 13)]  # unrelated
    out = eng.draft_batch(reqs, 6)
    assert [d.cached_prefix_len for d in out] == [30, 42, 0]
    assert out == [make_engine(hf).draft(r, 6) for r in reqs]


def test_cache_bound_in_bytes_and_in_flight_groups(hf):
    probe = make_engine(hf)
    probe.draft(rand_tokens(100, 30), 4)
    entry = probe.cache_info()["cached_bytes"]  # one 100-token request's cache
    eng = make_engine(hf, max_cache_bytes=3 * entry)
    for s in range(8):
        eng.draft(rand_tokens(100, 30 + s), 4)
        assert eng.cache_info()["cached_bytes"] <= 3 * entry
    info = eng.cache_info()
    assert info["entries"] == 3 and info["evictions"] == 5 and info["peak_cache_bytes"] == 3 * entry
    assert eng.info()["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4  # layers x (K, V) x kv heads x head_dim x fp32
    small = make_engine(hf, max_cache_bytes=entry // 2)  # an entry larger than the bound is not kept
    small.draft(rand_tokens(100, 31), 4)
    assert small.cache_info()["entries"] == 0
    # in-flight: decode groups of rows x longest row <= max_batch_tokens, same drafts as one big batch
    reqs = [rand_tokens(n, 40 + n) for n in (10, 50, 20, 5, 30)]
    grouped = make_engine(hf, max_batch_tokens=100)
    assert [len(g) for g in grouped._groups(reqs, 8)] == [1, 1, 2, 1]
    assert grouped.draft_batch(reqs, 8) == make_engine(hf).draft_batch(reqs, 8)


def test_from_dir_holds_the_packed_int8_rows_as_stored(hf, tmp_path):
    from safetensors import safe_open

    from drafter_lib.model.transformer import Transformer
    from drafter_lib.packed.model_dir import read_model_dir, write_model_dir
    from drafter_lib.quantization import QuantConfig

    write_model_dir(tmp_path / "m", hf.config.to_dict(), hf.state_dict(), QuantConfig.default_for(group_size=16))
    eng = DraftEngine.from_dir(tmp_path / "m")  # the default "auto" mode
    emb = eng.model.model.embed_tokens
    name = "model.embed_tokens.weight"
    with safe_open(str(tmp_path / "m" / "weights.safetensors"), "pt") as f:
        assert torch.equal(emb.q, f.get_tensor(name + ".packed"))
        assert torch.equal(emb.scale, f.get_tensor(name + ".scale").float())
    packed = read_model_dir(tmp_path / "m")
    ids = torch.arange(V)
    assert torch.equal(emb(ids), packed.state_dict[name][ids])  # = restore_weight, bit for bit
    assert eng.model.lm_head.q is emb.q  # the tied head shares the table
    # DraftEngine(model, meta) is the constructor; a path is a TypeError pointing at from_dir
    model = Transformer.from_hf(packed.config, packed.state_dict)
    assert DraftEngine(model, {"path": "x"}).info()["path"] == "x"
    with pytest.raises(TypeError, match="from_dir"):
        DraftEngine(tmp_path / "m")
    with pytest.raises(TypeError, match="Transformer"):
        DraftEngine({"not": "a model"})


# ------------------------------------------------------------------ Qwen2: q/k/v biases in every weight format

def qwen2_with_biases():
    """A tiny Qwen2 with sharp weights (as `_sharp_model`) and q/k/v biases large enough that every draft below
    changes without them."""
    m = tiny_hf("qwen2", vocab_size=V, num_hidden_layers=2, tie_word_embeddings=True)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 2 or n.endswith(".bias"):
                p.normal_(0, 0.3 if p.dim() == 2 else 0.5, generator=torch.Generator().manual_seed(p.numel()))
    m.generation_config.eos_token_id = None
    return m


def held_state(state: dict, dtype: str) -> dict:
    """`state` with every matrix as the engine holds it in `dtype` (the int8 modes: per-row int8, the table and head
    too); biases and norms stay as they are."""
    from drafter_lib.engine.weight_formats import int8_rows

    out = {}
    for k, v in state.items():
        if v.dim() == 2 and dtype in ("int8", "int8w"):
            q, scale = int8_rows(v)
            v = q.float() * scale
        elif v.dim() == 2 and dtype != "float32":
            v = v.to(getattr(torch, dtype)).float()
        out[k] = v
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8w", "int8"])
def test_qwen2_biases_are_added_in_every_weight_format(dtype):
    """Each format keeps the q/k/v biases exact in fp32 and adds them: the engine drafts what an fp32 engine holding
    the same rounded matrices drafts, which (fp32) is transformers' greedy output; "int8", whose activations are
    rounded too, gives logits far closer to that engine's than a model without the biases does."""
    hf = qwen2_with_biases()
    state = hf.state_dict()
    eng = make_engine(hf, dtype=dtype)
    for i, layer in enumerate(eng.model.model.layers):
        att = layer.self_attn
        assert att.o_proj.bias is None
        for n in ("q_proj", "k_proj", "v_proj"):
            b = getattr(att, n).bias
            assert b.dtype == torch.float32 and torch.equal(b, state[f"model.layers.{i}.self_attn.{n}.bias"])
    ref = DraftEngine.from_state_dict(hf.config.to_dict(), held_state(state, dtype), dtype="float32")
    prompts = [rand_tokens(n, 80 + n) for n in (3, 17, 40)]
    if dtype == "int8":
        no_bias = {k: (v.zero_() if k.endswith(".bias") else v) for k, v in held_state(state, dtype).items()}
        no_bias = DraftEngine.from_state_dict(hf.config.to_dict(), no_bias, dtype="float32")
        for p in prompts:
            ids, pos = torch.tensor([p]), torch.arange(len(p))[None]
            want = ref.model(ids, pos)
            gap = (want - no_bias.model(ids, pos)).abs().max()
            assert (eng.model(ids, pos) - want).abs().max() < 0.2 * gap
        return
    drafts = [eng.draft(p, 12) for p in prompts]
    assert drafts == [ref.draft(p, 12) for p in prompts]
    assert eng.draft_batch(prompts, 12) == drafts
    assert len({tuple(d) for d in drafts}) > 1  # not degenerate: the checks above can fail
    if dtype == "float32":
        assert drafts == [hf_greedy(hf, p, 12) for p in prompts]
