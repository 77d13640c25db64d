"""Whether two models share one tokenizer, read without loading weights: the vocabulary (token -> id), the special
and stop ids (bos, eos, pad, the chat template's end-of-turn token, the study's stop ids) and the chat template (as
rendered for the conversations the study renders: two templates that differ only in a branch it never takes, such
as Qwen2.5-Coder 0.5B's and 1.5B's tool-calling text, count as one).

A drafter's tokens are the target's token ids, so the drafter base must tokenize exactly as the target does; the
study has no mapping between two vocabularies. Sources: a HF tokenizer's files (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`; a hub id at its pinned revision fetches only those), the metadata of
a GGUF file (the default teacher before its converted copy exists), or the byte tokenizer of the tiny random specs.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from drafter_lib.model import hf_models

# Rendered as the assistant's answer to find the token the chat template closes a turn with.
_ANSWER_MARK = "QZXQZX"
_SPECIAL_SHAPE = re.compile(r"^<[^<>\s]{1,40}>$")  # <|im_end|>, <|eot_id|>, </s>, <end_of_turn>


@dataclass
class TokenizerIdentity:
    source: str                       # where it was read: "tokenizer files of <dir>", "GGUF metadata of <file>"
    vocab: dict[str, int]             # token -> id, added tokens included
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    stop_ids: list[int]               # what the study stops answers on (common.chat.stop_token_ids)
    end_of_turn: str | None           # the token the chat template ends an assistant turn with, if it has one
    chat_template: str | None

    @property
    def end_of_turn_id(self) -> int | None:
        return None if self.end_of_turn is None else self.vocab.get(self.end_of_turn)


def _compile(chat_template: str):
    """The template compiled as `transformers` compiles it for apply_chat_template (its sandbox, filters and
    extensions), else with a plain jinja2 sandbox."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(chat_template)
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def fail(msg):
            raise ValueError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = fail
        return env.from_string(chat_template)


def end_of_turn_token(chat_template: str | None, vocab: dict[str, int], bos: str | None = None,
                      eos: str | None = None) -> str | None:
    """The special token right after an assistant answer when `chat_template` renders a user turn and an answer
    (ChatML: <|im_end|>), or None (no template, a template that does not render, or no special token there)."""
    if not chat_template:
        return None
    try:
        text = _compile(chat_template).render(
            messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _ANSWER_MARK}],
            add_generation_prompt=False, bos_token=bos or "", eos_token=eos or "")
    except Exception:  # a template this renderer cannot run: nothing to compare beyond the template text
        return None
    _, found, after = text.rpartition(_ANSWER_MARK)
    if not found:
        return None
    after = after.lstrip(" ")
    specials = [t for t in vocab if after.startswith(t) and _SPECIAL_SHAPE.match(t)]
    return max(specials, key=len) if specials else None


def from_tokenizer(tok, source: str) -> TokenizerIdentity:
    """The identity of a loaded `transformers` tokenizer (the object the study's stages use)."""
    from drafter_lib.common.chat import stop_token_ids

    vocab = {str(t): int(i) for t, i in tok.get_vocab().items()}
    try:
        stops = stop_token_ids(tok)
    except ValueError:
        stops = []
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return TokenizerIdentity(source, vocab, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, stops,
                             end_of_turn_token(template, vocab, tok.bos_token, tok.eos_token), template)


def from_gguf(path: str | Path) -> TokenizerIdentity:
    """The identity from a GGUF file's tokenizer metadata (tokenizer.ggml.*, tokenizer.chat_template): no tensor is
    read. The stop ids follow common.chat.stop_token_ids: eos plus <|im_end|> when the vocabulary has it."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def get(key):
        f = fields.get(key)
        return None if f is None else f.contents()

    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens in its metadata")
    vocab = {str(t): i for i, t in enumerate(tokens)}
    ids = {k: get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown")}
    ids = {k: None if v is None else int(v) for k, v in ids.items()}
    stops = {ids["eos"]} - {None}
    if vocab.get("<|im_end|>") not in (None, ids["unknown"]):
        stops.add(vocab["<|im_end|>"])
    template = get("tokenizer.chat_template")
    token = lambda i: None if i is None or i >= len(tokens) else str(tokens[i])
    return TokenizerIdentity(f"GGUF metadata of {Path(path).name}", vocab, ids["bos"], ids["eos"], ids["padding"],
                             sorted(stops), end_of_turn_token(template, vocab, token(ids["bos"]),
                                                              token(ids["eos"])), template)


def read_identity(spec: str, allow_download: bool = True) -> TokenizerIdentity | None:
    """The tokenizer identity of a model spec (hf_models), or None when a hub model's tokenizer files are neither
    cached nor downloadable. The default teacher: its converted copy's tokenizer files when they exist, else the
    packaged GGUF's metadata."""
    from transformers import AutoTokenizer

    if hf_models.is_tiny_spec(spec):
        from drafter_lib.model.tiny_models import byte_tokenizer

        hf_models.tiny_arch(spec)
        return from_tokenizer(byte_tokenizer(), f"the byte tokenizer of {spec}")
    kind, name, rev = hf_models.parse_model_spec(spec)
    if kind == "default":
        d = hf_models.default_tokenizer_dir()
        if d is not None:
            return from_tokenizer(AutoTokenizer.from_pretrained(d), f"tokenizer files of {hf_models.DEFAULT_TEACHER}")
        return from_gguf(hf_models.default_teacher_gguf())
    if kind == "parted":
        return from_tokenizer(hf_models.parted_tokenizer(name), f"tokenizer of {name}")
    if kind == "local":
        return from_tokenizer(AutoTokenizer.from_pretrained(name), f"tokenizer files of {name}")
    # a hub id: only its tokenizer files, at the pinned revision. An uncached one needs the hub: asked once, briefly
    # (transformers retries an unreachable hub for half a minute)
    from huggingface_hub import try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(name, "tokenizer_config.json", revision=rev), str)
    if not cached and (not allow_download or not hf_models.hub_status(name, rev)["reachable"]):
        return None
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=rev, local_files_only=cached)
    except Exception:  # not all of its files cached, or the download failed: the caller says it was skipped
        return None
    return from_tokenizer(tok, f"tokenizer files of {name}@{rev}")


