"""Draft trees in the evaluation: the greedy-verification simulation of tree drafters (acceptance.simulate with
tree_budget), the tree rows of run_evaluation, specdraft-eval --tree-budgets and the eval stage, the tree plot."""
import json
import random

import pytest

from drafter_lib.decoding.speculative import FnDrafter
from drafter_lib.decoding.tree import DraftTree
from drafter_lib.evaluation import evaluate as ev
from drafter_lib.evaluation.acceptance import ChainTree, simulate
from drafter_lib.evaluation.drafters import TREE_SOURCES, check_tree_budgets, tree_rows

SAME = ("mean_acceptance_length", "per_position_acceptance", "accepted_length_hist", "steps", "accepted_tokens", "k",
        "per_prompt")


def _same_numbers(a: dict, b: dict):
    for key in SAME:
        assert a[key] == b[key], key
    assert list(a["per_category"]) == list(b["per_category"])
    for c in a["per_category"]:
        assert a["per_category"][c] == b["per_category"][c], c


class Bigram:
    """A greedy bigram drafter (next = table[previous]): each draft continues the previous one, as a model's
    greedy drafts do. `alt` is a second choice per token, different from the first."""

    def __init__(self, vocab: int, seed: int):
        rng = random.Random(seed)
        self.first = [rng.randrange(vocab) for _ in range(vocab)]
        self.alt = [(f + 1 + rng.randrange(vocab - 1)) % vocab for f in self.first]

    def draft(self, tokens, k):
        out, prev = [], tokens[-1]
        for _ in range(k):
            prev = self.first[prev]
            out.append(prev)
        return out


def _bigram_data(bigram: Bigram, vocab: int, n: int, seed: int):
    """Prompts and references that mostly follow the bigram's first choice, sometimes its second, sometimes
    anything."""
    rng = random.Random(seed)
    prompts, refs = [], []
    for _ in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        ref, prev = [], p[-1]
        for _ in range(rng.randrange(0, 60)):
            u = rng.random()
            prev = bigram.first[prev] if u < 0.7 else bigram.alt[prev] if u < 0.85 else rng.randrange(vocab)
            ref.append(prev)
        prompts.append(p)
        refs.append(ref)
    return prompts, refs


@pytest.mark.parametrize("k, budget", [(1, 1), (4, 4), (8, 64)])
def test_tree_simulation_of_a_chain_is_the_chain_simulation(k, budget):
    vocab = 23
    bigram = Bigram(vocab, seed=k)
    prompts, refs = _bigram_data(bigram, vocab, 17, seed=k)
    cats = [["a", "b", "c"][i % 3] for i in range(len(prompts))]
    chain = simulate(bigram, prompts, refs, k=k, categories=cats, batch_size=5).to_dict()
    grown = simulate(bigram, prompts, refs, k=k, categories=cats, batch_size=5, grow=True).to_dict()
    tree = simulate(ChainTree(bigram), prompts, refs, k=k, categories=cats, batch_size=5, tree_budget=budget)
    _same_numbers(tree.to_dict(), chain)
    _same_numbers(tree.to_dict(), grown)
    assert tree.to_dict()["tree_budget"] == budget and "tree_budget" not in chain
    # every step drafted one chain of k nodes
    assert tree.mean_tree_nodes == tree.mean_tree_depth == k and tree.drafted_tokens == k * chain["steps"]

    class OneByOne:  # no draft_tree_batch: trees are drafted one context at a time
        def draft_tree(self, tokens, budget, max_depth):
            return DraftTree.chain(bigram.draft(tokens, min(budget, max_depth)))

    _same_numbers(simulate(OneByOne(), prompts, refs, k=k, categories=cats, tree_budget=budget).to_dict(), chain)


