"""The server's settings: environment variables, each typed and range-checked before anything is loaded.

A bad value stops the server at once with one line per variable naming it, the value and what is allowed
(`describe_errors`). Authentication: `API_KEY` (one key) and/or `API_KEYS_FILE` (one key a line, `#` comments)
make every endpoint but /health require `Authorization: Bearer <key>`. Without a key the server only listens on
a loopback address, unless `BEHIND_AUTH_PROXY=1` says that a proxy in front of it authenticates the clients.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from drafter_lib.common.layout import MODEL_DIR
from drafter_lib.packed.config_keys import ENGINE_DTYPES, RECOMMENDED, check_min_confidence

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# decoding/runtime.py's NUMERICS, spelled out so that reading the settings imports no torch (a test keeps them equal)
TARGET_NUMERICS = ("auto", "gguf", "w8a8", "w4a8", "fp32")
GENERATION_DRAFTERS = ("model", "prompt-lookup", "none")  # text_generation.GENERATION_DRAFTERS, the same way
PROMPT_LOOKUP_TOKENS = 4  # text_generation.PROMPT_LOOKUP_TOKENS
LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: only the loopback names above count
        return False


class Settings(BaseSettings):
    """Every setting of the HTTP drafter. Field names are the environment variables, upper-cased."""

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore", validate_default=True,
                                      hide_input_in_errors=False)

    model_dir: str = str(MODEL_DIR)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)  # ~250k token ids as JSON; above any model's context
    batch_window_ms: float = Field(20.0, ge=0, le=1000)  # max wait for stragglers (batching.py); 0 = never wait
    max_batch: int = Field(32, ge=1, le=1024)
    log_level: Literal[LOG_LEVELS] = "info"
    log_format: Literal["text", "json"] = "text"
    engine_dtype: Literal[ENGINE_DTYPES] | None = None  # None: the model dir's draft_engine_dtype, else "auto"
    max_queue: int = Field(128, ge=1)  # requests waiting for a batch before 503
    request_timeout_s: float = Field(30.0, gt=0)  # a request not answered by then gets 503
    max_cache_mb: float = Field(256.0, ge=0)  # prefix KV cache bound
    max_batch_tokens: int = Field(4096, ge=1)  # in-flight KV slots per decode group (DraftEngine)
    shutdown_timeout_s: float | None = Field(None, ge=0)  # drain bound on SIGTERM; None = request_timeout_s + 5
    # threshold of requests that set no min_confidence: None = off (exactly num_draft_tokens tokens), a number in
    # [0, 1], or "recommended" (the model dir's draft_min_confidence)
    default_min_confidence: float | Literal[RECOMMENDED] | None = None
    # the target model of the OpenAI-compatible endpoints (openai_api.py): a target spec (`smollm2-135m-instruct`) or
    # a Hugging Face folder; unset: the drafter alone, as before. TARGET_DIR is the same setting.
    target: str | None = Field(None, validation_alias=AliasChoices("target", "target_dir"))
    target_numerics: Literal[TARGET_NUMERICS] = "auto"  # how its linears multiply (decoding/runtime.py)
    # what drafts its generations: the packed drafter of MODEL_DIR, prompt lookup (n-gram matches in the generation's
    # own context, no model) or nothing; and the most tokens drafted a target step (None: 16 for the pack, whose
    # drafts stop at its confidence threshold, 4 for prompt lookup: text_generation.PROMPT_LOOKUP_TOKENS)
    generation_drafter: Literal[GENERATION_DRAFTERS] = "model"
    generation_draft_tokens: int | None = Field(None, ge=1, le=64)
    # the bound of a chat answer that sets no max_tokens (and of what the context leaves: the smaller wins)
    generation_default_max_tokens: int = Field(2048, ge=1, le=1_000_000)
    # generations waiting for a running one to end (GENERATION_MAX_QUEUE) before 503, and how long one may wait to
    # start (GENERATION_TIMEOUT_S): apart from /draft's MAX_QUEUE and REQUEST_TIMEOUT_S, as an answer takes minutes
    generation_max_queue: int = Field(16, ge=1)
    generation_timeout_s: float = Field(300.0, gt=0)
    # generations running at once, each on a KV cache of its own, taking turns on the engine thread; and the prompt
    # tokens a generation reads per target pass before its first step: /draft batches and the other generations run
    # between its passes, so a long prompt holds them up for one chunk's pass, not for the whole prompt's (128: as
    # fast a prefill as one pass or chunks of 256 and 512, measured, with the shortest passes: docs/serving.md)
    generation_max_running: int = Field(4, ge=1, le=64)
    generation_prefill_chunk: int = Field(128, ge=1)
    api_key: SecretStr | None = None
    api_keys_file: Path | None = None
    behind_auth_proxy: bool = False

    @field_validator("log_level", "log_format", "engine_dtype", "target_numerics", "generation_drafter", mode="before")
    @classmethod
    def _lower_case_words(cls, value):
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("api_key", "engine_dtype", "shutdown_timeout_s", "api_keys_file", "target",
                     "generation_draft_tokens", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("default_min_confidence", mode="before")
    @classmethod
    def _threshold(cls, value):
        if isinstance(value, str):
            value = value.strip().lower() or None
        if value is None or value == RECOMMENDED:
            return value
        try:
            return check_min_confidence(float(value))
        except (TypeError, ValueError):
            raise ValueError(f"must be a number in [0, 1] or {RECOMMENDED!r}") from None

    @field_validator("api_keys_file")
    @classmethod
    def _keys_file_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"no such file: {str(path)!r}")
        return path

    @model_validator(mode="after")
    def _keys_or_loopback(self) -> Settings:
        if not self.api_keys() and not self.behind_auth_proxy and not is_loopback(self.host):
            raise ValueError(f"HOST={self.host!r} is not a loopback address and no API_KEY / API_KEYS_FILE is set: "
                             "set a key, or BEHIND_AUTH_PROXY=1 if a proxy in front authenticates the clients")
        return self

    @classmethod
    def from_env(cls) -> Settings:
        return cls()

    @property
    def drain_s(self) -> float:
        return self.request_timeout_s + 5 if self.shutdown_timeout_s is None else self.shutdown_timeout_s

    @property
    def draft_tokens(self) -> int:
        """k of the target's generations: GENERATION_DRAFT_TOKENS, else the default of GENERATION_DRAFTER's kind."""
        from drafter_lib.serve.schema import DEFAULT_DRAFT_TOKENS

        if self.generation_draft_tokens is not None:
            return self.generation_draft_tokens
        return PROMPT_LOOKUP_TOKENS if self.generation_drafter == "prompt-lookup" else DEFAULT_DRAFT_TOKENS

    @property
    def target_name(self) -> str | None:
        """The served target's model name: a folder's own name (no machine path), else the spec as given."""
        if self.target is None:
            return None
        path = Path(self.target)
        return path.name if path.is_dir() else self.target

    def api_keys(self) -> list[str]:
        """The accepted bearer keys (empty: no authentication)."""
        keys = [self.api_key.get_secret_value()] if self.api_key else []
        if self.api_keys_file is not None:
            for line in self.api_keys_file.read_text().splitlines():
                if (key := line.split("#", 1)[0].strip()):
                    keys.append(key)
        return keys

    def public(self) -> dict:
        """What /info may show: no keys, no machine paths."""
        hidden = {"api_key", "api_keys_file", "model_dir", "target"}
        return {"model": Path(self.model_dir).name, "target": self.target_name,
                "auth": "bearer" if self.api_keys() else "none",
                **{k: v for k, v in self.model_dump().items() if k not in hidden}, "shutdown_timeout_s": self.drain_s}


def describe_errors(exc: ValidationError) -> list[str]:
    """One line per bad variable: its name, the value given, what is allowed."""
    lines = []
    for err in exc.errors(include_url=False):
        name = str(err["loc"][0]).upper() if err.get("loc") else ""
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if name:
            lines.append(f"{name}={err.get('input')!r}: {msg}")
        else:  # a check across variables (model_validator)
            lines.append(msg)
    return lines
