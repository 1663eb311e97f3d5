"""CPU training keeps large freed blocks in glibc's heap instead of unmapping them (tuneforge.host_memory)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
from tuneforge.host_memory import freed_host_memory_kept

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def new_mappings():
    before = libc.mallinfo2().hblks
    block = libc.malloc(64 << 20)  # larger than glibc's largest mmap threshold
    mapped = libc.mallinfo2().hblks - before
    libc.free(block)
    return mapped

with freed_host_memory_kept(sys.argv[1] == "tune") as kept:
    inside = new_mappings()
print(kept, inside, new_mappings())  # the defaults are back after the block
"""


def probe(mode: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=environment, check=True
    )
    return done.stdout.strip()


LIBC, VERSION = platform.libc_ver()
GLIBC = LIBC == "glibc" and tuple(int(part) for part in VERSION.split(".")[:2]) >= (2, 33)


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc 2.33+ (mallinfo2)")
def test_large_blocks_come_from_the_heap_once_tuned():
    assert probe("plain") == "False 1 1"  # glibc's default: a fresh mapping for a 64 MiB block
    assert probe("tune") == "True 0 1"


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc 2.33+ (mallinfo2)")
def test_a_user_tuned_allocator_is_left_alone():
    assert probe("tune", MALLOC_ARENA_MAX="2") == "False 1 1"
    assert probe("tune", GLIBC_TUNABLES="glibc.malloc.hugetlb=1") == "False 1 1"