def _token_list(tokens, n: int = 3) -> str:
    shown = ", ".join(repr(t) for t in tokens[:n])
    return shown + (f" and {len(tokens) - n} more" if len(tokens) > n else "")


def _sha(text: str | None) -> str:
    return "none" if text is None else hashlib.sha256(text.encode()).hexdigest()[:12]


def differences(a: TokenizerIdentity, b: TokenizerIdentity, names: tuple[str, str] = ("the first", "the second")
                ) -> list[str]:
    """What differs between two identities, one short phrase each (a's value first; `names` name a and b);
    [] when identical."""
    out = []
    if a.vocab != b.vocab:
        only_a = sorted((t for t in a.vocab if t not in b.vocab), key=a.vocab.get)
        only_b = sorted((t for t in b.vocab if t not in a.vocab), key=b.vocab.get)
        moved = sorted((t for t in a.vocab if t in b.vocab and a.vocab[t] != b.vocab[t]), key=a.vocab.get)
        parts = [f"{len(a.vocab)} vs {len(b.vocab)} tokens"]
        if moved:
            parts.append(f"{len(moved)} tokens with other ids (e.g. " + ", ".join(
                f"{t!r} {a.vocab[t]} vs {b.vocab[t]}" for t in moved[:3]) + ")")
        if only_a:
            parts.append(f"{len(only_a)} only in {names[0]} ({_token_list(only_a)})")
        if only_b:
            parts.append(f"{len(only_b)} only in {names[1]} ({_token_list(only_b)})")
        out.append("vocabulary: " + "; ".join(parts))
    for what, x, y in (("bos id", a.bos_id, b.bos_id), ("eos id", a.eos_id, b.eos_id),
                       ("pad id", a.pad_id, b.pad_id), ("stop ids", a.stop_ids, b.stop_ids)):
        if x != y:
            out.append(f"{what} {x} vs {y}")
    if (a.end_of_turn, a.end_of_turn_id) != (b.end_of_turn, b.end_of_turn_id):
        out.append(f"end-of-turn token {a.end_of_turn!r} (id {a.end_of_turn_id}) vs {b.end_of_turn!r} "
                   f"(id {b.end_of_turn_id})")
    if a.chat_template != b.chat_template and _renders(a) != _renders(b):
        out.append(f"chat template sha256 {_sha(a.chat_template)} vs {_sha(b.chat_template)}")
    return out


# The conversations the study renders (prompts with and without a system turn, a multi-turn history): two templates
# that render them alike differ only where the study never goes (e.g. the wording of a tool-calling branch).
_CONVERSATIONS = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _ANSWER_MARK},
     {"role": "user", "content": "More"}],
)


def _renders(t: TokenizerIdentity) -> tuple | str | None:
    """What `t`'s chat template renders for the study's conversations, with and without the generation prompt; the
    template text itself when it does not render here."""
    if not t.chat_template:
        return None
    ids = {i: tok for tok, i in t.vocab.items()}
    bos, eos = ids.get(t.bos_id, ""), ids.get(t.eos_id, "")
    try:
        template = _compile(t.chat_template)
        return tuple(template.render(messages=list(m), add_generation_prompt=g, bos_token=bos, eos_token=eos)
                     for m in _CONVERSATIONS for g in (False, True))
    except Exception:  # a template this renderer cannot run: compare the text
        return t.chat_template
