"""Embedded text data: byte tokenizer, the stdlib corpus split by file, evaluation windows."""
from __future__ import annotations

import torch

from fastrpe.data.text import ByteTokenizer, _is_validation, eval_windows, load_corpus, stdlib_files


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    s = "def f(x):\n    return 'π' * x\n"
    assert tok.decode(tok.encode(s)) == s
    assert int(tok.encode(s).max()) < 256 and tok.vocab_size == 259


def test_stdlib_split_by_file_is_stable_and_disjoint():
    files = [rel for rel, _ in stdlib_files()]
    assert len(files) > 100 and files == sorted(files)
    val = {f for f in files if _is_validation(f, 0.05)}
    assert 0 < len(val) < len(files) // 5
    assert val == {f for f in files if _is_validation(f, 0.05)}  # deterministic


def test_corpus_cached_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTRPE_CACHE", str(tmp_path))
    a = load_corpus(max_bytes=100_000)
    b = load_corpus(max_bytes=100_000)  # from the cache
    assert torch.equal(a.train, b.train) and torch.equal(a.validation, b.validation)
    assert a.train.numel() > 10_000 and a.validation.numel() > 0
    assert any(tmp_path.iterdir())


def test_eval_windows_are_non_overlapping_and_cover_the_stream():
    s = torch.arange(1001)
    w = eval_windows(s, 100)
    assert w.shape == (10, 101)
    assert torch.equal(w[:, 1:].flatten(), s[1:])  # every token predicted exactly once
    assert torch.equal(w[1:, 0], w[:-1, -1])
    assert eval_windows(s, 100, max_tokens=250).shape == (2, 101)
