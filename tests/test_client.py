"""Speculative decoding through a real server is lossless: output == the target's greedy `generate`."""

from __future__ import annotations

import pytest
import torch
from server_helpers import TINY_VOCAB, ServerProcess, tiny_hf_model, write_tiny_model_dir

from drafter_lib.client import DraftServerError, SpeculativeClient, greedy_verify, speculative_generate

EOS = 258  # the byte tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def target():
    return tiny_hf_model(seed=0)


@pytest.fixture(scope="module")
def client(target, tmp_path_factory):
    # The drafter is the target itself, packed to int8: drafts agree often but not always, so both the
    # accept and the reject paths of verification run.
    tmp = tmp_path_factory.mktemp("client")
    model_dir = write_tiny_model_dir(tmp / "drafter", target, bits=8)
    with ServerProcess(model_dir, tmp / "server.log", via_serve_sh=False) as srv, SpeculativeClient(srv.url) as c:
        yield c


def test_greedy_verify():
    assert greedy_verify([5, 6, 7], [5, 6, 7, 8]) == (3, 8)
    assert greedy_verify([5, 6, 7], [5, 9, 7, 8]) == (1, 9)
    assert greedy_verify([5, 6, 7], [4, 6, 7, 8]) == (0, 4)
    assert greedy_verify([], [3]) == (0, 3)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY_VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40)]


@pytest.mark.parametrize("k", [1, 4, 16])
def test_speculative_output_equals_greedy_generate(target, client, k):
    means = []
    for prompt in _prompts():
        with torch.inference_mode():
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=EOS,
                                  pad_token_id=EOS)[0, len(prompt):].tolist()
        out = speculative_generate(target, client, prompt, max_new_tokens=32, num_draft_tokens=k, eos_token_id=EOS)
        assert out.tokens == ref
        if out.tokens[-1] != EOS:  # (an EOS inside an accepted draft cuts the last step short)
            assert sum(out.accepted_lengths) + out.target_steps == len(out.tokens)
        assert all(0 <= a <= d <= k for a, d in zip(out.accepted_lengths, out.draft_lengths))
        means.append(out.mean_acceptance_length)
    # A quantized copy of the target drafts well: clearly more than one token per target step on average.
    assert sum(means) / len(means) > 1.5


def test_wrong_drafter_is_still_lossless(target, client):
    # A different target (other seed) barely agrees with the drafter, so nearly every draft gets rejected.
    other = tiny_hf_model(seed=1)
    prompt = _prompts()[1]
    with torch.inference_mode():
        ref = other.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=EOS,
                             pad_token_id=EOS)[0, len(prompt):].tolist()
    out = speculative_generate(other, client, prompt, max_new_tokens=24, num_draft_tokens=8, eos_token_id=EOS)
    assert out.tokens == ref


def test_client_surfaces_server_errors(client):
    with pytest.raises(DraftServerError, match="tokens\\[0\\]"):
        client.draft([TINY_VOCAB + 5], 4)
    assert len(client.draft([1, 2, 3], 4)) == 4
    assert client.info()["vocab_size"] == TINY_VOCAB
