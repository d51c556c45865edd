"""Host probe parsers on sample text: /proc/meminfo, /proc/self/status, sysctl vm.swapusage."""

from __future__ import annotations

import pytest
from _attr_fakes import LINUX_MEMINFO, LINUX_STATUS, FakeHost, GiB, MiB
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.attribution.host import (
    kib_field,
    parse_int,
    parse_kib_fields,
    parse_meminfo,
    parse_vm_swapusage,
    read_host,
    statm_rss_bytes,
)


def test_meminfo_swap_used_is_total_minus_free_and_available_in_bytes() -> None:
    used, total, available = parse_meminfo(LINUX_MEMINFO)
    assert used == (8388604 - 8126460) * 1024 == 256 * MiB
    assert total == 8388604 * 1024
    assert available == 41234560 * 1024


def test_meminfo_on_a_host_without_swap_reads_zero_not_unknown() -> None:
    text = "MemTotal: 24684000 kB\nMemAvailable: 24015968 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n"
    assert parse_meminfo(text) == (0, 0, 24015968 * 1024)


def test_meminfo_missing_fields_give_none_for_what_depends_on_them() -> None:
    assert parse_meminfo("MemTotal: 100 kB\nSwapTotal: 10 kB\n") == (None, 10 * 1024, None)
    assert parse_meminfo("") == (None, None, None)


def test_kib_fields_keep_counts_and_skip_malformed_lines() -> None:
    f = parse_kib_fields(LINUX_MEMINFO + "garbage line\nBroken: x kB\n")
    assert f["HugePages_Total"] == 0 and f["Hugepagesize"] == 2048 * 1024
    assert "Broken" not in f
    status = parse_kib_fields(LINUX_STATUS)
    assert status["VmRSS"] == 2 * GiB and status["Threads"] == 37


_NAMES = st.sampled_from(["VmRSS", "SwapTotal", "SwapFree", "MemAvailable", "Threads",
                          "HugePages_Total", "Hugepagesize", "VmSwap"])
_LINES = st.one_of(
    st.tuples(_NAMES, st.sampled_from([" ", "\t", "   ", ""]), st.integers(0, 10**12),
              st.sampled_from(["", " kB", "\tkB", " kb", " KB", "kB", " kBx", " MB", " kB x"]))
    .map(lambda t: f"{t[0]}:{t[1]}{t[2]}{t[3]}"),
    st.sampled_from(["garbage line", "Broken: x kB", "Name: -5 kB", "Cpus_allowed:\tff",
                     "Empty:", ""]),
)


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(_LINES, max_size=12), name=_NAMES, trailing=st.booleans())
def test_one_field_reads_as_the_full_parse_reads_it(lines: list[str], name: str,
                                                   trailing: bool) -> None:
    """The checkpoint's one-field reader agrees with the full parser on every field that
    appears once (real /proc files name each field once)."""
    text = "\n".join(lines) + ("\n" if trailing else "")
    if sum(1 for line in lines if line.startswith(name + ":")) > 1:
        return
    assert kib_field(text, name) == parse_kib_fields(text).get(name)


def test_one_field_on_real_samples() -> None:
    for text in (LINUX_MEMINFO, LINUX_STATUS):
        for name, value in parse_kib_fields(text).items():
            assert kib_field(text, name) == value, name


@pytest.mark.parametrize(
    ("text", "used", "total"),
    [
        # `sysctl vm.swapusage` on macOS 14/15 (Apple silicon)
        ("vm.swapusage: total = 2048.00M  used = 1310.25M  free = 737.75M  (encrypted)\n",
         round(1310.25 * MiB), 2048 * MiB),
        # `sysctl -n vm.swapusage`
        ("total = 11264.00M  used = 9830.50M  free = 1433.50M  (encrypted)",
         round(9830.50 * MiB), 11264 * MiB),
        # no swap in use yet
        ("vm.swapusage: total = 0.00M  used = 0.00M  free = 0.00M  (encrypted)", 0, 0),
        # other units are accepted too
        ("total = 4.00G  used = 512.00K  free = 3.99G", 512 * 1024, 4 * GiB),
    ],
)
def test_vm_swapusage(text: str, used: int, total: int) -> None:
    assert parse_vm_swapusage(text) == (used, total)


def test_vm_swapusage_garbage_is_unknown() -> None:
    assert parse_vm_swapusage("sysctl: unknown oid 'vm.swapusage'") == (None, None)


def test_parse_int() -> None:
    assert parse_int("68719476736\n") == 64 * GiB
    assert parse_int("n/a") is None and parse_int(None) is None


def test_read_host_linux_from_procfs_text() -> None:
    h = read_host(FakeHost())
    assert h.rss_bytes == 2 * GiB
    assert h.swap_used_bytes == 256 * MiB and h.swap_total_bytes == 8388604 * 1024
    assert h.mem_available_bytes == 41234560 * 1024
    assert h.rss_peak_bytes == 3 * GiB
    assert h.unavailable == []


def test_statm_gives_resident_pages_times_the_page_size() -> None:
    assert statm_rss_bytes("466174 147773 36524 1 0 255906 0\n", 4096) == 147773 * 4096
    assert statm_rss_bytes("466174 147773 36524 1 0 255906 0\n", 16384) == 147773 * 16384
    for bad in ("", "466174", "466174 x 1", "466174 -5 1"):
        assert statm_rss_bytes(bad, 4096) is None
    assert statm_rss_bytes("1 2 3", 0) is None


def test_read_host_prefers_statm_and_falls_back_to_status() -> None:
    host = FakeHost()
    host.files["/proc/self/statm"] = f"900000 {3 * GiB // 4096} 1000 1 0 2000 0\n"
    assert read_host(host).rss_bytes == 3 * GiB  # statm, not status's 2 GiB
    host.files["/proc/self/statm"] = "garbled"
    assert read_host(host).rss_bytes == 2 * GiB  # status's VmRSS
    host.children = {41: 0}
    host.files["/proc/41/statm"] = f"10 {GiB // 4096} 0 0 0 0 0\n"
    h = read_host(host, include_children=True)
    assert (h.child_processes, h.child_processes_rss_bytes) == (1, GiB)


def test_read_host_macos_from_sysctl_and_psutil() -> None:
    host = FakeHost(platform="darwin", files={}, rss=18 * GiB, sysctls={
        "vm.swapusage": "total = 11264.00M  used = 9830.50M  free = 1433.50M  (encrypted)",
        "kern.memorystatus_level": "31\n", "hw.memsize": f"{48 * GiB}\n"})
    h = read_host(host)
    assert h.rss_bytes == 18 * GiB
    assert h.swap_used_bytes == round(9830.50 * MiB)
    assert h.mem_available_bytes == 48 * GiB * 31 // 100
    assert h.unavailable == []


def test_read_host_says_what_it_could_not_read() -> None:
    h = read_host(FakeHost(platform="darwin", files={}, rss=None))
    assert h.rss_bytes is h.swap_used_bytes is h.mem_available_bytes is None
    assert {u.split(":")[0] for u in h.unavailable} == {"rss", "swap", "mem_available"}
    h = read_host(FakeHost(platform="linux", files={}))
    assert h.rss_bytes is None and h.swap_used_bytes is None
    assert any(u.startswith("swap, mem_available") for u in h.unavailable)
    h = read_host(FakeHost(platform="win32", files={}, rss=1 * GiB))
    assert h.rss_bytes == 1 * GiB
    assert any("no probe for platform win32" in u for u in h.unavailable)
