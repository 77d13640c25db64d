"""The `specdraft-generate` command: the target answers a prompt greedily, with the packed drafter proposing its next
tokens, and the text streams to the terminal as the target accepts it.

    specdraft-generate --chat "Write a haiku about CPUs."
    specdraft-generate --prompt "def fibonacci(n):" --max-tokens 64 --stop "\\n\\n"
    specdraft-generate --messages chat.json --no-drafter          # plain greedy decoding, the baseline
    specdraft-generate --chat "Fix this: ..." --prompt-lookup     # drafts copied from the context, no drafter model

The text goes to stdout; the figures (tokens per second, tokens per target step) to stderr at the end. The output
is the target's own greedy answer whatever the drafter proposes; only the speed depends on it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from drafter_lib.common.layout import MODEL_DIR
from drafter_lib.common.openmp_wait import bounded_spin
from drafter_lib.serve.settings import PROMPT_LOOKUP_TOKENS, TARGET_NUMERICS

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_MAX_TOKENS = 256


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="specdraft-generate", description="Generate text with a target model, "
                                 "drafted by the packed drafter (speculative decoding, greedy: the target's own "
                                 "answer, faster).")
    ap.add_argument("--target", default=DEFAULT_TARGET, help="the target: a target spec or a Hugging Face folder "
                    f"(default: {DEFAULT_TARGET})")
    drafter = ap.add_mutually_exclusive_group()
    drafter.add_argument("--model-dir", default=str(MODEL_DIR), help="the packed drafter (default: model/)")
    drafter.add_argument("--no-drafter", action="store_true", help="plain greedy decoding, one token per step")
    drafter.add_argument("--prompt-lookup", action="store_true", help="draft by prompt lookup: the tokens that "
                         "followed the context's last few tokens where they occurred before (no drafter model)")
    prompt = ap.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="raw text to continue (no chat template)")
    prompt.add_argument("--chat", help="a user message, through the target's chat template")
    prompt.add_argument("--messages", type=Path, help="a JSON file of chat messages: "
                        '[{"role": "system"|"user"|"assistant", "content": "..."}, ...]')
    ap.add_argument("--max-tokens", type=int, default=None, help=f"most new tokens (default: {DEFAULT_MAX_TOKENS}, "
                    "or what the target's context leaves)")
    ap.add_argument("--k", type=int, default=None, help="most tokens drafted per target step (default: 16; "
                    f"{PROMPT_LOOKUP_TOKENS} with --prompt-lookup, whose drafts have no confidence to stop them)")
    ap.add_argument("--min-confidence", type=float, default=None, help="stop a draft below this drafter "
                    "probability (default: the pack's recommendation; 0: always k tokens)")
    ap.add_argument("--stop", action="append", default=None, metavar="TEXT",
                    help="end the answer before this text (up to 4 times)")
    ap.add_argument("--numerics", choices=TARGET_NUMERICS, default=TARGET_NUMERICS[0],
                    help=f"how the target's linears multiply (default: {TARGET_NUMERICS[0]})")
    args = ap.parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 1:
        ap.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.k is None:
        args.k = PROMPT_LOOKUP_TOKENS if args.prompt_lookup else 16
    if args.k < 1:
        ap.error(f"--k must be at least 1, got {args.k}")
    if args.min_confidence is not None and (args.prompt_lookup or args.no_drafter):
        ap.error("--min-confidence is a drafter model's threshold: not with --prompt-lookup or --no-drafter")
    if args.min_confidence is not None and not 0 <= args.min_confidence <= 1:
        ap.error(f"--min-confidence must be in [0, 1], got {args.min_confidence}")
    if args.chat is not None and not args.chat.strip():
        ap.error("--chat is empty")
    if args.prompt is not None and not args.prompt:
        ap.error("--prompt is empty")
    return args


def read_messages(path: Path) -> list[dict]:
    """Chat messages from a JSON file (a list, or an object with "messages"), checked as the server checks them."""
    from pydantic import TypeAdapter, ValidationError

    from drafter_lib.serve.openai_schema import ApiError, ChatMessage, check_messages, describe_error

    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"--messages: cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"--messages: {path} is not JSON: {e}") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    try:
        messages = TypeAdapter(list[ChatMessage]).validate_python(data)
    except ValidationError as e:
        raise ValueError(f"--messages: {path}: messages{describe_error(e.errors(include_url=False)[0])}") from None
    if not messages:
        raise ValueError(f"--messages: {path} holds no messages")
    try:
        check_messages(messages)
    except ApiError as e:
        raise ValueError(f"--messages: {path}: {e}") from None
    return [m.as_template_input() for m in messages]


def main(argv=None) -> None:
    args = parse_args(argv)
    bounded_spin()  # before torch is imported
    try:
        run(args)
    except ValueError as e:  # bad input, or a model that does not fit: one clear line
        sys.exit(f"specdraft-generate: {e}")


def run(args: argparse.Namespace) -> None:
    from drafter_lib.decoding.runtime import load_target_runtime
    from drafter_lib.decoding.text_generation import (
        TextGeneration,
        chat_prompt_ids,
        completion_prompt_ids,
        generation_drafter,
    )

    messages = read_messages(args.messages) if args.messages is not None else None
    kind = "none" if args.no_drafter else "prompt-lookup" if args.prompt_lookup else "model"
    t0 = time.perf_counter()
    engine = load_drafter(args.model_dir) if kind == "model" else None
    try:
        runtime = load_target_runtime(args.target, numerics=args.numerics)
    except (OSError, ImportError) as e:
        raise ValueError(f"cannot load the target {args.target!r}: {e}") from None
    drafter = generation_drafter(kind, runtime, engine, args.min_confidence)
    if args.prompt is not None:
        ids = completion_prompt_ids(runtime, args.prompt)
    else:
        ids = chat_prompt_ids(runtime, messages or [{"role": "user", "content": args.chat}])
    max_tokens = args.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, runtime.context_length - len(ids)))
    generation = TextGeneration(runtime, ids, max_tokens, drafter, args.k, args.stop)
    what = {"model": f"drafter {Path(args.model_dir).name}", "prompt-lookup": "prompt lookup", "none": "no drafter"}
    print(f"[{runtime.name} ({args.numerics}), {what[kind]}"
          f"; loaded in {time.perf_counter() - t0:.1f} s; prompt {len(ids)} tokens]", file=sys.stderr, flush=True)
    try:
        for delta in generation:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
    print(file=sys.stderr)
    print(summary(generation), file=sys.stderr)


def load_drafter(model_dir: str):
    from drafter_lib.engine.draft_engine import DraftEngine

    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"--model-dir {model_dir!r} holds no packed drafter (no config.json); pass --model-dir or "
                         "--no-drafter")
    return DraftEngine.from_dir(model_dir)


def summary(generation) -> str:
    s = generation.stats
    return (f"[{s.completion_tokens} tokens in {s.seconds:.2f} s: {s.tokens_per_second:.1f} tokens/s; "
            f"{s.target_steps} target steps, {s.mean_acceptance_length:.2f} tokens per step (mean acceptance "
            f"length); {s.accepted_tokens} of {s.draft_tokens} draft tokens accepted; finish: "
            f"{generation.finish_reason or 'interrupted'}]")


if __name__ == "__main__":
    main()