def test_oracle_tree_accepts_exactly_the_reference_path_it_holds():
    prompt, ref = [1], list(range(10, 30))  # 20 reference tokens
    full = prompt + ref
    k, budget = 4, 12
    calls = []

    def depth_at(i):  # how deep the reference path goes in the tree drafted at reference position i
        return [3, 0, 4, 1, 2][i % 5]

    class Oracle:
        def draft_tree(self, tokens, budget_, max_depth):
            i = len(tokens) - len(prompt)
            calls.append(i)
            d = min(depth_at(i), max_depth)
            truth = full[len(tokens):len(tokens) + d]
            # decoys first: a wrong root child with the true tokens below it, then the true path with a wrong
            # sibling at every depth
            tokens_ = [99, *truth[:2]]
            parents = [-1, 0, 1][:len(tokens_)]
            prev = -1
            for t in truth:
                tokens_ += [t, 98]
                parents += [prev, prev]
                prev = len(tokens_) - 2
            if not truth:
                tokens_.append(98)
                parents.append(-1)
            return DraftTree(tokens_[:budget_], parents[:budget_])

    res = simulate(Oracle(), [prompt], [ref], k=k, tree_budget=budget)
    expect_calls, accepted, i = [], [], 0
    while i < len(ref):
        a = min(depth_at(i), k, len(ref) - i)
        expect_calls.append(i)
        accepted.append(a)
        i += min(a + 1, len(ref) - i)
    assert calls == expect_calls
    assert res.overall.steps == len(accepted) and res.overall.accepted == sum(accepted)
    assert res.overall.hist == [accepted.count(a) for a in range(k + 1)]
    assert res.per_prompt == [[len(accepted), sum(accepted)]]
    assert res.overall.mean_acceptance_length == pytest.approx((sum(accepted) + len(accepted)) / len(accepted))
    # per depth j: the steps whose accepted path reached depth j, over those where depth j was verifiable
    trials = [sum(1 for c in calls if len(ref) - c > j) for j in range(k)]
    hits = [sum(1 for a in accepted if a > j) for j in range(k)]
    assert res.overall.per_position_acceptance == [h / t for h, t in zip(hits, trials)]
    # the tree sent more nodes than the chain of its depth: its size is reported
    assert res.to_dict()["mean_tree_nodes"] == pytest.approx(res.drafted_tokens / res.overall.steps)
    assert res.mean_tree_nodes > 1 + res.mean_tree_depth


def test_simulation_rejects_trees_over_the_budget_or_depth():
    class TooBig:
        def draft_tree(self, tokens, budget, max_depth):
            return DraftTree.chain(list(range(1, max_depth + 2)))

    with pytest.raises(ValueError, match="asked for at most"):
        simulate(TooBig(), [[0]], [[1, 2, 3]], k=2, tree_budget=8)
    with pytest.raises(ValueError, match="chains only"):
        simulate(ChainTree(FnDrafter(lambda t, k: [])), [[0]], [[1]], k=2, tree_budget=8, grow=True)
    with pytest.raises(ValueError, match="tree_budget"):
        simulate(ChainTree(FnDrafter(lambda t, k: [])), [[0]], [[1]], k=2, tree_budget=0)


@pytest.mark.parametrize("seed", range(6))
def test_a_tree_holding_the_chain_never_scores_below_it(seed):
    vocab, k = 19, 6
    bigram = Bigram(vocab, seed)
    prompts, refs = _bigram_data(bigram, vocab, 12, seed + 100)

    class ChainPlusSecondChoices:
        """The bigram's chain, then its second choice beside each chain node (as long as the budget lasts)."""

        def draft_tree(self, tokens, budget, max_depth):
            chain = bigram.draft(tokens, min(budget, max_depth))
            toks, parents = list(chain), list(range(-1, len(chain) - 1))
            prevs = [tokens[-1]] + chain[:-1]
            for depth, prev in enumerate(prevs):
                if len(toks) < budget:
                    toks.append(bigram.alt[prev])
                    parents.append(depth - 1)
            return DraftTree(toks, parents)

    chain = simulate(bigram, prompts, refs, k=k)
    for budget in (k, k + 3, 4 * k):
        tree = simulate(ChainPlusSecondChoices(), prompts, refs, k=k, tree_budget=budget)
        for (cs, ca), (ts, ta) in zip(chain.per_prompt, tree.per_prompt):
            assert ts <= cs and (ta + ts) * cs >= (ca + cs) * ts  # per prompt: fewer steps, MAL as high
        assert tree.overall.mean_acceptance_length >= chain.overall.mean_acceptance_length
        if budget == k:
            _same_numbers(tree.to_dict(), chain.to_dict())
        else:
            assert tree.overall.mean_acceptance_length > chain.overall.mean_acceptance_length  # second choices pay


