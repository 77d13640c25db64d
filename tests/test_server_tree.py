"""POST /draft with `tree` over real HTTP (one `./serve.sh` process on loopback, a copy-prior pack): the answer equals
the in-process engine's tree, bad tree fields get a 422 naming them, the chain answer is unchanged without `tree`,
the clients are tree drafters for the speculative loop; and trees in the micro-batcher's queue obey its bounds."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from server_helpers import TINY_VOCAB, ServerProcess, guarded_env, tiny_hf_model, write_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_tree_pack"), tiny_hf_model(seed=0), copy_enabled=True)


@pytest.fixture(scope="module")
def engine(model_dir):
    from drafter_lib.engine.draft_engine import DraftEngine

    return DraftEngine.from_dir(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tree_server")
    with ServerProcess(model_dir, tmp / "server.log", env=guarded_env(tmp / "guard", tmp / "net.log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _prompt(seed: int, n: int, repeat: bool = False) -> list[int]:
    rng = random.Random(seed)
    p = [rng.randrange(TINY_VOCAB) for _ in range(n)]
    return p + p[:3] if repeat else p  # repeat: the copy prior proposes what followed p[:3]


def _same_tree(answer: dict, tree, probs_abs: float = 1e-5):
    assert answer["tokens"] == list(tree.tokens) and answer["parents"] == list(tree.parents)
    assert answer["probs"] == pytest.approx(list(tree.probs), abs=probs_abs)


def test_tree_answer_equals_the_in_process_engine(http, engine):
    cases = [(1, 5, 16, 16, 4, False), (2, 40, 8, 4, 2, False), (3, 1, 1, 1, 1, False), (4, 30, 64, 10, 16, False),
             (5, 20, 12, 8, 3, True)]
    for seed, n, budget, depth, branch, repeat in cases:
        tokens = _prompt(seed, n, repeat)
        r = http.post("/draft", json={"tokens": tokens, "tree": {"budget": budget, "max_depth": depth,
                                                                 "branch": branch}})
        assert r.status_code == 200, r.text
        body = r.json()
        ref = engine.draft_tree_result(tokens, budget, depth, branch)
        _same_tree(body["tree"], ref.tree)
        assert body["draft"] == ref.chain == engine.draft(tokens, depth)[:len(ref.chain)]
        assert body["num_draft_tokens"] == 16 and body["context_len"] == len(tokens) and body["batch_size"] == 1
        assert "probs" not in body and body["cached_prefix_len"] >= 0
        assert len(body["tree"]["tokens"]) <= budget
        if repeat:  # the copy branch: probability 1 along the first chain
            assert body["tree"]["probs"][0] == 1.0
    # return_probs: the first chain's per-token probabilities (null for copied tokens)
    tokens = _prompt(5, 20, True)
    body = http.post("/draft", json={"tokens": tokens, "return_probs": True, "tree": {"budget": 20}}).json()
    ref = engine.draft_tree_result(tokens, 20, 16)
    assert body["draft"] == ref.chain and body["probs"][0] is None
    assert body["probs"] == pytest.approx(ref.chain_probs, abs=1e-5)


def test_depth_defaults_to_num_draft_tokens_and_null_is_the_chain(http, engine):
    tokens = _prompt(7, 25)
    body = http.post("/draft", json={"tokens": tokens, "num_draft_tokens": 3, "tree": {"budget": 30}}).json()
    _same_tree(body["tree"], engine.draft_tree(tokens, 30, 3))
    assert max(_depths(body["tree"]["parents"])) <= 3 and body["num_draft_tokens"] == 3
    # min_confidence does not apply to a tree
    again = http.post("/draft", json={"tokens": tokens, "num_draft_tokens": 3, "min_confidence": 0.99,
                                      "tree": {"budget": 30, "max_depth": None}}).json()
    assert again["tree"]["tokens"] == body["tree"]["tokens"] and again["tree"]["parents"] == body["tree"]["parents"]
    assert again["tree"]["probs"] == pytest.approx(body["tree"]["probs"], abs=1e-5)  # warm cache: last bits
    for body in ({"tokens": tokens}, {"tokens": tokens, "tree": None}):
        r = http.post("/draft", json=body)
        assert r.status_code == 200 and "tree" not in r.json() and r.json()["draft"] == engine.draft(tokens, 16)


def _depths(parents):
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def test_chain_answer_is_unchanged_without_tree(http, engine):
    for seed, n, k in [(1, 5, 16), (2, 40, 4), (5, 20, 12)]:
        tokens = _prompt(seed, n, repeat=seed == 5)
        body = http.post("/draft", json={"tokens": tokens, "num_draft_tokens": k}).json()
        assert body["draft"] == engine.draft(tokens, k) and len(body["draft"]) == k
        assert set(body) == {"draft", "num_draft_tokens", "context_len", "batch_size", "cached_prefix_len",
                             "batch_cached_tokens", "timing"}
    body = http.post("/draft", json={"tokens": [1, 2, 3]}).json()
    assert len(body["draft"]) == 16 and body["num_draft_tokens"] == 16


@pytest.mark.parametrize("tree,expected", [
    ({"budget": 0}, "tree.budget"),
    ({"budget": 65}, "tree.budget"),
    ({"budget": "4"}, "tree.budget"),
    ({"budget": 4.0}, "tree.budget"),
    ({"budget": 4, "max_depth": 0}, "tree.max_depth"),
    ({"budget": 4, "max_depth": 65}, "tree.max_depth"),
    ({"budget": 4, "branch": 0}, "tree.branch"),
    ({"budget": 4, "branch": 17}, "tree.branch"),
    ({"budget": 4, "branch": True}, "tree.branch"),
    ({"budget": 4, "width": 2}, "tree.width: unknown field (allowed: budget, max_depth, branch)"),
    (5, "tree: expected a JSON object"),
    ([4], "tree: expected a JSON object"),
])
def test_bad_tree_fields_get_422_naming_them(http, tree, expected):
    r = http.post("/draft", json={"tokens": [1, 2, 3], "tree": tree})
    assert r.status_code == 422, r.text
    assert expected in r.json()["error"]
    assert http.post("/draft", json={"tokens": [1, 2, 3], "tree": {"budget": 4}}).status_code == 200


def test_tree_budget_defaults_to_the_measured_one(http, engine):
    tokens = _prompt(7, 20)
    body = http.post("/draft", json={"tokens": tokens, "tree": {}}).json()
    ref = engine.draft_tree(tokens, 8, 16)
    assert len(body["tree"]["tokens"]) == len(ref) == 8
    assert (body["tree"]["tokens"], body["tree"]["parents"]) == (list(ref.tokens), list(ref.parents))


def test_clients_are_tree_drafters(server, engine):
    from drafter_lib.decoding.speculative import HFTarget, greedy_decode, speculative_generate
    from drafter_lib.serve.client import AsyncSpeculativeClient, SpeculativeClient

    tokens = _prompt(11, 30)
    ref = engine.draft_tree(tokens, 12, 6, 3)
    with SpeculativeClient(server.url) as client:
        got = client.draft_tree(tokens, 12, 6, branch=3)
        assert got.tokens == ref.tokens and got.parents == ref.parents
        assert got.probs == pytest.approx(ref.probs, abs=1e-5)
        target = tiny_hf_model(seed=0)  # the drafter's own weights, full precision: long accepted paths
        target.generation_config.eos_token_id = None
        prompt = _prompt(12, 9)
        out = speculative_generate(HFTarget(target), prompt, 24, drafter=client, k=6, tree_budget=12)
        assert out.tokens == greedy_decode(HFTarget(target), prompt, 24)
        assert all(n <= 12 for n in out.draft_lengths) and out.mean_acceptance_length > 1

    async def run():
        async with AsyncSpeculativeClient(server.url) as aclient:
            return await aclient.draft_tree(tokens, 12, 6, branch=3)

    got = asyncio.run(run())
    assert got.tokens == ref.tokens and got.parents == ref.parents


def test_metrics_count_tree_requests(http):
    before = http.get("/info").json()["server"]
    http.post("/draft", json={"tokens": [4, 5, 6], "tree": {"budget": 7, "max_depth": 3}})
    info = http.get("/info").json()["server"]
    assert info["metrics"]["tree_nodes"]["count"] == before["metrics"]["tree_nodes"]["count"] + 1
    assert info["batching"]["trees"] == before["batching"]["trees"] + 1
    text = http.get("/metrics").text
    assert "specdraft:tree_nodes_count" in text and "specdraft:tree_nodes_bucket" in text


# ------------------------------------------------------------------ the queue's bounds hold for trees (fake engine)

def test_trees_share_the_queue_bounds_and_run_alone():
    from drafter_lib.decoding.tree import DraftTree
    from drafter_lib.engine import tree_draft
    from drafter_lib.serve.batching import MicroBatcher, Overloaded
    from drafter_lib.serve.schema import DEFAULT_TREE_BRANCH, DEFAULT_TREE_BUDGET, MAX_TREE_BRANCH, MAX_TREE_BUDGET

    # the schema's bounds are the engine's
    assert (MAX_TREE_BUDGET, MAX_TREE_BRANCH, DEFAULT_TREE_BRANCH, DEFAULT_TREE_BUDGET) == (
        tree_draft.MAX_TREE_BUDGET, tree_draft.MAX_BRANCH, tree_draft.DEFAULT_BRANCH, tree_draft.DEFAULT_TREE_BUDGET)
    calls = []

    def run_batch(token_lists, k):
        calls.append(("chain", len(token_lists)))
        time.sleep(0.2)
        return [[t[0]] * k for t in token_lists]

    def run_tree(tokens, budget, max_depth, branch):
        calls.append(("tree", 1))
        time.sleep(0.2)
        tree = DraftTree.chain([tokens[0]] * min(budget, max_depth), [0.5] * min(budget, max_depth))
        return tree_draft.TreeDraft(tree, list(tree.tokens), [0.5] * len(tree), cached_prefix_len=0)

    async def main():
        b = MicroBatcher(run_batch, window_s=0, max_batch=8, max_queue=3, request_timeout_s=5.0, run_tree=run_tree)
        await b.start()
        try:
            busy = asyncio.ensure_future(b.submit([9], 2))  # occupies the worker
            await asyncio.sleep(0.05)
            mixed = [b.submit([1], 2), b.submit_tree([2], budget=3, max_depth=2, branch=2), b.submit([3], 2)]
            res = await asyncio.gather(*mixed, busy)
            assert res[1].tree.tokens == (2, 2) and res[1].draft == [2, 2] and res[1].batch_size == 1
            assert res[0].draft == [1, 1] and res[0].batch_size == 2  # the chains still share a batch
            assert ("chain", 2) in calls and calls.count(("tree", 1)) == 1
            # over the bound: trees are refused like chains
            busy = asyncio.ensure_future(b.submit([9], 2))
            await asyncio.sleep(0.05)
            res = await asyncio.gather(*[b.submit_tree([i], budget=2, max_depth=2, branch=1) for i in range(6)],
                                       return_exceptions=True)
            over = [r for r in res if isinstance(r, Overloaded)]
            assert len(over) >= 3 and {o.reason for o in over} == {"queue_full"}
            assert b.stats["rejected_queue_full"] >= 3 and b.stats["trees"] >= 2
            await busy
            b.request_timeout_s = 0.05
            with pytest.raises(Overloaded, match="REQUEST_TIMEOUT_S"):
                await b.submit_tree([1], budget=2, max_depth=2, branch=1)
            await asyncio.sleep(0.3)
            assert b.queue_depth == 0 and b.inflight == 0
        finally:
            await b.stop()
        # an engine without trees: a clear error, no hang
        plain = MicroBatcher(run_batch, window_s=0)
        await plain.start()
        try:
            with pytest.raises(ValueError, match="does not draft trees"):
                await plain.submit_tree([1], budget=2, max_depth=2, branch=1)
        finally:
            await plain.stop()

    asyncio.run(main())
