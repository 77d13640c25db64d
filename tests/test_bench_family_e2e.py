"""bench/family_e2e.py's own pieces: its options, and reading llama.cpp's speculative tool."""
import subprocess
from pathlib import Path

import pytest

from bench.family_e2e import answer_text, llama_speculative_command, make_parser, parse_speculative_log

TOOL = Path(__file__).resolve().parents[1] / "build/llama-speculative/cmake/bin/llama-speculative-simple"
# the closing report of llama-speculative-simple (llama-cpp-python 0.3.36's llama.cpp), log prefixes included
REPORT = """0.31.700.267 I encoded   14 tokens in    7.108 seconds, speed:    1.970 t/s
0.31.700.293 I decoded   15 tokens in   16.076 seconds, speed:    0.933 t/s
0.31.700.309 I
0.31.700.324 I n_draft   = 4
0.31.700.339 I n_predict = 15
0.31.700.354 I n_drafted = 12
0.31.700.369 I n_accept  = 12
"""


def test_options_default_to_tree_rows_and_no_extra_rows():
    args = make_parser().parse_args([])
    assert (args.tree_budgets, args.http, args.llama_speculative) == ([8], False, None)
    assert make_parser().parse_args(["--tree-budgets"]).tree_budgets == []  # no tree rows


def test_the_tools_report_gives_tokens_seconds_and_passes():
    tokens, seconds, steps = parse_speculative_log(REPORT)
    assert (tokens, steps) == (15, 3)  # 12 drafts accepted in 3 passes, each adding one token of its own
    assert seconds == pytest.approx(7.108 + 16.076)  # the prompt's pass counts, as in the other rows
    with pytest.raises(ValueError, match="no encoded/decoded report"):
        parse_speculative_log("error: failed to initialize speculative decoding")


def test_the_answer_is_what_follows_the_echoed_prompt():
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert answer_text(f"\n\n{prompt}Hello!\n\n", prompt) == "Hello!\n\n"
    assert answer_text("nothing echoed", prompt) is None


def test_the_command_drafts_greedily_with_the_peer():
    cmd = llama_speculative_command("tool", "t.gguf", "p.gguf", "prompt", 16, 4, 2)
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["-md"] == "p.gguf" and flags["--spec-type"] == "draft-simple" and flags["--temp"] == "0"
    assert (flags["--spec-draft-n-max"], flags["-n"], flags["-t"]) == ("4", "16", "2")


@pytest.mark.skipif(not TOOL.exists(), reason="bench/build_llama_speculative.sh has not been run")
def test_the_built_tool_knows_every_flag_passed():
    help_text = subprocess.run([str(TOOL), "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in llama_speculative_command(str(TOOL), "t", "p", "x", 16, 4, 2)[1::2]:
        assert flag in help_text, flag
