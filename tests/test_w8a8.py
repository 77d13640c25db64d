"""The target runtime (decoding/runtime.py, w8a8.py, w4a8.py, Transformer.row_exact): each row's logits are
independent of the rows beside it, so speculative decoding equals this runtime's own plain greedy decoding bit for
bit."""
import random

import pytest
import torch

from drafter_lib.decoding import block_rows, w4a8, w8a8
from drafter_lib.decoding.runtime import runtime_from_model, runtime_target
from drafter_lib.decoding.speculative import FnDrafter, greedy_decode, prefill, speculative_generate, speculative_stream
from drafter_lib.decoding.tree import DraftTree
from drafter_lib.model.tiny_models import TINY_WEIGHT_SCALE
from drafter_lib.model.transformer import ROW_BUCKET, Transformer

USABLE = [k for k in w8a8.KERNELS if w8a8.kernel_unavailable(k) is None]
# the integer numerics that run here (W4A8 and gguf need their kernels built: a C++ compiler; W4A8 also AVX2)
INTEGER_NUMERICS = (["w8a8"] + (["w4a8"] if w4a8.kernel_unavailable() is None else [])
                    + (["gguf"] if block_rows.kernel_unavailable() is None else []))


def _runtime(tiny_random, arch: str, kernel: str | None = None, numerics: str = "w8a8"):
    hf, _ = tiny_random(arch, seed=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128)
    model = Transformer.from_hf_model(hf)
    with torch.no_grad():  # sharper weights: varied greedy continuations (tiny_models.TINY_WEIGHT_SCALE)
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.mul_(TINY_WEIGHT_SCALE)
    return runtime_target(model, numerics, kernel)


@pytest.mark.parametrize("kernel", USABLE)
def test_w8a8_linear_is_the_exact_integer_product(kernel):
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 96), torch.randn(48), torch.randn(2, 5, 96) * 3
    lin = w8a8.W8A8Linear(w, b, kernel)
    xq, scale = w8a8.quantize_rows(x.reshape(-1, 96), lin.qmax)
    assert xq.abs().max() <= lin.qmax and torch.equal(xq, xq.round())
    sums = xq.double() @ lin.qweight.double().t()  # exact integers
    want = (sums * lin.weight_scale.double() * scale.double() + b.double()).reshape(2, 5, 48)
    torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-5)
    # and close to the float product it stands for
    assert (lin(x) - x @ w.t() - b).abs().max() < 0.05 * (x @ w.t()).abs().max()


@pytest.mark.parametrize("kernel", USABLE)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kernel):
    torch.manual_seed(1)
    lin = w8a8.W8A8Linear(torch.randn(64, 128), None, kernel)
    rows = torch.randn(17, 128)
    alone = torch.cat([lin(rows[i:i + 1]) for i in range(17)])
    assert torch.equal(lin(rows), alone)
    other = rows.clone()
    other[1:] = torch.randn(16, 128) * 100  # very different neighbours
    assert torch.equal(lin(other)[0], alone[0])


