"""Chat prompts and where answers stop: the helpers every stage that talks to a chat model shares."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def prompt_messages(record: dict) -> list[dict]:
    """Chat messages of a prompt record: project format ("messages") or question.jsonl ("turns", first turn)."""
    if record.get("messages"):
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if record.get("turns"):
        return [{"role": "user", "content": record["turns"][0]}]
    rid = record.get("id", record.get("question_id"))
    raise ValueError(f"prompt record {rid!r} has neither 'messages' nor 'turns'")


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant header (add_generation_prompt)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older/newer transformers return shapes differ
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def stop_token_ids(tokenizer) -> list[int]:
    """EOS plus <|im_end|> (the chat turn terminator) when the vocabulary has it."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
        ids.add(im_end)
    if not ids:
        raise ValueError("tokenizer has neither an eos token nor <|im_end|>: cannot tell where answers stop")
    return sorted(ids)


def cut_at_stop(tokens: Sequence[int], stop_ids: Iterable[int], max_new_tokens: int) -> list[int]:
    """Keep tokens up to and including the first stop token, at most max_new_tokens."""
    stop = set(stop_ids)
    out = []
    for t in list(tokens)[:max_new_tokens]:
        out.append(int(t))
        if t in stop:
            break
    return out