def test_tree_budgets_are_checked_and_rows_name_their_chain():
    assert check_tree_budgets([16, 32]) == [16, 32]
    for bad, msg in [([0], ">= 1"), ([8, 8], "listed twice"), ([2.5], ">= 1"), ([True], ">= 1")]:
        with pytest.raises(ValueError, match=msg):
            check_tree_budgets(bad)
    chain_only = FnDrafter(lambda t, k: [])
    tree_drafter = ChainTree(chain_only)
    rows, left_out = tree_rows({"packed": tree_drafter, "packed + copy prior": chain_only, "n-gram": tree_drafter},
                               [8, 4], ["packed", "packed + copy prior"])
    assert list(rows) == ["packed tree 8", "packed tree 4"] and rows["packed tree 4"].chain == "packed"
    assert rows["packed tree 4"].budget == 4 and rows["packed tree 4"].drafter is tree_drafter
    assert len(left_out) == 1 and left_out[0].startswith("packed + copy prior: FnDrafter has no draft_tree")
    assert tree_rows({"packed": tree_drafter}, []) == ({}, [])
    assert tree_rows({"packed": tree_drafter}, [4]) == ({}, [])  # by default the pack as shipped only
    with pytest.raises(ValueError, match="'n-gram' is not a row whose engine drafts trees"):
        tree_rows({"packed": tree_drafter}, [4], ["n-gram"])


@pytest.mark.parametrize("overrides, msg", [
    ({"eval.tree_budgets": [0]}, "eval.tree_budgets: every budget must be an int >= 1"),
    ({"eval.tree_budgets": [16, 16]}, "eval.tree_budgets: listed twice"),
    ({"eval.tree_budgets": "16"}, "eval.tree_budgets: expected a list"),
    ({"eval.tree_sources": ["n-gram lookup"]}, "eval.tree_sources: 'n-gram lookup' is not a row whose engine"),
    ({"eval.tree_sources": ["packed", "packed"]}, "eval.tree_sources: listed twice"),
])
def test_eval_tree_config_keys(overrides, msg):
    from drafter_lib.study import config

    e = config.build_config("smoke", check_models=False).eval
    assert e.tree_budgets == [8, 16] and e.tree_sources == ["packed + copy prior"]
    e = config.build_config("smoke", {"eval.tree_budgets": [], "eval.tree_sources": list(TREE_SOURCES)},
                            check_models=False).eval
    assert e.tree_budgets == [] and e.tree_sources == list(TREE_SOURCES)
    with pytest.raises(config.ConfigError, match=msg):
        config.build_config("smoke", overrides, check_models=False)


def test_budgets_above_the_engines_bound_are_left_out(tiny_target, engine_trees, monkeypatch):
    from drafter_lib.evaluation.drafters import engine_from_state_dict

    tree_draft = pytest.importorskip("drafter_lib.engine.tree_draft")

    model, _ = tiny_target
    monkeypatch.setattr(tree_draft, "MAX_TREE_BUDGET", 16, raising=False)
    engine = engine_from_state_dict(model.config, model.state_dict())
    rows, left_out = tree_rows({"packed": engine}, [16, 32], ["packed"])
    assert list(rows) == ["packed tree 16"] and left_out == ["packed tree 32: DraftEngine drafts trees of at most 16 "
                                                             "nodes"]


class TreeEngine:
    """A chain drafter that also drafts trees: its own chain plus one other root child (so its trees hold the
    chain) - what an engine's `draft_tree` offers, over any drafter."""

    def __init__(self, drafter):
        self.drafter = drafter

    def draft(self, tokens, k):
        return list(self.drafter.draft(tokens, k))

    def draft_batch(self, contexts, k):
        return [self.draft(c, k) for c in contexts]

    def draft_tree(self, tokens, budget, max_depth):
        chain = self.draft(tokens, min(budget, max_depth))
        extra = [t for t in (0, 1) if not chain or t != chain[0]][:1] if budget > max_depth else []
        return DraftTree(chain + extra, list(range(-1, len(chain) - 1)) + [-1] * len(extra))


