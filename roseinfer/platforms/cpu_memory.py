"""CPU memory hygiene after loading: hand the heap that loading freed back to the OS, and the pages of
embedding tables read through the checkpoint's memory map (models/weights.py)."""
from __future__ import annotations

import ctypes
import functools
import mmap
from pathlib import Path
from typing import Iterator

from torch import nn


def return_freed_memory() -> None:
    """Loading frees the checkpoint's tensors and, with prepacking, the dense weights; glibc keeps
    much of that in its heap (~70 MiB of the default model's, docs/profiling.md)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # not glibc: nothing to trim this way
        libc.malloc_trim(0)


def _mapped_params(model: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters that are the checkpoint's memory map (models/weights.py)."""
    return (param for param in model.parameters() if getattr(param, "checkpoint_mapped", False))


def drop_mapped_pages(model: nn.Module) -> None:
    """A mapped table that is still the embedding's after loading (e.g. a tied one whose packed
    layout the CPU backend's embedding could not read) was read whole to pack the head, and its
    pages would stay in this process's resident set. Dropping them is safe because the mapping is
    read-only in use and backed by the file: a later lookup pages its rows back in."""
    libc = _libc()
    if libc is None:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for param in _mapped_params(model):
        address, size = param.data_ptr(), param.numel() * param.element_size()
        start, end = -(-address // page) * page, (address + size) // page * page
        # MADV_DONTNEED on anonymous memory would zero it: only ever on a range the file maps
        if end <= start or not _file_backed(start, end):
            continue
        libc.madvise(start, end - start, mmap.MADV_DONTNEED)
        # lookups read scattered rows: without this, each one faults in the kernel's read-around too
        libc.madvise(start, end - start, mmap.MADV_RANDOM)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not a glibc system
        return None


def _file_backed(start: int, end: int) -> bool:
    """[start, end) lies in one private mapping of a regular file (from /proc/self/maps)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= start and end <= high:
            return len(fields) >= 6 and fields[1].endswith("p") and int(fields[4]) != 0 and fields[5].startswith("/")
    return False
