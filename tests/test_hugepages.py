"""vllm_kvq.hugepages: an unused zeroed buffer goes on transparent huge pages, stays zero,
and nothing else is touched (file-backed memory, the switch off)."""
import os
import subprocess
import sys

import pytest
import torch

from vllm_kvq import hugepages

MIB = 1 << 20


def huge_kib_in(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings overlapping t's memory."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


needs_madvise = pytest.mark.skipif(hugepages.thp_mode() != "madvise",
                                   reason="transparent huge pages not in madvise mode here")


@needs_madvise
def test_an_unused_zeroed_buffer_goes_on_huge_pages_and_stays_zero():
    # a 30 MiB allocation freed first raises glibc's mmap threshold: the buffer then comes
    # from its [heap] (as in a long test session), the other kind of anonymous memory
    del_me = torch.zeros(30 * MIB, dtype=torch.uint8)
    del del_me
    buf = torch.zeros(24 * MIB, dtype=torch.uint8)
    assert huge_kib_in(buf) == 0  # madvise mode: 4 KiB pages as allocated
    advised = hugepages.advise_huge_pages([buf, buf[MIB:]])  # one storage, advised once
    assert advised >= 20 * MIB and advised % hugepages.HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0  # read back as zeros
    buf.fill_(7)  # first touch faults in huge pages (all 20+ MiB here; where memory is
    assert huge_kib_in(buf) >= 2048  # too fragmented the kernel falls back to 4 KiB pages)
    assert int((buf == 7).sum()) == buf.numel()


@needs_madvise
def test_file_backed_memory_and_the_switch_off_are_left_alone(tmp_path, monkeypatch):
    path = tmp_path / "pages"
    path.write_bytes(bytes(range(256)) * (16 * MIB // 256))
    mapped = torch.from_file(str(path), shared=True, size=16 * MIB, dtype=torch.uint8)
    assert hugepages.advise_huge_pages([mapped]) == 0  # not private anonymous memory
    assert int(mapped[:256].sum()) == sum(range(256))  # its data still there
    monkeypatch.setattr(hugepages, "MODE", "0")  # KVQ_HUGE_PAGES=0
    assert hugepages.advise_huge_pages([torch.zeros(8 * MIB, dtype=torch.uint8)]) == 0


def test_thp_mode_reads_the_kernels_choice(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_MODE_FILE", str(f))
    assert hugepages.thp_mode() == "madvise"
    monkeypatch.setattr(hugepages, "THP_MODE_FILE", str(tmp_path / "missing"))
    assert hugepages.thp_mode() == ""
    assert hugepages.advise_huge_pages([torch.zeros(4 * MIB, dtype=torch.uint8)]) == 0


def test_which_engines_get_huge_pages(monkeypatch):
    for mode, ours, theirs in (("1", True, False), ("0", False, False), ("all", True, True)):
        monkeypatch.setattr(hugepages, "MODE", mode)
        assert (hugepages.wanted(True), hugepages.wanted(False)) == (ours, theirs), mode


def test_a_bad_switch_value_is_refused_by_name():
    r = subprocess.run([sys.executable, "-c", "import vllm_kvq.hugepages"], text=True,
                       capture_output=True, env={**os.environ, "KVQ_HUGE_PAGES": "yes"})
    assert r.returncode != 0
    assert "KVQ_HUGE_PAGES='yes'; allowed: 0, 1, all" in r.stderr