def test_run_evaluation_writes_tree_rows(tiny_target, tmp_path):
    from drafter_lib.evaluation.drafters import engine_from_state_dict, ngram_drafter

    model, tok = tiny_target
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    records = [{"id": "w", "category": "writing", "messages": [user("write about the sea")], "origin": "sets"},
               {"id": "m", "category": "math", "messages": [user("what is 12 + 30? " * 3)], "origin": "split"},
               {"id": "c", "category": "code", "messages": [user("def f(x): return x")], "origin": "split"}]
    engine = engine_from_state_dict(model.config, model.state_dict())  # drafts k tokens every step
    ngram = ngram_drafter({"enabled": True, "max_ngram": 3, "min_ngram": 1})
    drafters = {"self": engine, "packed": TreeEngine(engine), "packed + copy prior": ngram}  # no trees: left out
    k, logs = 4, []
    m = ev.run_evaluation(model, tok, records, drafters, k=k, max_new_tokens=12, e2e_prompts=0,
                          references_path=tmp_path / "refs.jsonl", tree_budgets=[4, 8], log=logs.append,
                          tree_sources=["packed", "packed + copy prior"])
    assert list(m["baselines"]) == ["self", "packed", "packed + copy prior", "packed tree 4", "packed tree 8"]
    assert m["primary"] == "packed + copy prior"  # tree rows do not change the primary
    assert m["tree_budgets"] == [4, 8] and list(m["trees"]) == ["packed tree 4", "packed tree 8"]
    assert m["trees_left_out"] == ["packed + copy prior: CopyDrafter has no draft_tree (trees need an engine that "
                                   "drafts them)"]
    assert any(line.startswith("tree rows left out: packed + copy prior") for line in logs)
    chain, t4, t8 = (m["baselines"][n] for n in ("packed", "packed tree 4", "packed tree 8"))
    _same_numbers(t4, chain)  # a budget of k holds the chain only
    assert t4["mean_tree_nodes"] == 4 and t8["mean_tree_nodes"] == 5 and t8["mean_tree_depth"] == 4
    assert t8["tree_budget"] == 8 and len(t8["per_position_acceptance"]) == k
    for name in ("packed tree 4", "packed tree 8"):  # every field a chain row has
        assert set(m["mal_by_category"][name]) == {"all", "writing", "math", "code"}
        assert m["per_position_by_drafter"][name] == m["baselines"][name]["per_position_acceptance"]
        assert set(m["acceptance_by_origin"][name]) == {"sets", "split"}
        assert m["mal_ci"][name]["all"]["mal"] == pytest.approx(m["baselines"][name]["mean_acceptance_length"])
        assert set(m["mal_ci_by_origin"][name]) == {"sets", "split"}
        assert m["paired_vs_primary"][name]["prompts"] == 3
        t = m["trees"][name]
        assert t["chain"] == "packed" and t["mal"] == m["baselines"][name]["mean_acceptance_length"]
        assert t["vs_chain"]["difference"] == pytest.approx(t["mal"] - chain["mean_acceptance_length"])
    assert m["trees"]["packed tree 4"]["vs_chain"]["difference"] == 0
    table = ev.tree_table(m)
    assert "packed tree 8" in table and "minus its chain" in table and "left out: packed + copy prior" in table
    assert "packed tree 8" in ev.interval_table(m) and "packed tree 8" in ev.baselines_table(m["baselines"], k)
    frames = ev.report_frames(m)
    trees = next(t for title, t in frames.items() if title.startswith("draft trees"))
    assert list(trees.index) == list(m["trees"]) and trees.loc["packed tree 4", "budget"] == "4"
    assert frames["tree rows left out"]["reason"].str.contains("packed \\+ copy prior").all()
    curves = ev.tree_curves(m)
    assert [p["label"] for p in curves["packed"]] == ["chain 4", "tree 4", "tree 8"]
    assert [p["budget"] for p in curves["packed"]] == [4, 4, 8]
    pngs = ev.save_plots(m, tmp_path / "plots")
    assert pngs[-1].name == "tree_budget.png" and pngs[-1].stat().st_size > 5000
    # without budgets: no tree rows, nothing left out
    m0 = ev.run_evaluation(model, tok, records, drafters, k=k, max_new_tokens=12, e2e_prompts=0,
                           references_path=tmp_path / "refs.jsonl", log=lambda s: None)
    assert m0["trees"] == {} and m0["trees_left_out"] == [] and len(m0["baselines"]) == 3
    assert [p.name for p in ev.save_plots(m0, tmp_path / "plots0")][-1] == "category_heatmap.png"


@pytest.fixture()
def engine_trees(monkeypatch):
    """DraftEngine.draft_tree as it is, or, on an engine from before trees, its chain as a tree (so the tree rows'
    plumbing is tested either way). -> whether the engine has its own."""
    from drafter_lib.engine.draft_engine import DraftEngine

    if hasattr(DraftEngine, "draft_tree"):
        return True
    monkeypatch.setattr(DraftEngine, "draft_tree", lambda self, tokens, budget, max_depth=16: DraftTree.chain(
        self.draft(tokens, min(budget, max_depth))), raising=False)
    return False


