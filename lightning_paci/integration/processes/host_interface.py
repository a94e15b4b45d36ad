"""Which network interface the host group's gloo connects over, across nodes.

[Note: the host group's interface]
Every run has a gloo group of every rank (under NCCL the host group: message headers, object gathers, the end of
``fit``; on the CPU the whole pipeline). Gloo picks its interface from ``GLOO_SOCKET_IFNAME``, else from the
address the host name resolves to; where that is a loopback address (``/etc/hosts`` mapping the host name to
127.0.1.1, common on cloud images) the ranks of other nodes cannot reach it, and the group's creation waits up
to the process-group timeout. torchrun users usually set ``NCCL_SOCKET_IFNAME`` only, so where that alone is set
the same interface is given to gloo (said once): NCCL's syntax is a list of name prefixes (``eth``), exact names
(``=eth0``) or exclusions (``^docker,lo``); gloo takes exact names, so a prefix is resolved to the first interface
of this host that has it, and an exclusion list is left to the user (said, with the fix). A failure while the
groups connect names the interface gloo used and how to choose another.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping, Sequence

__all__ = ["gloo_interface", "host_interface", "named_interface"]


def _interfaces() -> list[str]:
    """This host's network interfaces, in the system's order."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - no interface list on this platform
        return []


def gloo_interface(environ: MutableMapping[str, str] | None = None,
                   interfaces: Sequence[str] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` from ``NCCL_SOCKET_IFNAME`` where only the latter is set ([Note: the host
    group's interface]); return the line that says what was done (None where nothing was)."""
    environ = os.environ if environ is None else environ
    nccl = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if not nccl or environ.get("GLOO_SOCKET_IFNAME"):
        return None
    if nccl.startswith("^"):
        return (f"lightning_paci: NCCL_SOCKET_IFNAME={nccl!r} excludes interfaces, which gloo cannot: the host "
                f"group (gloo) connects over the address the host name resolves to. Set GLOO_SOCKET_IFNAME to the "
                f"interface the nodes reach each other on.")
    available = list(_interfaces() if interfaces is None else interfaces)
    exact = nccl.startswith("=")
    wanted = [part.strip() for part in nccl.lstrip("=").split(",") if part.strip()]
    chosen = next((name for want in wanted for name in available
                   if (name == want if exact else name.startswith(want))), None)
    if chosen is None:
        return (f"lightning_paci: NCCL_SOCKET_IFNAME={nccl!r} matches none of this host's interfaces "
                f"({', '.join(available) or 'none listed'}): GLOO_SOCKET_IFNAME is not set from it.")
    environ["GLOO_SOCKET_IFNAME"] = chosen
    return (f"lightning_paci: GLOO_SOCKET_IFNAME={chosen} (from NCCL_SOCKET_IFNAME={nccl!r}) for the host group "
            f"(gloo); set GLOO_SOCKET_IFNAME to choose another interface.")


def host_interface(environ: MutableMapping[str, str] | None = None) -> str:
    """In words, the interface the host group's gloo connects over, and how to choose it."""
    environ = os.environ if environ is None else environ
    if name := environ.get("GLOO_SOCKET_IFNAME"):
        return f"the host group (gloo) connects over GLOO_SOCKET_IFNAME={name}"
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "nothing"
    loopback = address.startswith("127.") or address == "::1"
    return (f"the host group (gloo) connects over the address the host name resolves to ({host} -> {address}"
            + (", a loopback address, which other nodes cannot reach" if loopback else "")
            + "); set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on (as NCCL_SOCKET_IFNAME "
              "for NCCL)")


def named_interface(error: RuntimeError, environ: MutableMapping[str, str] | None = None) -> RuntimeError:
    """``error``, raised while the process groups connect, with the host group's interface named."""
    return RuntimeError(f"lightning_paci: connecting the process groups failed: {error}. Across nodes, "
                        f"{host_interface(environ)} ([Note: the host group's interface]).")
