"""The host group's interface across nodes ([Note: the host group's interface]): GLOO_SOCKET_IFNAME from
NCCL_SOCKET_IFNAME, and a connection failure that names it."""

from __future__ import annotations

import socket

import pytest

from lightning_paci.integration.processes.host_interface import gloo_interface, host_interface, named_interface

HOST = ["lo", "docker0", "eth0", "eth1", "ib0"]


@pytest.mark.parametrize(("nccl", "chosen"), [("eth", "eth0"), ("=eth1", "eth1"), ("ib,eth", "ib0"),
                                              ("eth1,eth0", "eth1")])
def test_gloo_takes_the_interface_nccl_was_given_and_says_so(nccl, chosen):
    environ = {"NCCL_SOCKET_IFNAME": nccl}
    said = gloo_interface(environ, HOST)
    assert environ["GLOO_SOCKET_IFNAME"] == chosen
    assert said is not None and f"GLOO_SOCKET_IFNAME={chosen}" in said and repr(nccl) in said


def test_a_gloo_interface_the_user_set_is_kept_and_nothing_is_said():
    environ = {"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "ib0"}
    assert gloo_interface(environ, HOST) is None and environ["GLOO_SOCKET_IFNAME"] == "ib0"
    assert gloo_interface({}, HOST) is None


@pytest.mark.parametrize(("nccl", "said"), [("^docker,lo", "excludes interfaces"), ("=eth", "matches none"),
                                            ("wlan", "matches none")])
def test_what_gloo_cannot_take_is_said_with_the_fix_and_nothing_is_set(nccl, said):
    environ = {"NCCL_SOCKET_IFNAME": nccl}
    line = gloo_interface(environ, HOST)
    assert "GLOO_SOCKET_IFNAME" not in environ
    assert line is not None and said in line


def test_the_real_interfaces_of_this_host_resolve_an_exact_name():
    name = socket.if_nameindex()[0][1]
    environ = {"NCCL_SOCKET_IFNAME": f"={name}"}
    gloo_interface(environ)
    assert environ["GLOO_SOCKET_IFNAME"] == name


def test_a_connection_failure_names_the_host_groups_interface():
    error = named_interface(RuntimeError("Connect timeout"), {"GLOO_SOCKET_IFNAME": "eth1"})
    assert "Connect timeout" in str(error) and "GLOO_SOCKET_IFNAME=eth1" in str(error)
    hint = host_interface({})
    address = socket.gethostbyname(socket.gethostname())
    assert socket.gethostname() in hint and address in hint and "set GLOO_SOCKET_IFNAME" in hint
    assert ("loopback" in hint) == address.startswith("127.")