def _tiny_pack(model, out_dir):
    from drafter_lib.model.hf_models import prune_layers
    from drafter_lib.quantization import QuantConfig
    from drafter_lib.study.pack import pack_checkpoint

    drafter, _ = prune_layers(model, "first:1")
    pack_checkpoint(drafter, drafter.config, out_dir, QuantConfig.default_for(group_size=32),
                    copy_policy={"enabled": True, "mode": "prefix"}, min_confidence=0.25)
    return drafter


def _cli_files(tmp_path, tiny_target, questions: list[dict]):
    """(target dir, question file, metrics path) for specdraft-eval on the tiny target and a tiny pack of it."""
    model, tok = tiny_target
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    _tiny_pack(model, tmp_path / "model")
    q = tmp_path / "question.jsonl"
    q.write_text("".join(json.dumps(row) + "\n" for row in questions))
    return target_dir, q, tmp_path / "m.json"


def test_cli_writes_tree_rows(tmp_path, tiny_target, capsys, engine_trees):
    target_dir, q, out = _cli_files(tmp_path, tiny_target, [
        {"question_id": i, "category": c, "turns": [f"{c} number {i} {c}?"]} for i, c in enumerate(["a", "b", "c"])])
    ev.main(["--model", str(tmp_path / "model"), "--prompts", str(q), "--target", str(target_dir),
             "--max-new-tokens", "12", "--k", "4", "--e2e-prompts", "0", "--out", str(out),
             "--plots", str(tmp_path / "plots"), "--tree-budgets", "4", "8", "--tree-sources", "packed",
             "packed + copy prior"])
    m = json.loads(out.read_text())
    want = ["packed tree 4", "packed tree 8", "packed + copy prior tree 4", "packed + copy prior tree 8"]  # in order
    assert list(m["trees"]) == want
    assert list(m["baselines"]) == ["packed", "n-gram lookup", "packed + copy prior"] + want
    assert m["tree_budgets"] == [4, 8] and m["trees_left_out"] == [] and m["primary"] == "packed + copy prior"
    assert m["trees"]["packed + copy prior tree 8"]["chain"] == "packed + copy prior"
    for name in want:
        assert m["baselines"][name]["tree_budget"] == int(name.rsplit(" ", 1)[1])
        assert 1.0 <= m["mal_ci"][name]["all"]["mal"] <= 5.0 and name in m["paired_vs_primary"]
    if not engine_trees:  # the chain as a tree: the chain's numbers
        _same_numbers(m["baselines"]["packed tree 4"], m["baselines"]["packed"])
    else:  # a tree of 4 nodes and depth <= 4 may be wider and shallower than the chain: bounded by k + 1 only
        assert m["baselines"]["packed tree 8"]["mean_tree_nodes"] <= 8
    assert "tree 4" in ev.tree_table(m)
    for bad in (["--tree-budgets", "4", "4"], ["--tree-sources", "n-gram lookup"]):
        with pytest.raises(SystemExit):
            ev.main(["--model", str(tmp_path / "model"), "--prompts", str(q), *bad])
    assert (tmp_path / "plots" / "tree_budget.png").stat().st_size > 5000
    printed = capsys.readouterr().out
    assert "draft trees (depth <= k)" in printed and "packed tree 8" in printed
    with pytest.raises(SystemExit):
        ev.main(["--model", str(tmp_path / "model"), "--prompts", str(q), "--tree-budgets", "0"])


def test_cli_without_engine_trees_leaves_the_rows_out(tmp_path, tiny_target, capsys, monkeypatch):
    from drafter_lib.engine.draft_engine import DraftEngine

    monkeypatch.delattr(DraftEngine, "draft_tree", raising=False)
    target_dir, q, out = _cli_files(tmp_path, tiny_target,
                                    [{"question_id": 1, "category": "a", "turns": ["hello there?"]}])
    ev.main(["--model", str(tmp_path / "model"), "--prompts", str(q), "--target", str(target_dir),
             "--max-new-tokens", "8", "--k", "4", "--e2e-prompts", "0", "--out", str(out)])  # default budgets
    m = json.loads(out.read_text())
    assert m["trees"] == {} and list(m["baselines"]) == ["packed", "n-gram lookup", "packed + copy prior"]
    assert m["tree_budgets"] == [8, 16] and len(m["trees_left_out"]) == 1 and m["trees"] == {}
    printed = capsys.readouterr().out  # the default source: the pack as shipped
    assert "tree rows left out: packed + copy prior: DraftEngine has no draft_tree" in printed  # logged up front
    assert "\nleft out: packed + copy prior: DraftEngine has no draft_tree" in printed  # and in the tree table


