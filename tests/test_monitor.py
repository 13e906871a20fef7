"""monitor.py: NVML against a fake pynvml (no driver, no GPU, GPUs), psutil for real."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from localspec.monitor import SystemMonitor
from tests.fake_pynvml import make_fake_pynvml


def test_gpus_are_read_in_one_sample_with_this_process_vram() -> None:
    nv = make_fake_pynvml(gpus=2, pid=os.getpid())
    mon = SystemMonitor(nvml=nv)
    s = mon.sample()
    assert s.gpu_note is None
    assert [g.name for g in s.gpus] == ["Fake GPU 0", "Fake GPU 1"]
    g = s.gpus[0]
    assert (g.memory_used, g.memory_total, g.utilization) == (10 * 1024**3, 80 * 1024**3, 40)
    assert g.process_memory == 3 * 1024**3
    assert g.memory_free == 70 * 1024**3
    assert s.free_memory_for_models() == (70 * 1024**3, "VRAM")
    mon.sample()
    assert nv.calls["init"] == 1  # lazy, once
    mon.close()
    mon.close()
    assert nv.calls["shutdown"] == 1


def test_values_nvml_does_not_report_are_none() -> None:
    nv = make_fake_pynvml(pid=os.getpid(), process_memory=None, utilization_supported=False)
    g = SystemMonitor(nvml=nv).sample().gpus[0]
    assert g.utilization is None and g.process_memory is None
    assert g.memory_used is not None


def test_no_driver_says_so_and_falls_back_to_psutil() -> None:
    mon = SystemMonitor(nvml=make_fake_pynvml(driver=False))
    s = mon.sample()
    assert s.gpus == ()
    assert s.gpu_note and "No NVIDIA driver" in s.gpu_note
    assert s.ram_total and s.ram_used is not None and s.process_rss
    assert s.free_memory_for_models()[1] == "RAM"
    mon.close()  # no shutdown without init: must not raise


def test_no_gpu_says_so() -> None:
    s = SystemMonitor(nvml=make_fake_pynvml(gpus=0)).sample()
    assert s.gpus == () and s.gpu_note == "No NVIDIA GPU found"


def test_real_machine_sample_never_raises() -> None:
    # The real pynvml here: no driver on this machine, or a GPU on one with it. Either is fine.
    mon = SystemMonitor()
    s = mon.sample()
    assert s.process_rss and s.process_rss > 0
    assert bool(s.gpus) != bool(s.gpu_note)
    mon.close()


def test_this_process_is_the_one_watched() -> None:
    """The chat app's models live in its engine process: the gauges follow that process (its
    VRAM on the (fake) GPU, its RSS for real), and show none where the models are another
    program's."""
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(300 << 20); "
                              "time.sleep(60)"], stdin=subprocess.DEVNULL)
    try:
        nv = make_fake_pynvml(pid=child.pid)
        mon = SystemMonitor(nvml=nv)
        mine = mon.sample()
        assert mine.gpus[0].process_memory is None  # the fake GPU runs the child, not us
        mon.watch(child.pid)
        for _ in range(100):  # until the child has touched its 300 MB
            theirs = mon.sample()
            if (theirs.process_rss or 0) > 250 << 20:
                break
            time.sleep(0.05)
        assert theirs.gpus[0].process_memory == 3 * 1024**3
        assert theirs.process_rss is not None and theirs.process_rss > 250 << 20
        mon.watch(None)
        none = mon.sample()
        assert none.process_rss is None and none.gpus[0].process_memory is None
    finally:
        child.kill()
        child.wait()
