"""Where data-parallel trainer ranks on several nodes meet: a TCPStore the controller hosts.

Ranks on one node meet in a file inside the run directory (`workers.distributed`). Ranks on
several nodes need a store all of them reach; the controller hosts it (`RankRendezvous`) on the
cluster address, for the run's lifetime, and the ranks connect as clients under a prefix of
their group's generation (a restarted group never reads a dead group's keys).

torch.distributed's store speaks plain, unauthenticated TCP: anyone who reaches the port can
read and write the keys the ranks meet by (and so join or disturb the group), and the
collectives' links that follow are unauthenticated and unencrypted too. It is therefore an
opt-in for trusted fabrics (``ClusterConfig.trainer_rendezvous = "cluster"``), never a default.
The listening socket is bound on the cluster address only (not every interface, as TCPStore
binds by itself), and closed with `close` (the store's server thread ends with it).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

__all__ = ["RankRendezvous"]


class RankRendezvous:
    """A TCPStore server on ``host`` (a free port), for the ranks of one run."""

    def __init__(self, host: str, *, timeout_s: float = 600.0) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self._store: Any = None
        self.port = 0

    @property
    def address(self) -> str:
        """``host:port`` (``[v6]:port``), as `workers.distributed.DataParallel.store` reads it."""
        if not self.port:
            raise RuntimeError("the rendezvous store is not started")
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> str:
        """Bind and serve; returns `address`."""
        import torch.distributed as dist  # torch loads only for runs that need the store

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.listen(128)
            port = int(sock.getsockname()[1])
            # The store owns the socket from here (it closes it when it goes). (TCPStore is
            # public, though missing from torch.distributed's explicit exports.)
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                self.host, port, is_master=True, wait_for_workers=False,
                master_listen_fd=sock.detach(),
                timeout=datetime.timedelta(seconds=self.timeout_s))
        finally:
            sock.close()  # a no-op once detached
        self.port = port
        return self.address

    def close(self) -> None:
        """Stop serving (the server thread and its sockets go with the last reference)."""
        self._store = None
        self.port = 0
