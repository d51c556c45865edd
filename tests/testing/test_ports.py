"""Ports for servers that bind long after the port was chosen (the P/D side channel)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvguard.testing import ports
from kvguard.testing.ports import (
    LOWEST_PORT,
    ephemeral_low,
    free_loopback_port,
    free_loopback_ports,
)


def test_ports_come_from_below_the_kernels_ephemeral_range_and_bind() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = [free_loopback_port() for _ in range(50)]
    assert len(set(picked)) == 50, "a port was handed out twice"
    assert all(LOWEST_PORT <= p < low for p in picked), (low, picked)
    for p in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_another_process_holds_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", LOWEST_PORT))
        held.listen()
        # The range is shrunk to the held port and one more: only the free one can come back.
        monkeypatch.setattr(ports, "ephemeral_low", lambda: LOWEST_PORT + 2)
        monkeypatch.setattr(ports, "_issued", set())
        assert free_loopback_port() == LOWEST_PORT + 1
        with pytest.raises(RuntimeError, match="no free TCP port"):
            free_loopback_port()


def test_an_unreadable_or_odd_range_file_falls_back_to_linux_default(tmp_path: Path) -> None:
    assert ephemeral_low(tmp_path / "missing") == 32_768
    (tmp_path / "odd").write_text("1024 2048\n")
    assert ephemeral_low(tmp_path / "odd") == 32_768
    (tmp_path / "ok").write_text("40000\t60999\n")
    assert ephemeral_low(tmp_path / "ok") == 40_000


def test_consecutive_ports_skip_a_run_with_one_held_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", LOWEST_PORT + 1))
        held.listen()
        # Ports LOWEST_PORT .. +4: the only run of two free ports is +2, +3 (+0 has +1 held).
        monkeypatch.setattr(ports, "ephemeral_low", lambda: LOWEST_PORT + 4)
        monkeypatch.setattr(ports, "_issued", set())
        assert free_loopback_ports(2) == LOWEST_PORT + 2
        with pytest.raises(RuntimeError, match="no 2 consecutive free TCP ports"):
            free_loopback_ports(2)  # +2, +3 issued; +0 has +1 held
    with pytest.raises(ValueError, match="at least 1"):
        free_loopback_ports(0)
