"""The baseline drafters and the copy policy read through model_dir (drafter_lib.evaluation.drafters, model_dir)."""
import json

import pytest
from server_helpers import tiny_hf_model, write_tiny_model_dir

from drafter_lib.evaluation.drafters import CopyDrafter, ngram_drafter, standard_baselines
from drafter_lib.packed.copy_policy import CopyPolicy
from drafter_lib.packed.model_dir import ModelDirError, read_copy_policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("baselines") / "model", tiny_hf_model(seed=0),
                                copy_enabled=True)


def test_read_copy_policy(model_dir, tmp_path):
    assert read_copy_policy(model_dir) == CopyPolicy(enabled=True)
    assert read_copy_policy(model_dir / "copy_policy.json") == CopyPolicy(enabled=True)
    bad = {"missing": None, "not json": "{", "unknown key": {"enabled": True, "max_ngrams": 4},
           "wrong type": {"enabled": "yes"}, "bool as int": {"max_copy": True},
           "impossible": {"min_ngram": 4, "max_ngram": 2}, "mode": {"mode": "copy-everything"}}
    messages = {"missing": "missing copy_policy.json", "not json": "invalid JSON", "unknown key": "max_ngrams",
                "wrong type": "enabled must be bool", "bool as int": "max_copy must be int",
                "impossible": "min_ngram", "mode": "mode"}
    for name, doc in bad.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        if doc is not None:
            (d / "copy_policy.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
        with pytest.raises(ModelDirError, match=messages[name]):
            read_copy_policy(d)


def test_standard_baselines_force_the_copy_prior(model_dir):
    drafters = standard_baselines(model_dir)
    assert list(drafters) == ["packed", "n-gram lookup", "packed + copy prior"]
    assert drafters["packed"].copy_policy.enabled is False
    assert drafters["packed + copy prior"].copy_policy == read_copy_policy(model_dir)
    assert isinstance(drafters["n-gram lookup"], CopyDrafter) and drafters["n-gram lookup"].policy.enabled
    # n-gram lookup alone: proposes what followed the last earlier occurrence of the context's suffix
    assert ngram_drafter({"enabled": False}).draft([1, 2, 3, 9, 1, 2], 4) == [3, 9, 1, 2]
    assert ngram_drafter(None).draft([5, 6, 7], 4) == []


def test_standard_baselines_draft_fixed_length_whatever_the_packs_threshold(tmp_path):
    """Acceptance at k is the baselines table's statistic: a pack's dynamic threshold must not cut its drafts short,
    while the pack as shipped (`engine_from_dir`) keeps it."""
    from drafter_lib.evaluation.drafters import engine_from_dir
    from drafter_lib.packed.config_keys import RECOMMENDED

    d = write_tiny_model_dir(tmp_path / "model", tiny_hf_model(seed=0))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "draft_min_confidence": 0.99}))  # a random model: stops early
    ctx = [5, 9, 3, 7, 11, 2]
    # verify=False: config.json changed after the manifest was written
    shipped = engine_from_dir(d, verify=False, min_confidence=RECOMMENDED)
    assert shipped.min_confidence == 0.99 and len(shipped.draft(ctx, 8)) < 8
    for name, drafter in standard_baselines(d, ngram=False, verify=False).items():
        assert len(drafter.draft(ctx, 8)) == 8, name


def test_peer_drafter_drafts_the_peer_models_own_greedy_tokens(tmp_path):
    """A peer named by a model spec (here a local HF folder) drafts exactly its fp32 model's greedy continuation."""
    import torch
    from target_helpers import tiny_target_model, write_target_dir

    from drafter_lib.evaluation.drafters import peer_drafter

    folder = write_target_dir(tmp_path / "peer", seed=5)
    model, _ = tiny_target_model(seed=5)
    ctx = [5, 9, 3, 7, 11, 2, 40, 41]
    want = model.generate(torch.tensor([ctx]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, len(ctx):]
    drafter = peer_drafter(str(folder))
    assert drafter.draft(ctx, 6) == want.tolist()
    assert drafter.min_confidence == 0.0 and not drafter.copy_policy.enabled
