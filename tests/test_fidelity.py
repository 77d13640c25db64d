"""evaluation/fidelity.py: answers, first differences and teacher-forced top-1 agreement against a reference."""
import pytest

from drafter_lib.decoding.speculative import HFTarget, NativeTarget, greedy_decode
from drafter_lib.evaluation.fidelity import fidelity, first_difference, teacher_forced_top1
from drafter_lib.model.transformer import Transformer


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [4]) == 0


def test_the_same_model_agrees_everywhere_and_a_shifted_one_nowhere(tiny_target):
    hf, _ = tiny_target
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    refs = [greedy_decode(HFTarget(hf, linears="stock"), p, 12) for p in prompts]
    same = fidelity(NativeTarget(Transformer.from_hf_model(hf), linears="stock"), prompts, refs, 12)
    assert same["identical"] == 1.0 and same["tokens_to_first_difference"] == 12.0
    assert same["top1_agreement"] == 1.0 and same["positions"] == 24

    class Shifted:  # the reference's logits rolled by one id: every argmax is off by one
        def __init__(self, target):
            self.target, self.vocab_size = target, target.vocab_size

        def __getattr__(self, name):
            return getattr(self.target, name)

        def score(self, tokens, keep=None):
            return self.target.score(tokens, keep).roll(1, dims=-1)

    off = fidelity(Shifted(HFTarget(hf, linears="stock")), prompts, refs, 12)
    assert off["identical"] == 0.0 and off["tokens_to_first_difference"] == 0.0 and off["top1_agreement"] == 0.0


def test_teacher_forcing_reads_the_answer_in_one_pass(tiny_target):
    hf, _ = tiny_target
    target = HFTarget(hf, linears="stock")
    ref = greedy_decode(target, [9, 10, 11], 8)
    assert teacher_forced_top1(target, [9, 10, 11], ref) == [True] * 8
    assert teacher_forced_top1(target, [9, 10, 11], []) == []
    with pytest.raises(ValueError, match="one reference answer per prompt"):
        fidelity(target, [[1, 2]], [], 4)
