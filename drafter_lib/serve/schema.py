"""What POST /draft accepts and returns, and the OpenAPI document that says so exactly.

The request model is built when the app is created (the model is loaded first), so the published schema carries the real
bounds: ids are integers in [0, vocab_size), `tokens` has 1..max_tokens items, `num_draft_tokens` is in 1..max_draft;
optional `min_confidence` (a number in [0, 1], or null = the server's default: off unless the operator set one) and
`return_probs` (a boolean, default false). max_tokens = max_context - max_draft, so every request the schema admits fits
the model's context (JSON Schema cannot bound the sum of two fields). Optional `tree` ({"budget": 1..64, default 8,
"max_depth": 1..max_draft or null = num_draft_tokens, "branch": 1..16, default 4}; null = absent) asks for a draft tree
instead of a chain; every field combination the schema admits is served (a tree ignores `min_confidence`).

The document is OpenAPI 3.0.3, whose schemas follow JSON Schema draft 4 (Wright-00): an integer there is a
number without a fraction part, so `13.0` is not an integer id and the server's 422 for it is what the schema
says. (In OpenAPI 3.1 / JSON Schema 2020-12, `13.0` *is* the integer 13, and a fuzzer rightly flagged the 422.)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, create_model

DEFAULT_DRAFT_TOKENS = 16
MAX_DRAFT_TOKENS = 64  # a draft longer than this is almost never accepted in full; bounds the work per request
REQUEST_FIELDS = ("tokens", "num_draft_tokens", "min_confidence", "return_probs", "tree")
TREE_FIELDS = ("budget", "max_depth", "branch")
# the engine's tree bounds and defaults (engine/tree_draft.py: MAX_TREE_BUDGET, MAX_BRANCH, DEFAULT_BRANCH,
# DEFAULT_TREE_BUDGET), kept here so that importing the app does not import the engine
MAX_TREE_BUDGET = 64
MAX_TREE_BRANCH = 16
DEFAULT_TREE_BRANCH = 4
DEFAULT_TREE_BUDGET = 8


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int

    @property
    def max_draft(self) -> int:
        return max(1, min(MAX_DRAFT_TOKENS, self.max_context - 1))

    @property
    def max_tokens(self) -> int:
        return max(1, self.max_context - self.max_draft)


def request_model(limits: Limits) -> type[BaseModel]:
    """The /draft body model for these limits. Ids are StrictInt (no floats, strings or booleans sneaking in as
    ids); the upper id bound is checked by io_utils.check_token_ids (one definition for every component) and
    published in the schema through `json_schema_extra`."""
    token_id = Annotated[StrictInt, Field(ge=0, json_schema_extra={"maximum": limits.vocab_size - 1})]
    tree = create_model(
        "TreeRequest",
        __config__=ConfigDict(extra="forbid"),
        budget=(StrictInt, Field(DEFAULT_TREE_BUDGET, ge=1, le=MAX_TREE_BUDGET,
                                  description="Most nodes the tree holds (default: the budget fastest end to end "
                                              "on a CPU target, docs/studies/trees.md).")),
        max_depth=(StrictInt | None, Field(None, ge=1, le=limits.max_draft,
                                           description="Most levels; absent or null: num_draft_tokens.")),
        branch=(StrictInt, Field(DEFAULT_TREE_BRANCH, ge=1, le=MAX_TREE_BRANCH,
                                 description="Candidates per expanded node, and nodes expanded per level.")),
    )
    return create_model(
        "DraftRequest",
        __config__=ConfigDict(extra="forbid"),
        tokens=(Annotated[list[token_id], Field(
            min_length=1, max_length=limits.max_tokens,
            description=f"Context token ids (prompt + accepted), each in [0, {limits.vocab_size}); at most "
                        f"{limits.max_tokens} = the model's context {limits.max_context} minus the longest draft.")],
                ...),
        num_draft_tokens=(StrictInt, Field(DEFAULT_DRAFT_TOKENS, ge=1, le=limits.max_draft,
                                           description="How many tokens to draft (at most, with min_confidence).")),
        # StrictFloat still takes JSON integers (0, 1) but not strings or booleans; allow_inf_nan=False so a
        # NaN literal cannot slip past the bounds
        min_confidence=(StrictFloat | None, Field(
            None, ge=0, le=1, allow_inf_nan=False,
            description="Stop the draft before the first model-drafted token whose probability under the drafter "
                        "is below this (tokens copied from the context are not subject to it); absent or null: the "
                        "server's default (off unless the operator set DEFAULT_MIN_CONFIDENCE, so exactly "
                        "num_draft_tokens tokens); 0: off.")),
        return_probs=(StrictBool, Field(False, description="Also return each draft token's probability under the "
                                                           "drafter (null for a token copied from the context).")),
        tree=(tree | None, Field(None, description="Draft a tree of candidates instead of a chain (absent or null: "
                                                   "the chain); the answer's `tree` holds it, `draft` its first chain "
                                                   "(the greedy draft as far as the tree goes). min_confidence does "
                                                   "not apply to a tree.")),
    )


class Timing(BaseModel):
    queue_ms: float
    compute_ms: float
    total_ms: float


class TreeAnswer(BaseModel):
    tokens: list[int] = Field(description="Node tokens, parents before children (breadth first).")
    parents: list[int] = Field(description="Each node's parent: an earlier node's index, or -1 for the context.")
    probs: list[float] = Field(description="Each node's path probability under the drafter (a copied token counts "
                                           "1).")


class DraftResponse(BaseModel):
    draft: list[int]
    num_draft_tokens: int
    context_len: int
    batch_size: int = Field(description="Requests that shared this forward pass.")
    cached_prefix_len: int | None = Field(None, description="Context tokens of this request served from the "
                                                            "prefix KV cache.")
    batch_cached_tokens: int | None = Field(None, description="The same, summed over the requests of the batch.")
    probs: list[float | None] | None = Field(None, description="Only with return_probs: each draft token's "
                                                               "probability under the drafter (null: copied).")
    tree: TreeAnswer | None = Field(None, description="Only for a tree request: the draft tree (`draft` is then its "
                                                      "first chain).")
    timing: Timing


class Health(BaseModel):
    status: str = Field(description='"ok", or "draining" (with 503) once shutdown has begun.')
    uptime_s: float


class ErrorResponse(BaseModel):
    error: str
    detail: list[dict[str, Any]] | None = None


def describe(err: dict, limits: Limits) -> str:
    """One pydantic error as `tokens[3]: Input should be a valid integer (got true)`."""
    loc = [p for p in err.get("loc", ()) if p != "body"]
    where = ""
    for p in loc:
        where += f"[{p}]" if isinstance(p, int) else (f".{p}" if where else str(p))
    kind = err.get("type")
    msg = err.get("msg", "invalid value")
    in_tree = loc[:1] == ["tree"]
    if kind in ("model_type", "model_attributes_type"):
        msg = ("expected a JSON object {\"budget\": int, ...} or null" if in_tree else
               "expected a JSON object {\"tokens\": [...], \"num_draft_tokens\": ...}")
    elif kind == "extra_forbidden":
        msg = f"unknown field (allowed: {', '.join(TREE_FIELDS if in_tree else REQUEST_FIELDS)})"
    elif kind == "missing":
        msg = "field required"
    elif kind == "too_long" and loc == ["tokens"]:
        msg = (f"context of {len(err.get('input') or ())} tokens exceeds the maximum context: at most "
               f"{limits.max_tokens} tokens (the model's maximum context of {limits.max_context} minus up to "
               f"{limits.max_draft} draft tokens)")
        return f"tokens: {msg}"
    got = ""
    if "input" in err and kind not in ("missing", "json_invalid", "model_type", "model_attributes_type"):
        got = f" (got {json.dumps(err['input'], default=str)[:60]})"
    return f"{where or 'body'}: {msg}{got}"


def to_openapi30(node: Any) -> Any:
    """pydantic's JSON Schema 2020-12 -> OpenAPI 3.0: `anyOf: [X, {type: null}]` -> X + `nullable: true`."""
    if isinstance(node, list):
        return [to_openapi30(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: to_openapi30(v) for k, v in node.items()}
    options = node.get("anyOf")
    if isinstance(options, list) and {"type": "null"} in options:
        rest = [o for o in options if o != {"type": "null"}]
        node.pop("anyOf")
        node.update(rest[0] if len(rest) == 1 else {"anyOf": rest})
        node["nullable"] = True
    return node


def inline_refs(schema: dict) -> dict:
    """A JSON Schema with its `$defs` (pydantic's nested models, e.g. `tree`) written in place of their `$ref`s: the
    /draft body sits inside the OpenAPI document, where `#/$defs/...` would not resolve."""
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return walk({**defs[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items() if k != "$ref"}})
        return {k: walk(v) for k, v in node.items()}

    return walk(schema)


def openapi_document(app, limits: Limits, request: type[BaseModel]) -> dict:
    """The app's OpenAPI document as 3.0.3, with the /draft request body of these limits."""
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    doc["openapi"] = "3.0.3"
    body = inline_refs(request.model_json_schema())
    body.pop("title", None)
    doc["paths"]["/draft"]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
        "schema": body}}}
    return to_openapi30(doc)


def error_responses(*codes: int) -> dict:
    """OpenAPI `responses` for error codes; 503 documents its Retry-After header."""
    out = {}
    for code in codes:
        out[code] = {"model": ErrorResponse}
        if code == 503:
            out[code]["headers"] = {"Retry-After": {"description": "Seconds after which a retry may succeed.",
                                                    "schema": {"type": "integer", "minimum": 1}}}
            out[code]["description"] = "Overloaded, timed out or shutting down; retry after Retry-After seconds."
    return out
