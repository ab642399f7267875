"""Breaking out of a process group that lost a member, at once, without ending the process.

On gloo, a rank whose peer died mid-collective does not always hear of it: in a ring, only the
dead rank's neighbours read from it; the others wait on live peers that have already given up
on the collective (or gone on to the next one, whose slot never matches), until the
collective timeout (`cluster.pg_timeout_s`, minutes). Neither `ProcessGroup.abort()` nor
`destroy_process_group()` helps: on gloo both wait for the operation in flight. What does is
closing the connections the group runs on: `shutdown()` on each of its connected sockets makes
every read and write on them fail, here and at the peer's end, so each collective in flight on
any rank of the group raises within milliseconds, and the group can then be destroyed. The
sockets are the ones the process opened while it joined the group (`opened_while`); listening
sockets are left alone (gloo's listener thread aborts the process on an error). NCCL has its
own abort, which this uses instead.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager

import torch.distributed as dist


def socket_fds() -> set[int]:
    """This process's open socket file descriptors (Linux; empty elsewhere)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    out = set()
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.add(int(name))
        except OSError:
            pass
    return out


@contextmanager
def opened_while(into: set[int]):
    """Adds to `into` the sockets opened in this block (a process group's, when the block joins one)."""
    before = socket_fds()
    try:
        yield into
    finally:
        into.update(socket_fds() - before)


def cut(fds: set[int]) -> int:
    """`shutdown()` every connected socket of `fds` (not closing them: their owner does);
    returns how many were cut."""
    n = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue  # closed since, or not a socket any more
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            s.getpeername()  # raises on a socket that is not connected
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.detach()
    return n


def break_group(fds: set[int]) -> int:
    """Make every collective in flight on this process's groups fail now (see the module's
    docstring); returns the connections cut (gloo) or -1 (NCCL's abort)."""
    if not dist.is_initialized():
        return 0
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
        return -1
    return cut(fds)