def _smoke_run_with_prompts(tmp_path, cfg):
    """A run dir with one training prompt and two held-out prompts of two categories, and the smoke teacher."""
    from drafter_lib.common.files import write_jsonl
    from drafter_lib.common.layout import RunLayout
    from drafter_lib.model import hf_models
    from drafter_lib.study import stages

    run = RunLayout.of(tmp_path / "run")
    model, _ = hf_models.load_teacher(stages.teacher_spec(cfg, run))
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    write_jsonl(run.train_prompts, [{"id": "t", "category": "train", "messages": [user("a training prompt")]}])
    write_jsonl(run.heldout_prompts, [{"id": f"h{i}", "category": c, "messages": [user(f"{c} {i}?")]}
                                      for i, c in enumerate(["x", "y"])])
    return run, model


def test_eval_stage_passes_the_tree_budgets(tmp_path, engine_trees):
    from drafter_lib.study import config, stages

    cfg = config.build_config("smoke", {"eval.heldout_files": [], "eval.tree_budgets": [4, 8], "eval.limit": 2,
                                        "eval.tree_sources": ["packed + copy prior", "packed"],
                                        "eval.e2e_prompts": 0, "eval.max_new_tokens": 8, "eval.k": 4},
                              check_models=False)
    run, model = _smoke_run_with_prompts(tmp_path, cfg)
    drafter = _tiny_pack(model, run.model_dir)
    drafter.save_pretrained(run.best_distill)
    m = stages.evaluate_run(cfg, run)
    assert m["tree_budgets"] == [4, 8] and list(m["trees"]) == ["packed + copy prior tree 4",
                                                                "packed + copy prior tree 8", "packed tree 4",
                                                                "packed tree 8"]
    assert all(n in m["baselines"] and n in m["mal_ci"] for n in m["trees"])
    assert json.loads(run.metrics.read_text())["trees"]["packed tree 8"]["budget"] == 8
    from drafter_lib.evaluation.evaluate import report_frames  # the stage shows its tables as frames, not printed
    frame = report_frames(m)["draft trees against their chain on the same prompts (paired)"]
    assert "packed tree 8" in frame.to_string()


@pytest.mark.parametrize("keep_layers", ["even:2", None])
def test_eval_stage_adds_the_peer_row(tmp_path, keep_layers, monkeypatch):
    """eval.peer: a row "peer: SPEC" first, paired with the pack as shipped (the primary), on the run's references.
    The peer here is the smoke teacher itself, so it drafts the target's own greedy tokens; with the whole drafter
    base kept (keep_layers null) it is also the untrained base row's drafter: the same numbers, simulated once."""
    from drafter_lib.evaluation.drafters import PRUNED_BASE
    from drafter_lib.evaluation.evaluate import report_frames
    from drafter_lib.study import config, stages

    cfg = config.build_config("smoke", {"eval.heldout_files": [], "eval.tree_budgets": [], "eval.limit": 2,
                                        "eval.e2e_prompts": 0, "eval.max_new_tokens": 8, "eval.k": 4,
                                        "eval.peer": "tiny-random:llama", "study.keep_layers": keep_layers},
                              check_models=False)
    run, model = _smoke_run_with_prompts(tmp_path, cfg)
    _tiny_pack(model, run.model_dir).save_pretrained(run.best_distill)
    if keep_layers is None:  # the base row's engine is the peer's: its weights are not loaded again
        from drafter_lib.evaluation import drafters

        monkeypatch.setattr(drafters, "peer_drafter", lambda *a, **k: pytest.fail("the peer loaded twice"))
    m = stages.evaluate_run(cfg, run)
    peer = "peer: tiny-random:llama"
    assert list(m["baselines"]) == [peer, PRUNED_BASE, "distilled fp", "packed", "n-gram lookup",
                                    "packed + copy prior"]
    assert m["primary"] == "packed + copy prior" and m["paired_vs_primary"][peer]["prompts"] == 2
    assert m["baselines"][peer]["mean_acceptance_length"] > 3.0  # the target's own weights: its greedy tokens
    if keep_layers is None:
        _same_numbers(m["baselines"][peer], m["baselines"][PRUNED_BASE])
    assert json.loads(run.metrics.read_text())["mal_ci"][peer]["all"]["prompts"] == 2
    frames = report_frames(m)
    assert peer in frames["minus packed + copy prior, same prompts (paired)"].index
