"""Embedded data: corpora present offline, generated tasks. Nothing is downloaded."""
from .text import Corpus, ByteTokenizer, eval_windows, load_corpus, CORPORA  # noqa: F401
