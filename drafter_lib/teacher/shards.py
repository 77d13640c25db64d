"""Row ids and shards: a prompt record's id, and the stable shard of an id, so that every machine of a sharded
teacher run agrees on which rows are its own."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["record_id", "shard_of", "select_shard"]


def record_id(record: dict) -> str:
    rid = record.get("id", record.get("question_id"))
    if rid is None:
        raise ValueError(f"prompt record without 'id': {str(record)[:200]}")
    return str(rid)


def shard_of(prompt_id: str, num_shards: int) -> int:
    """Stable shard of an id (sha256, not Python's salted hash), so every machine agrees."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    h = hashlib.sha256(str(prompt_id).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") % num_shards


def select_shard(records: Sequence[dict], shard_index: int, num_shards: int) -> list[dict]:
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
    return [r for r in records if shard_of(record_id(r), num_shards) == shard_index]
