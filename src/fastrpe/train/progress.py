"""A progress bar (tqdm when installed and wanted, a plain iterator otherwise)."""
from __future__ import annotations

import sys


def progress(iterable, desc: str = "", disable: bool = False, **kw):
    if disable:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True, **kw)
