"""A GGUF file read once per conversion (the ``gguf`` package's names, as transformers' GGUF loading imports them).

Loading a GGUF model and its tokenizer, transformers calls ``load_gguf_checkpoint`` four times (config, weights,
tokenizer config, tokenizer), and each builds a ``gguf.GGUFReader`` over the same file, which parses every metadata
field (SmolLM2's 49,152-token vocabulary and its merges: about 4.4 s a time on a 2-core CPU); mapping the weights'
names builds ``gguf.get_tensor_name_map(arch, layers)`` once per module (397 times for SmolLM2, 11 ms each).
Inside ``read_once()``, each is built once per argument and handed out again: transformers imports both names from
``gguf`` when it calls them, so they are swapped on that module for the conversion's duration and put back after.
The reader is only read (fields, tensors), and the name map only looked up, so the converted folder is the same
byte for byte: SmolLM2 converted each way gave the same sha256 for all six files, in 13.9 s instead of 31.4 s
(2 cores, 2026-12-02; tests/tasks/speedups/test_gguf_reading.py checks the mechanism on a small file).

Must not import (at module import): gguf, transformers.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Within this block, ``gguf.GGUFReader(path)`` returns one reader per file and ``gguf.get_tensor_name_map``
    one map per (architecture, layers); outside it, the package's own. Without ``gguf`` (or with a release that
    lacks either name) it does nothing.

    >>> with read_once():
    ...     pass
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    reader_class, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if reader_class is None or name_map is None:
        yield
        return
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
        readers.clear()
