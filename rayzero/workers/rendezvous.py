"""Where a new process group meets: a free port on the rank-0 host, below the ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def rendezvous_port(ip: str, rng: random.Random | None = None) -> int:
    """A port free on `ip` now, below the ephemeral range where the system allows it. The
    kernel hands ephemeral ports to every outgoing connection and to gloo's own listeners, so
    a port taken from that range (bind to 0) can be in use again by the time the process
    group's store listens on it (EADDRINUSE, seen with several groups on one machine)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = rng or random.Random()
    for _ in range(200 if low > 2048 else 0):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no range known: any free port
        s.bind((ip, 0))
        return s.getsockname()[1]
