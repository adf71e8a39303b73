"""``prepare_data``'s token stream: paragraphs tokenized as the launcher tokenizes ``data=text``,
appended to the partial output's token file with progress recorded as it goes.

The stream is the documents joined by a blank line and split at blank lines; a paragraph
over :data:`MAX_PARAGRAPH_BYTES` is tokenized in pieces cut where they do not depend on how
the input was read, so an interrupted and resumed run writes the same bytes. The tokens
are on disk (fsync) before the state that counts them.
"""

from __future__ import annotations

import array
import contextlib
import os
import sys
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

# The module too: CHUNK_BYTES is read from it where it is used (tests set smaller reads).
from tp_fuse.launch import prepare_inputs
from tp_fuse.launch.prepare_inputs import SEP, documents, text_chunks
from tp_fuse.launch.prepare_output import PartialOutput, writing
from tp_fuse.launch.tokenizer import ByteTokenizer, Tok

__all__ = ["MAX_PARAGRAPH_BYTES", "Encoder", "tokenize"]

#: A text paragraph (no blank line) longer than this is tokenized in pieces of this size,
#: cut at a line break where there is one (byte tokenizer: exactly the same tokens anyway).
MAX_PARAGRAPH_BYTES = 8 << 20


class Encoder:
    """Token ids of paragraphs (bytes split at blank lines) as the launcher's tokenizers make them."""

    def __init__(self, tok: Tok, dtype: str) -> None:
        self.tok = tok
        # array typecodes of the token width ("I" is a C unsigned int: 4 bytes on every platform torch runs on)
        self.code = "H" if dtype == "uint16" else "I"
        assert array.array(self.code).itemsize == (2 if dtype == "uint16" else 4)
        self.sep = self._ids(SEP)

    def _ids(self, data: bytes) -> array.array:
        if isinstance(self.tok, ByteTokenizer):
            return array.array(self.code, iter(data))  # the byte tokenizer's ids are the bytes (iter: not raw memory)
        # FileTokenizer.encode splits at "\n\n" and joins with the separator's ids: the same
        # tokens as the launcher's encode of the whole corpus (a blank line is ASCII, so
        # decoding piece by piece replaces the same invalid bytes).
        ids = self.tok.encode(data.decode("utf-8", errors="replace"))
        return array.array(self.code, ids.tolist())

    def encode(self, paragraphs: list[bytes]) -> array.array:
        return self._ids(SEP.join(paragraphs))


