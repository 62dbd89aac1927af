"""Give back the resident pages of a file this process maps: the IR's weights, once compiled.

`Core.read_model` maps openvino_model.bin, and the compiled model keeps its constants (and so the
mapping) alive, while the CPU plugin computes from copies of its own, packed for its kernels on
the first inference. The mapped pages it read to make them then stay resident: the weights
counted twice in the process's memory (1.5B Q4_0 at `auto`: 746 MiB of file pages beside the
packed copy). They are clean pages of a read-only mapping, so dropping them loses nothing: should
the plugin read a constant again, the kernel reads it back from the file.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

_MADV_DONTNEED = 4


def drop_mapped_pages(*paths: Path) -> int:
    """madvise(MADV_DONTNEED) on every read-only mapping of `paths`; returns the bytes advised.
    Linux only (elsewhere 0)."""
    if not sys.platform.startswith("linux"):
        return 0
    targets = tuple(str(path.resolve()) for path in paths)
    try:
        with open("/proc/self/maps") as f:
            spans = [line.split()[0] for line in f
                     if line.rstrip().endswith(targets) and line.split()[1].startswith("r-")]
    except OSError:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    dropped = 0
    for span in spans:
        start, end = (int(x, 16) for x in span.split("-"))
        if libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
            dropped += end - start
    return dropped
