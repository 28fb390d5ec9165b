"""Free loopback ports for tests that start servers on fixed ports (tests/integration's clusters,
tests/actors/bad_input_test.py's `troupe run`)."""
import os
import random
import socket
import time
from pathlib import Path


def free_port_block(n):
    """A base port with n free ports after it on 127.0.0.1 (random, so tests
    running at once rarely meet; checked by binding). Below the kernel's
    ephemeral range, so no client socket or UCX lane (their ports are
    ephemeral: the clusters set UCX_TCP_PORT_RANGE=0) takes one between the
    check and the bind of the process that listens there."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    top = max(12000, ephemeral_low) - n
    r = random.Random(os.getpid() ^ int(time.time() * 1e6))
    for _ in range(200):
        base = r.randrange(10000, top)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")
