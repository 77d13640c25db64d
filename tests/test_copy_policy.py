import json

import pytest

from drafter_lib.packed.copy_policy import CopyPolicy


def test_match_proposes_following_tokens():
    p = CopyPolicy(enabled=True, max_ngram=3, min_ngram=2, max_copy=16)
    toks = [1, 2, 3, 4, 5, 6, 7, 9, 9, 2, 3]  # suffix [2,3] occurred at 1 -> continue with 4,5,6,...
    assert p.propose(toks, 4) == [4, 5, 6, 7]
    assert p.propose(toks, 100) == [4, 5, 6, 7, 9, 9, 2, 3]  # bounded by what follows in the request


def test_longest_ngram_and_latest_occurrence_win():
    p = CopyPolicy(enabled=True, max_ngram=3, min_ngram=1, max_copy=2)
    # [8,2,3] matches at 5 (-> 70,71); [2,3] alone would match later at 10 (-> 90)
    toks = [0, 2, 3, 50, 51, 8, 2, 3, 70, 71, 2, 3, 90, 8, 2, 3]
    assert p.propose(toks, 16) == [70, 71]
    # unigram: latest earlier 3 is at index 11 -> [90, 8]
    assert CopyPolicy(enabled=True, max_ngram=1, min_ngram=1, max_copy=2).propose(toks, 16) == [90, 8]


def test_no_match_and_disabled():
    p = CopyPolicy(enabled=True, max_ngram=3, min_ngram=2)
    assert p.propose([1, 2, 3, 4, 5], 8) == []
    assert p.propose([7], 8) == []
    off = CopyPolicy(enabled=False)
    assert off.propose([1, 2, 3, 1, 2], 8) == []
    assert CopyPolicy.from_dict(None).enabled is False


def test_load_and_validation(tmp_path):
    f = tmp_path / "copy_policy.json"
    f.write_text(json.dumps({"enabled": True, "max_ngram": 4, "min_ngram": 1, "max_copy": 8, "mode": "accelerate",
                             "note": "ignored"}))
    p = CopyPolicy.load(f)
    assert (p.enabled, p.max_ngram, p.min_ngram, p.max_copy, p.mode) == (True, 4, 1, 8, "accelerate")
    with pytest.raises(ValueError, match="mode"):
        CopyPolicy(enabled=True, mode="nope")
    with pytest.raises(ValueError, match="min_ngram"):
        CopyPolicy(enabled=True, min_ngram=3, max_ngram=2)