@pytest.mark.parametrize("numerics", INTEGER_NUMERICS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_verify_pass_logits_equal_one_token_steps_bit_for_bit(tiny_random, arch, numerics):
    target = _runtime(tiny_random, arch, numerics=numerics)
    gen = torch.Generator().manual_seed(2)
    context = torch.randint(0, 259, (ROW_BUCKET - 6,), generator=gen).tolist()  # the pass straddles a key block
    feed = torch.randint(0, 259, (17,), generator=gen).tolist()
    target.reset()
    target.score(context, keep=1)
    one_by_one = torch.cat([target.score([t], keep=1) for t in feed])
    for k in (1, 4, 16):
        target.rollback(len(context))
        together = target.score(feed[:k + 1], keep=k + 1)
        assert torch.equal(together, one_by_one[:k + 1]), k
    target.rollback(len(context))  # row 0 beside other drafts: its logits stay the same
    beside = target.score([feed[0]] + torch.randint(0, 259, (8,), generator=gen).tolist(), keep=9)
    assert torch.equal(beside[0], one_by_one[0])


@pytest.mark.parametrize("numerics", INTEGER_NUMERICS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompt_read_in_chunks_leaves_the_bits_of_one_pass(tiny_random, arch, numerics):
    """prefill's passes (the server's GENERATION_PREFILL_CHUNK) write the K/V of one pass over the whole prompt, bit
    for bit, and the step after them gets the same logits, whatever the chunk (chunks that end inside key blocks,
    on their ends, one token each)."""
    target = _runtime(tiny_random, arch, numerics=numerics)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 259, (2 * ROW_BUCKET + 13,), generator=gen).tolist()
    feed = torch.randint(0, 259, (9,), generator=gen).tolist()  # the first step: a draft after the prompt's rest
    target.reset()
    whole = target.score(prompt + feed, keep=len(feed) + 1)  # one pass (NativeTarget splits at 512 tokens only)
    n = len(prompt) + len(feed)
    kv = [t[..., :n, :].clone() for t in target.cache.k + target.cache.v]
    for chunk in (1, 5, ROW_BUCKET, 100, len(prompt)):
        passes = list(prefill(target, prompt, chunk))
        assert passes == list(range(chunk, len(prompt), chunk))  # the tokens cached after each pass
        rest = len(prompt) - (passes[-1] if passes else 0)
        assert 1 <= rest <= chunk  # the first step reads the rest with its draft
        assert torch.equal(target.score(prompt[len(prompt) - rest:] + feed, keep=len(feed) + 1), whole), chunk
        assert all(torch.equal(a[..., :n, :], b) for a, b in zip(target.cache.k + target.cache.v, kv)), chunk
    assert not list(prefill(target, prompt, len(prompt)))  # a prompt of one chunk: no pass before the first step
    target.reset()
    with pytest.raises(ValueError, match="prefilled=3"):  # the loop checks what the cache holds
        speculative_stream(target, prompt, 4, prefilled=3)


def _adversaries(plain: list[int], prompt_len: int, vocab: int):
    rnd = random.Random(0)
    return {
        "random": lambda ctx, k: [rnd.randrange(vocab) for _ in range(k)],
        "always wrong": lambda ctx, k: [(t + 1) % vocab for t in plain[len(ctx) - prompt_len:][:k]] or [0] * k,
        "always right": lambda ctx, k: plain[len(ctx) - prompt_len:][:k],
    }


@pytest.mark.parametrize("numerics", INTEGER_NUMERICS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_speculative_equals_plain_for_every_draft_length_and_drafter(tiny_random, arch, numerics):
    target = _runtime(tiny_random, arch, numerics=numerics)
    prompt = list(range(40, 100))
    plain = greedy_decode(target, prompt, 80)
    assert len(set(plain)) > 3  # a varied continuation, so wrong drafts get rejected at different places
    for name, fn in _adversaries(plain, len(prompt), 259).items():
        for k in range(1, 17):
            out = speculative_generate(target, prompt, 80, FnDrafter(fn), k=k)
            assert out.tokens == plain, (name, k)
            if name == "always right":
                assert out.mean_acceptance_length > min(k, 79) * 0.9


@pytest.mark.skipif(not USABLE, reason="no W8A8 kernel runs here")
@torch.no_grad()
def test_w8a8_keeps_qwen2_biases_in_the_fused_qkv_product(tiny_random):
    """The fused q/k/v product carries the three biases in fp32 (o_proj has none), and the W8A8 model's logits stay
    far closer to the float model's than the float model's are to itself without the biases."""
    hf, _ = tiny_random("qwen2", seed=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128)
    model, no_bias = Transformer.from_hf_model(hf), Transformer.from_hf_model(hf)
    for name, p in no_bias.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
    ids = torch.randint(0, 259, (1, 40), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(40)[None]
    want = model(ids, pos)
    gap = (want - no_bias(ids, pos)).abs().max()
    biases = [torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) for a in
              (layer.self_attn for layer in model.model.layers)]
    w8a8.quantize_linears(model, USABLE[0])
    for layer, b in zip(model.model.layers, biases):
        assert torch.equal(layer.self_attn.qkv.fused.bias, b) and layer.self_attn.o_proj.bias is None
    assert (model(ids, pos) - want).abs().max() < 0.2 * gap


def test_runtime_holds_its_tokenizer_and_stop_tokens(tiny_random):
    hf, tok = tiny_random("llama", seed=1)
    rt = runtime_from_model(Transformer.from_hf_model(hf), tok, "tiny")
    assert rt.numerics == "w8a8" and rt.model.row_exact
    assert set(rt.stop_ids) >= {tok.convert_tokens_to_ids("<|im_end|>")}
    with pytest.raises(ValueError, match="numerics"):
        runtime_from_model(Transformer.from_hf_model(hf), tok, "tiny", numerics="int3")


def test_row_exact_attention_reads_whole_key_blocks(tiny_random):
    from drafter_lib.model.kv_cache import KVCache

    model = _runtime(tiny_random, "llama").model
    assert model.new_cache(2, ROW_BUCKET + 1).capacity == 2 * ROW_BUCKET  # its caches round up to whole blocks
    cache = KVCache.for_model(model.config, 1, ROW_BUCKET + 8)
    with pytest.raises(ValueError, match=f"multiple of {ROW_BUCKET}"):
        model.hidden(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], cache)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_smoothing_keeps_the_float_model_and_evens_out_its_channels(tiny_random, arch):
    from drafter_lib.decoding.smoothing import activation_maxima, smooth

    hf, _ = tiny_random(arch, seed=4)
    model = Transformer.from_hf_model(hf)
    with torch.no_grad():  # an outlier channel, as real norms have
        for layer in model.model.layers:
            layer.input_layernorm.weight[3] = 40.0
    rows = [list(range(10, 60)), list(range(100, 130))]
    ids = torch.tensor([rows[0]])
    before, spread = model(ids, torch.arange(50)[None]), activation_maxima(model, rows)["0.attn"]
    smooth(model, rows, alpha=0.7)
    torch.testing.assert_close(model(ids, torch.arange(50)[None]), before, rtol=1e-4, atol=1e-4)
    after = activation_maxima(model, rows)["0.attn"]
    assert after.max() / after.median() < 0.5 * spread.max() / spread.median()
    with pytest.raises(ValueError, match="calibration"):
        smooth(model, [])


def _tree(rng: random.Random, n: int, shape: str, max_depth: int = 10 ** 9, vocab: int = 259) -> DraftTree:
    """A draft tree of n nodes: a deep chain, a wide fan (every node a child of the context), many siblings under
    few parents, or random parents; a node that would sit deeper than max_depth is a child of the context."""
    tokens, parents, depths = [], [], []
    for i in range(n):
        p = {"chain": i - 1, "fan": -1, "siblings": -1 if i < 2 else rng.randrange(-1, 2),
             "random": rng.randrange(-1, i)}[shape]
        if p >= 0 and depths[p] >= max_depth:
            p = -1
        depths.append(1 if p < 0 else depths[p] + 1)
        taken = {t for t, q in zip(tokens, parents) if q == p}
        t = rng.choice([v for v in range(vocab) if v not in taken])
        tokens.append(t)
        parents.append(p)
    return DraftTree(tuple(tokens), tuple(parents))


@pytest.mark.parametrize("numerics", INTEGER_NUMERICS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tree_pass_logits_equal_one_token_steps_along_each_path_bit_for_bit(tiny_random, arch, numerics):
    target = _runtime(tiny_random, arch, numerics=numerics)
    rng = random.Random(3)
    for plen, shape, n in [(ROW_BUCKET - 5, "chain", 16), (ROW_BUCKET - 3, "random", 16), (ROW_BUCKET - 1, "fan", 9),
                           (2 * ROW_BUCKET - 4, "siblings", 14), (30, "random", 1)]:
        context = [rng.randrange(259) for _ in range(plen)]  # the tree's positions cross a key block's end
        tree = _tree(rng, n, shape)
        target.reset()
        feed = context if plen % 2 else context[-1:]  # the whole prompt with the tree, or only its last token
        if not plen % 2:
            target.score(context[:-1])
        logits = target.score_tree(feed, tree)
        assert logits.shape == (n + 1, 259)
        for i in range(-1, n):
            target.rollback(plen - 1)
            for t in context[-1:] + ([] if i < 0 else [tree.tokens[j] for j in tree.path(i)]):
                step = target.score([t], keep=1)[0]  # one-token steps along the node's path
            assert torch.equal(logits[i + 1], step), (plen, shape, i)


class _TreeDrafter:
    """Trees that hold the target's true continuation (`plain`) up to a chosen depth on a chosen branch, among
    decoys: `right` (the true chain first), `wrong` (no node right), `late` (the true branch drafted last, so the
    accepted path sits at later slots) or `random` (random trees, each node drawn from the vocabulary)."""

    def __init__(self, kind: str, plain: list[int], prompt_len: int, seed: int = 0, vocab: int = 259):
        self.kind, self.plain, self.prompt_len, self.vocab = kind, plain, prompt_len, vocab
        self.rng = random.Random(seed)

    def draft_tree(self, ctx: list[int], budget: int, max_depth: int) -> DraftTree:
        rng, truth = self.rng, self.plain[len(ctx) - self.prompt_len:]
        if self.kind == "random":
            return _tree(rng, rng.randint(1, budget), rng.choice(["chain", "fan", "siblings", "random"]), max_depth)
        good = truth[:min(max_depth, budget)] if self.kind in ("right", "late") else []
        if self.kind == "late":
            good = good[:max(budget - 1, 0)]
        tokens, parents = [], []
        if self.kind != "right":  # a decoy first: never the true next token
            tokens.append((truth[0] + 1) % self.vocab if truth else 0)
            parents.append(-1)
        base = len(tokens)
        if self.kind in ("right", "late"):
            tokens += good
            parents += [-1 if j == 0 else base + j - 1 for j in range(len(good))]
        while len(tokens) < budget:  # decoys: wrong siblings and children, at most max_depth deep
            p = rng.randrange(-1, len(tokens))
            tree = DraftTree(tuple(tokens), tuple(parents))
            depth = 1 if p < 0 else tree.depths[p] + 1
            right = truth[depth - 1] if self.kind == "wrong" and depth <= len(truth) else None
            taken = {t for t, q in zip(tokens, parents) if q == p} | {right}
            free = [v for v in range(self.vocab) if v not in taken]
            if depth > max_depth:
                continue
            tokens.append(rng.choice(free))
            parents.append(p)
        return DraftTree(tuple(tokens), tuple(parents))


class _Logged:
    """A Target that keeps the logits that chose each generated token (index 0: the first after the prompt): a
    chain step's rows, or a tree step's rows on the accepted path, the bonus token's included."""

    def __init__(self, target, prompt_len: int):
        self.target, self.prompt_len, self.chose, self.tree_rows = target, prompt_len, {}, None
        self.vocab_size = target.vocab_size

    cached_len = property(lambda self: self.target.cached_len)

    def reset(self):
        self.target.reset()

    def rollback(self, n):
        self.target.rollback(n)

    def score(self, new_tokens, keep=None):
        out = self.target.score(new_tokens, keep)
        for j, row in enumerate(out):  # row j predicts the token at sequence position cached_len - len(out) + 1 + j
            self.chose[self.cached_len - len(out) + 1 + j - self.prompt_len] = row
        return out

    def score_tree(self, new_tokens, tree):
        self.tree_rows = self.target.score_tree(new_tokens, tree)
        return self.tree_rows

    def commit_tree(self, base, path):
        self.target.commit_tree(base, path)
        for j, row in enumerate([0] + [i + 1 for i in path]):
            self.chose[base - self.prompt_len + j] = self.tree_rows[row]


@pytest.mark.parametrize("numerics", INTEGER_NUMERICS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tree_speculative_equals_plain_for_every_budget_and_drafter(tiny_random, arch, numerics):
    """Tokens equal plain greedy decoding's, and so do the logits that chose each of them, bit for bit."""
    prompt = list(range(40, 96))  # 56 tokens: the run crosses the 64-slot key block in the middle of trees
    plain_run = _Logged(_runtime(tiny_random, arch, numerics=numerics), len(prompt))
    plain = greedy_decode(plain_run, prompt, 28)
    assert len(set(plain)) > 3 and sorted(plain_run.chose) == list(range(28))
    for kind in ("random", "wrong", "right", "late"):
        for budget in range(1, 17):
            run = _Logged(plain_run.target, len(prompt))
            out = speculative_generate(run, prompt, 28, _TreeDrafter(kind, plain, len(prompt), seed=budget),
                                       k=8, tree_budget=budget)
            assert out.tokens == plain, (kind, budget)
            assert all(torch.equal(run.chose[i], plain_run.chose[i]) for i in range(28)), (kind, budget)
            if kind == "right":
                assert out.mean_acceptance_length > min(budget, 8) * 0.7
            if kind == "wrong":
                assert out.accepted == 0


@pytest.mark.parametrize("numerics", INTEGER_NUMERICS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batched_generation_equals_each_prompt_alone_bit_for_bit(tiny_random, arch, numerics):
    """Prompts of different lengths decoded together (right-padded prefills, refilled slots, rows at different
    positions in one pass) give each prompt the runtime's plain greedy answer alone: the tokens, and the log-probs
    of every position (logits minus their logsumexp) bit for bit."""
    from drafter_lib.decoding.generate import stream_generate, topk_logprobs

    target = _runtime(tiny_random, arch, numerics=numerics)
    rng = random.Random(5)
    prompts = [[rng.randrange(259) for _ in range(n)] for n in (5, 63, 30, 64, 100, 1, 129)]
    soft = []  # per prompt alone: the top-259 (all) log-probs at each of 24 generated positions
    for p in prompts:
        run = _Logged(target, len(p))
        greedy_decode(run, p, 24)
        soft.append(topk_logprobs(torch.stack([run.chose[i] for i in range(24)]), 259))
    stop = {greedy_decode(target, prompts[0], 24)[9]}  # rows end at different steps, so slots are refilled
    alone = [greedy_decode(target, p, 24, stop_ids=stop) for p in prompts]
    assert len({len(a) for a in alone}) > 1
    for batch in range(1, 6):
        seen = set()
        for f in stream_generate(target.model, prompts, 24, stop, batch_size=batch, topk=259):
            seen.add(f.index)
            n = len(f.tokens)
            assert f.tokens == alone[f.index], (batch, f.index)
            assert torch.equal(f.soft_ids, soft[f.index][0][:n]), (batch, f.index)
            assert torch.equal(f.soft_logprobs, soft[f.index][1][:n]), (batch, f.index)
        assert seen == set(range(len(prompts)))