def _progress_bar(total: int, enabled: bool):
    """A rich progress bar over input bytes on stderr (a no-op object when disabled)."""
    if not enabled:
        return contextlib.nullcontext(None)
    return Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def _cut(buf: bytes, byte_level: bool) -> int:
    """Where to cut a paragraph longer than :data:`MAX_PARAGRAPH_BYTES`: the cut depends only on
    its first ``MAX_PARAGRAPH_BYTES`` bytes (so not on how the input was read): at its last
    line break in their second half, else before a UTF-8 continuation byte."""
    end = MAX_PARAGRAPH_BYTES
    if byte_level:
        return end  # the byte tokenizer's pieces concatenate to the same tokens anyway
    nl = buf.rfind(b"\n", end // 2, end)
    if nl >= 0:
        return nl + 1
    while end > 1 and (buf[end] & 0xC0) == 0x80:
        end -= 1
    return end


class _Writer:
    """Appends tokens of paragraphs to the token file and records progress in the state."""

    def __init__(self, inputs: list[dict[str, Any]], enc: Encoder, state: dict[str, Any], tokens_file, output: PartialOutput,
                 bar: Any, task: Any) -> None:
        self.inputs, self.enc, self.state = inputs, enc, state
        self.tokens_file, self.output, self.bar, self.task = tokens_file, output, bar, task
        self.byte_level = isinstance(enc.tok, ByteTokenizer)
        # The last paragraph of the document read last: how it splits depends on whether
        # another document follows (next_document / end). Progress is only recorded while
        # there is none, so a resumed run never needs it.
        self.pending: Optional[bytes] = None

    def _emit(self, groups: list[tuple[bool, list[bytes]]]) -> None:
        for sep, parts in groups:
            ids = self.enc.encode(parts)
            if sep:
                ids = self.enc.sep + ids
            if sys.byteorder == "big":  # the format is little-endian (nanoGPT's files)
                ids.byteswap()
            with writing(self.output.tokens_path):
                self.tokens_file.write(ids.tobytes())
            self.state["tokens"] += len(ids)

    def paragraphs(self, parts: list[bytes]) -> None:
        """Complete paragraphs of the stream (a separator before each but the stream's first).

        A paragraph over :data:`MAX_PARAGRAPH_BYTES` is tokenized in pieces (no separator
        between them); consecutive whole paragraphs are tokenized in one call (encode() joins
        them with the separator and the tokenizer splits there again).
        """
        groups: list[tuple[bool, list[bytes]]] = []
        for part in parts:
            sep = self.state["sep_due"]
            while len(part) > MAX_PARAGRAPH_BYTES:
                cut = _cut(part, self.byte_level)
                groups.append((sep, [part[:cut]]))
                part, sep = part[cut:], False
            if sep and groups:
                groups[-1][1].append(part)
            else:
                groups.append((sep, [part]))
            self.state["sep_due"] = True
        self._emit(groups)

    def next_document(self) -> None:
        """Another document follows: settle the previous one's last paragraph (``pending``).

        The stream is the documents joined by a blank line, split at blank lines. A last
        paragraph ``X + "\n"`` followed by ``"\n\n" + D`` splits as ``X`` and ``"\n" + D``:
        its newline moves to the next document (``state["prefix"]``), as in the launcher's
        split of files joined by ``"\n\n"``.
        """
        if self.pending is None:
            return
        last, self.pending = self.pending, None
        if last.endswith(b"\n"):
            self.paragraphs([last[:-1]])
            self.state["prefix"] = True
        else:
            self.paragraphs([last])
            self.state["prefix"] = False

    def end(self) -> None:
        """The stream ends: its last paragraph as it is."""
        if self.pending is not None:
            self.paragraphs([self.pending])
            self.pending = None

    def unfinished(self, carry: bytes) -> bytes:
        """Tokenize the start of a paragraph that is longer than :data:`MAX_PARAGRAPH_BYTES`
        whatever follows (the carry has no separator and more than MAX + 1 bytes: its last byte
        may start one); returns the rest."""
        while len(carry) > MAX_PARAGRAPH_BYTES + 1:
            cut = _cut(carry, self.byte_level)
            self._emit([(self.state["sep_due"], [carry[:cut]])])
            self.state["sep_due"] = False  # the paragraph goes on: no separator before its next piece
            carry = carry[cut:]
        return carry

    def checkpoint(self, input_index: int, pos: tuple[int, int]) -> None:
        """Record that the tokens so far cover the inputs before ``(input_index, pos)``."""
        assert self.pending is None
        with writing(self.output.tokens_path):
            self.tokens_file.flush()
            os.fsync(self.tokens_file.fileno())  # the tokens are on disk before the state that counts them
        self.state.update(input=input_index, pos=list(pos))
        self.output.write_state(self.state)
        if self.task is not None:
            inputs = self.inputs
            at = pos[0] if input_index < len(inputs) and inputs[input_index]["format"] != "parquet" else 0
            self.bar.update(self.task, completed=sum(i["size"] for i in inputs[:input_index]) + at)


def tokenize(inputs: list[dict[str, Any]], field: str, enc: Encoder, state: dict[str, Any], tokens_file,
             output: PartialOutput, progress: bool) -> None:
    """Append the tokens of every input from ``state``'s position, recording progress as it goes."""
    total = sum(i["size"] for i in inputs)
    with _progress_bar(total, progress and sys.stderr.isatty()) as bar:
        task = None
        if bar is not None:
            task = bar.add_task("tokenizing", total=total,
                                completed=sum(i["size"] for i in inputs[: state["input"]]) + state["pos"][0])
        writer = _Writer(inputs, enc, state, tokens_file, output, bar, task)
        while state["input"] < len(inputs):
            index = state["input"]
            spec = inputs[index]
            pos = (state["pos"][0], state["pos"][1])
            if spec["format"] == "text":
                _tokenize_text(spec["path"], pos[0], writer, index)
            else:
                read = 0
                for doc, after in documents(spec, field, pos):
                    writer.next_document()
                    if read >= prepare_inputs.CHUNK_BYTES:  # the tokens cover everything before this document
                        writer.checkpoint(index, pos)
                        read = 0
                    parts = ((b"\n" if state["prefix"] else b"") + doc).split(SEP)
                    state["prefix"] = False
                    writer.pending = parts.pop()
                    writer.paragraphs(parts)
                    read += len(doc) + 1
                    pos = after
            state.update(input=index + 1, pos=[0, 0])
        writer.end()
        writer.checkpoint(len(inputs), (0, 0))


def _tokenize_text(path: str, offset: int, writer: _Writer, index: int) -> None:
    """A text file as one document: complete paragraphs are tokenized as the input streams in.

    The recorded position is where the unfinished paragraph (the carry) starts: a resumed
    run reads it again from there (with the newline moved in from the previous document,
    ``state["prefix"]``, while the carry still starts with it).
    """
    writer.next_document()
    state = writer.state
    prefix = b"\n" if state["prefix"] else b""
    if offset == 0:
        writer.checkpoint(index, (0, 0))
    carry = prefix if offset == 0 else b""
    for chunk, after in text_chunks(path, offset):
        # split() finds separators left to right and the carry starts right after one (or
        # after a cut), so splitting carry + chunk finds the ones a split of the whole
        # stream finds, however the file was read.
        parts = (carry + chunk).split(SEP)
        carry = parts.pop()
        if parts:
            writer.paragraphs(parts)
        carry = writer.unfinished(carry)
        start = after - len(carry)  # file offset of the carry; -1: it starts with the moved newline
        state["prefix"] = start < 0
        writer.checkpoint(index, (max(start, 0), 0))
    writer.pending = carry
    state["prefix"] = False
