"""`specdraft-generate`: the text it streams is the target's own greedy answer, its closing line gives the speed and
the tokens per target step, and bad input stops it with one clear line. A tiny random target (a Hugging Face
folder) and the same target packed as its drafter."""

from __future__ import annotations

import json

import pytest
from target_helpers import decoded, reference

from drafter_lib.serve.generate_cli import main


def _run(capsys, *argv) -> tuple[str, str]:
    main([str(a) for a in argv])
    out = capsys.readouterr()
    return out.out, out.err


def test_streams_the_targets_greedy_text_with_and_without_the_drafter(generation_dirs, generation_runtime, capsys,
                                                                      tmp_path):
    from drafter_lib.common.chat import encode_chat

    target, drafter = generation_dirs
    common = ("--target", target, "--max-tokens", 40)
    text, tokens, _ = reference(generation_runtime, generation_runtime.tokenizer.encode("Once upon"), 40)
    out, err = _run(capsys, *common, "--model-dir", drafter, "--prompt", "Once upon", "--k", 8)
    assert out == text
    assert "tokens/s" in err and "tokens per step" in err and f"{len(tokens)} tokens in" in err
    out, err = _run(capsys, *common, "--no-drafter", "--prompt", "Once upon")
    assert out == text and f"{len(tokens)} target steps, 1.00 tokens per step" in err and "no drafter" in err
    # prompt lookup: drafts copied from the context (the tiny target's answer repeats some of its n-grams), the same
    # text whether they are taken or not
    long_text, long_tokens, _ = reference(generation_runtime, generation_runtime.tokenizer.encode("Once upon"), 120)
    out, err = _run(capsys, "--target", target, "--max-tokens", 120, "--prompt-lookup", "--prompt", "Once upon")
    assert out == long_text and "prompt lookup" in err
    assert int(err.split(" draft tokens accepted")[0].rsplit(" ", 1)[-1]) > 0  # it drafted

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat_text = reference(generation_runtime, encode_chat(generation_runtime.tokenizer, messages), 40)[0]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": messages}))
    assert _run(capsys, *common, "--model-dir", drafter, "--messages", path)[0] == chat_text
    user_only = reference(generation_runtime, encode_chat(generation_runtime.tokenizer, messages[1:]), 40)
    assert _run(capsys, *common, "--model-dir", drafter, "--chat", "Hello")[0] == user_only[0]

    stop = user_only[0][5:7]
    out, err = _run(capsys, *common, "--model-dir", drafter, "--chat", "Hello", "--stop", stop)
    assert out == user_only[0][:user_only[0].index(stop)] and "finish: stop" in err
    assert decoded(generation_runtime.tokenizer, user_only[1]).startswith(out)


@pytest.mark.parametrize("argv, words", [
    (["--max-tokens", "0", "--prompt", "x"], ["--max-tokens must be at least 1"]),
    (["--k", "0", "--prompt", "x"], ["--k must be at least 1"]),
    (["--min-confidence", "2", "--prompt", "x"], ["--min-confidence must be in [0, 1]"]),
    (["--chat", " "], ["--chat is empty"]),
    (["--prompt", "x", "--chat", "y"], ["not allowed with argument"]),
    ([], ["one of the arguments --prompt --chat --messages is required"]),
    (["--numerics", "int4", "--prompt", "x"], ["invalid choice"]),
    (["--prompt-lookup", "--no-drafter", "--prompt", "x"], ["not allowed with argument"]),
    (["--prompt-lookup", "--min-confidence", "0.5", "--prompt", "x"], ["not with --prompt-lookup"]),
])
def test_bad_arguments_stop_with_a_usage_line(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_bad_input_stops_with_one_clear_line(generation_dirs, tmp_path):
    target, drafter = generation_dirs
    common = ["--target", str(target), "--model-dir", str(drafter)]
    bad_role = tmp_path / "bad_role.json"
    bad_role.write_text(json.dumps([{"role": "robot", "content": "hi"}]))
    not_json = tmp_path / "not.json"
    not_json.write_text("[{")
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    for argv, words in [
        (["--messages", str(bad_role)], ["messages[0].role", "robot"]),
        (["--messages", str(not_json)], ["is not JSON"]),
        (["--messages", str(empty)], ["holds no messages"]),
        (["--messages", str(tmp_path / "missing.json")], ["cannot read"]),
        (["--model-dir", str(tmp_path), "--prompt", "x"], ["holds no packed drafter"]),
        (["--prompt", "x" * 300], ["leaves no room", "context is 256"]),
        (["--prompt", "x" * 200, "--max-tokens", "100"], ["at most 56 new tokens"]),
        (["--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d", "--stop", "e", "--prompt", "x"], ["at most 4"]),
    ]:
        with pytest.raises(SystemExit) as e:
            main(common + argv)
        message = str(e.value.code)
        assert message.startswith("specdraft-generate: ") and "\n" not in message, message
        for w in words:
            assert w in message, (w, message)
