"""Tokenizers: a byte-level one (no dependencies, the default) and a SentencePiece wrapper.

Both map text to a 1-D `int64` tensor and back, and expose `vocab_size`, `pad_id`,
`bos_id`, `eos_id`. `decode` drops the special ids, so `decode(encode(s)) == s` for any
string (the SentencePiece model uses byte fallback and identity normalization to keep
that true for code: indentation, tabs and newlines survive).
"""
from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from ._cache import atomic_write, cache_dir


class ByteTokenizer:
    """UTF-8 bytes `0..255`, then `pad = 256`, `bos = 257`, `eos = 258` (vocabulary 259)."""

    vocab_size = 259
    pad_id, bos_id, eos_id = 256, 257, 258

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> Tensor:
        """`text` -> `[N]` int64 ids (a `bytes` argument is taken as already encoded)."""
        data = text if isinstance(text, (bytes, bytearray)) else text.encode("utf-8")
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.zeros(0, dtype=torch.long)
        return _add_specials(ids, self.bos_id if bos else None, self.eos_id if eos else None)

    def decode(self, ids: Tensor | Iterable[int]) -> str:
        """Ids -> text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        ids = torch.as_tensor(ids if isinstance(ids, Tensor) else list(ids), dtype=torch.long).flatten()
        ids = ids[(ids >= 0) & (ids < 256)]
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def _add_specials(ids: Tensor, bos: int | None, eos: int | None) -> Tensor:
    parts = ([torch.tensor([bos])] if bos is not None else []) + [ids] + ([torch.tensor([eos])] if eos is not None else [])
    return torch.cat(parts) if len(parts) > 1 else ids


def _require_sentencepiece():
    try:
        import sentencepiece
    except ImportError:
        raise ImportError("the SentencePiece tokenizer needs the sentencepiece package: pip install sentencepiece "
                          "(or use the byte tokenizer, which needs nothing)") from None
    return sentencepiece


class SentencePieceTokenizer:
    """A trained SentencePiece model (Kudo & Richardson, *SentencePiece*, 2018).

    Ids: `pad = 0`, `unk = 1`, `bos = 2`, `eos = 3`, then the pieces; `"\\n"` is a piece of
    its own and unknown characters fall back to their UTF-8 bytes, so decoding inverts
    encoding exactly. Build one with `SentencePieceTokenizer.train(...)` (cached on disk by
    a hash of the text and the settings) or load a `.model` file with `from_file`.
    """

    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    def __init__(self, model_proto: bytes):
        spm = _require_sentencepiece()
        self.model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = int(self._sp.get_piece_size())

    @classmethod
    def from_file(cls, path: str | Path) -> SentencePieceTokenizer:
        return cls(Path(path).read_bytes())

    @classmethod
    def train(cls, text: str | bytes, vocab_size: int = 4096, *, model_type: str = "bpe",
              max_lines: int = 2_000_000, cache: bool = True) -> SentencePieceTokenizer:
        """Train on `text` (one sentence per line). With `cache`, the model is stored under
        `cache_dir()/spm-<hash>.model` and later calls with the same text and settings load it.

        `vocab_size` must exceed the 259 ids the specials, `"\\n"` and the 256 byte-fallback
        pieces take; a text too small for the requested size raises SentencePiece's error.
        """
        spm = _require_sentencepiece()
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        key = hashlib.sha256(f"v1|{vocab_size}|{model_type}|{max_lines}|".encode() + text.encode("utf-8")).hexdigest()[:20]
        path = cache_dir() / f"spm-{key}.model"
        if cache and path.exists():
            return cls.from_file(path)
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(text.split("\n")[:max_lines]), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, pad_id=cls.pad_id, unk_id=cls.unk_id, bos_id=cls.bos_id, eos_id=cls.eos_id,
            # identity normalization, no dummy prefix, kept whitespace: decode(encode(s)) == s for code
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, byte_fallback=True, character_coverage=1.0, user_defined_symbols=["\n"],
            split_digits=True, max_sentence_length=1 << 16, num_threads=2, minloglevel=2)
        if cache:
            atomic_write(path, model.getvalue())
        return cls(model.getvalue())

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> Tensor:
        """`text` -> `[N]` int64 ids."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        ids = torch.tensor(self._sp.encode(text), dtype=torch.long)
        return _add_specials(ids, self.bos_id if bos else None, self.eos_id if eos else None)

    def decode(self, ids: Tensor | Iterable[int]) -> str:
        """Ids -> text; pad/bos/eos are dropped."""
        ids = ids.flatten().tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
        return self._sp.decode([i for i in ids if i not in (self.pad_id, self.bos_id, self.eos_id)])


def get_tokenizer(name: str = "byte", **kw):
    """`"byte"` -> `ByteTokenizer()`; `"sentencepiece"` -> `SentencePieceTokenizer.train(**kw)`
    (needs `text=`; `pip install sentencepiece`)."""
    if name == "byte":
        return ByteTokenizer()
    if name in ("sentencepiece", "spm"):
        return SentencePieceTokenizer.train(**kw)
    raise ValueError(f"tokenizer: unknown {name!r}; known: byte, sentencepiece")
