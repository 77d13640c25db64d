"""Speculative decoding through a real server is lossless (output == the target's greedy `generate`) and takes the
same steps as the same loop with the engine in process."""

from __future__ import annotations

import pytest
import torch
from server_helpers import TINY_VOCAB, ServerProcess, tiny_hf_model, write_tiny_model_dir

from drafter_lib.decoding.speculative import NativeTarget, speculative_generate
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.model.transformer import Transformer
from drafter_lib.serve.client import DraftServerError, SpeculativeClient

EOS = 258  # the byte tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def target():
    return tiny_hf_model(seed=0)


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    # The drafter is the target itself, packed to int8: drafts agree often but not always, so both the
    # accept and the reject paths of verification run.
    return write_tiny_model_dir(tmp_path_factory.mktemp("drafter") / "model", target, bits=8)


@pytest.fixture(scope="module")
def client(drafter_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client")
    with ServerProcess(drafter_dir, tmp / "server.log", via_serve_sh=False) as srv, SpeculativeClient(srv.url) as c:
        yield c


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
        out = speculative_generate(target, prompt, max_new_tokens=32, drafter=client, k=k, stop_ids=[EOS])
        assert out.tokens == ref
        if out.tokens[-1] != EOS:  # (an EOS inside an accepted draft cuts the last step short)
            assert sum(out.accepted_lengths) + out.steps == len(out.tokens)
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
    out = speculative_generate(other, prompt, max_new_tokens=24, drafter=client, k=8, stop_ids=[EOS])
    assert out.tokens == ref


def test_in_process_and_http_loops_agree(target, client, drafter_dir):
    # The same packed drafter in this process and behind the server: same drafts, so the same loop takes the same
    # steps; the native decoder as target verifies the HTTP drafts the same way the transformers model does.
    engine = DraftEngine.from_dir(drafter_dir)
    native = NativeTarget(Transformer.from_hf(target.config.to_dict(), target.state_dict()))
    for prompt in _prompts():
        for k in (4, 16):
            local = speculative_generate(target, prompt, 32, engine, k, stop_ids=[EOS])
            remote = speculative_generate(target, prompt, 32, client, k, stop_ids=[EOS])
            native_remote = speculative_generate(native, prompt, 32, client, k, stop_ids=[EOS])
            assert local.tokens == remote.tokens == native_remote.tokens
            assert local.steps == remote.steps == native_remote.steps
            assert local.accepted_lengths == remote.accepted_lengths == native_remote.accepted_lengths
            assert local.draft_lengths == remote.draft_lengths
            assert local.mean_acceptance_length == remote.mean_acceptance_length > 1.0


def test_client_surfaces_server_errors(client):
    with pytest.raises(DraftServerError, match="tokens\\[0\\]"):
        client.draft([TINY_VOCAB + 5], 4)
    assert len(client.draft([1, 2, 3], 4)) == 4
    assert client.info()["vocab_size"] == TINY_VOCAB


def test_min_confidence_passes_through_and_stays_lossless(target, client, drafter_dir):
    eng = DraftEngine.from_dir(drafter_dir)
    for p in _prompts() + [[5, 6, 7, 8], [100, 3, 250, 7, 7]]:
        full = eng.draft(p, 8, return_probs=True)
        # a threshold halfway between a new running minimum of the probabilities and the earlier ones: stops there
        cases = [((full.probs[j] + min(full.probs[:j])) / 2, j) for j in range(1, 8)
                 if full.probs[j] < min(full.probs[:j]) - 0.005]
        if cases:
            break
    c, j = cases[-1]
    assert client.draft_response(p, 8, return_probs=True)["probs"] == pytest.approx(full.probs, abs=1e-4)
    assert client.draft(p, 8, min_confidence=c) == eng.draft(p, 8, min_confidence=c) == full[:j]
    assert client.draft(p, 8, min_confidence=0) == full

    class Dynamic:
        def draft(self, tokens, k):
            return client.draft(tokens, k, min_confidence=0.5)

    native = NativeTarget(Transformer.from_hf(target.config.to_dict(), target.state_dict()).eval())
    plain = speculative_generate(native, p, 24, None, stop_ids=[EOS])
    dyn = speculative_generate(native, p, 24, Dynamic(), k=8, stop_ids=[EOS])
    assert dyn.tokens == plain.tokens
