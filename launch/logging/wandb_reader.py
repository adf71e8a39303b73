"""Read an offline W&B run (``run-<id>.wandb``) without the network.

wandb 0.31 has no Python reader for offline runs: the file is a LevelDB-style log
(7-byte header ``":W&B" magic version``, then 32 KiB blocks of records, each with a
CRC32, a length and a type FULL/FIRST/MIDDLE/LAST) whose payloads are
``wandb.proto.wandb_internal_pb2.Record`` protobufs. This reader is what the tests use
to check what the launcher logged; ``wandb sync <run dir>`` uploads the same file.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

__all__ = ["read_records", "read_history", "read_config"]

_HEADER = struct.Struct("<4sHB")
_RECORD = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    ident, magic, version = _HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"not a W&B run file (header {ident!r}, magic {magic:#x})")
    out: list[bytes] = []
    pos = _HEADER.size
    partial = b""
    while pos + _RECORD.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD.size:  # block trailer padding
            pos += left_in_block
            continue
        crc, length, rtype = _RECORD.unpack_from(data, pos)
        if rtype == 0 and length == 0:  # zero padding / preallocated tail
            pos += left_in_block
            continue
        start = pos + _RECORD.size
        chunk = data[start : start + length]
        if len(chunk) < length:
            break  # truncated tail of a run still being written
        # LevelDB CRC covers the type byte and the payload.
        if zlib.crc32(bytes([rtype]) + chunk) & 0xFFFFFFFF != crc:
            raise ValueError(f"W&B run file: bad checksum at byte {pos}")
        pos = start + length
        if rtype == _FULL:
            out.append(chunk)
        elif rtype == _FIRST:
            partial = chunk
        elif rtype == _MIDDLE:
            partial += chunk
        elif rtype == _LAST:
            out.append(partial + chunk)
            partial = b""
        else:
            raise ValueError(f"W&B run file: unknown record type {rtype} at byte {pos}")
    return out


def read_records(path: str) -> list[Any]:
    """Every ``wandb_internal_pb2.Record`` of the run file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    records = []
    for payload in _payloads(data):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        records.append(rec)
    return records


def _key(item: Any) -> str:
    return item.key if item.key else "/".join(item.nested_key)


def read_history(path: str) -> list[dict[str, Any]]:
    """The logged rows (``run.log`` calls), values decoded from JSON."""
    rows = []
    for rec in read_records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({_key(item): json.loads(item.value_json) for item in rec.history.item})
    return rows


def read_config(path: str) -> dict[str, Any]:
    """The run config (merged over all config records)."""
    config: dict[str, Any] = {}
    for rec in read_records(path):
        kind = rec.WhichOneof("record_type")
        # The initial config travels in the run record; later updates in config records.
        updates = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else ()
        for item in updates:
            config[_key(item)] = json.loads(item.value_json)
    config.pop("_wandb", None)
    return config
