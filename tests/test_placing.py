"""--gpu-layers auto wired into the product: the parameter, the plan at load, and where it is shown
(run --verbose, doctor, /health, the chat app). This machine has no GPU and a CPU-only llama.cpp,
so the shown placement says "no GPU"; a fake NVML (named so) stands in for a GPU's free memory."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from localspec.cli import main
from localspec.engine import ModelSettings
from localspec.engine.llama_devices import Device, offload_devices
from localspec.engine.placement import GpuBudget, ModelMemory
from localspec.loading import EngineSpec, load_engine
from localspec.monitor import SystemMonitor
from localspec.options import Settings, model_settings
from localspec.params import PARAMS, InvalidOptionError
from localspec.placing import NO_GPU_BUILD, llama_offloads, machine_budget, resolve_layers
from localspec.server import ServerConfig
from localspec.server.app import create_app
from localspec.server.running import BackgroundServer
from tests.fake_pynvml import make_fake_pynvml

from .conftest import run_cli


@pytest.mark.parametrize("name", ["gpu_layers", "draft_gpu_layers"])
def test_gpu_layers_accept_auto_and_numbers_and_refuse_junk(name: str) -> None:
    p = PARAMS[name]
    assert p.default is None and Settings().__getattribute__(name) is None  # auto by default
    assert p.parse("auto") is None and p.parse("AUTO") is None
    assert p.parse("-1") == -1 and p.parse("20") == 20
    for junk in ("lots", "-2", "1.5", ""):
        with pytest.raises(InvalidOptionError) as err:
            p.parse(junk)
        assert "\n" not in str(err.value) and "auto" in str(err.value)


def test_cli_refuses_junk_layers_in_one_line(target_gguf: Path) -> None:
    proc = run_cli("run", "--target", str(target_gguf), "--gpu-layers", "many", "hi")
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1 and "gpu" in proc.stderr.lower()


def test_fake_gpu_auto_resolves_to_a_number(target_gguf: Path, draft_gguf: Path) -> None:
    # A fake NVML: 70 GiB free on GPU 0, plenty for the tiny pair, so auto puts all on the GPU.
    budget = machine_budget(SystemMonitor(make_fake_pynvml(gpus=1)), gpu_offload=True)
    assert budget.free_bytes == 70 * 1024**3
    ts, ds = model_settings(Settings(ctx=512))
    assert ts.n_gpu_layers is None and ds.n_gpu_layers is None
    new_ts, new_ds, plan = resolve_layers(target_gguf, draft_gguf, ts, ds, budget)
    assert plan is not None and plan.fits
    assert new_ts.n_gpu_layers == ModelMemory.from_gguf(target_gguf).n_layer + 1
    assert new_ds is not None
    assert new_ds.n_gpu_layers == ModelMemory.from_gguf(draft_gguf).n_layer + 1
    assert "Fake GPU 0" in plan.describe()
    # An explicit number wins over auto.
    ts3 = ModelSettings(n_gpu_layers=3, n_ctx=512)
    assert resolve_layers(target_gguf, draft_gguf, ts3, ds, budget)[0].n_gpu_layers == 3


def test_two_fake_gpus_say_multi_gpu_waits(target_gguf: Path) -> None:
    budget = machine_budget(SystemMonitor(make_fake_pynvml(gpus=2)), gpu_offload=True)
    _, _, plan = resolve_layers(target_gguf, None, ModelSettings(None, n_ctx=512), None, budget)
    assert plan is not None and "2 GPUs" in plan.describe()


def test_a_cpu_only_build_is_no_gpu_even_where_nvml_sees_one() -> None:
    budget = machine_budget(SystemMonitor(make_fake_pynvml(gpus=1)), gpu_offload=False)
    assert budget == GpuBudget.none(NO_GPU_BUILD)


GIB = 1024**3


def test_llama_cpps_own_gpu_memory_comes_before_nvmls(target_gguf: Path) -> None:
    """The devices are what a CUDA (or Metal, ROCm) build of llama.cpp lists, given as data:
    none is here. What llama.cpp reads wins over NVML's GPU 0, which may not be the GPU
    llama.cpp uses (``CUDA_VISIBLE_DEVICES``), and counts where NVML reads nothing."""
    cuda1 = Device("NVIDIA GeForce RTX 4090", 20 * GIB, 24 * GIB)
    for nvml in (make_fake_pynvml(gpus=2), make_fake_pynvml(driver=False)):
        budget = machine_budget(SystemMonitor(nvml), gpu_offload=True, devices=[cuda1])
        assert budget == GpuBudget(20 * GIB, 1, "NVIDIA GeForce RTX 4090")
        ts = ModelSettings(None, n_ctx=512)
        new_ts, _, plan = resolve_layers(target_gguf, None, ts, None, budget)
        assert plan is not None and plan.fits and "RTX 4090" in plan.describe()
        assert new_ts.n_gpu_layers == ModelMemory.from_gguf(target_gguf).n_layer + 1
    # A backend that gives no memory figure: NVML answers, as before.
    unknown = Device("some GPU", 0, 0)
    budget = machine_budget(SystemMonitor(make_fake_pynvml(gpus=1)), gpu_offload=True,
                            devices=[unknown])
    assert budget.free_bytes == 70 * GIB and budget.name == "Fake GPU 0"
    # Neither: no GPU memory reading, and auto offloads nothing, saying why.
    budget = machine_budget(SystemMonitor(make_fake_pynvml(driver=False)), gpu_offload=True,
                            devices=[unknown])
    assert budget.free_bytes is None and budget.note


@pytest.mark.skipif(llama_offloads(), reason="a GPU build lists its GPUs")
def test_llama_cpps_device_list_here_is_its_cpu_alone() -> None:
    """The real binding, on this CPU-only build: ggml lists its CPU device, with this
    machine's memory, and no device to offload to."""
    import llama_cpp._ggml as ggml
    import psutil

    from localspec.engine import llama_devices

    assert offload_devices() == []
    lib = llama_devices._bind(ggml.libggml)
    assert lib.ggml_backend_dev_count() >= 1
    cpu = llama_devices._device(lib, lib.ggml_backend_dev_get(0))
    assert cpu.total_bytes == psutil.virtual_memory().total
    assert 0 < cpu.free_bytes <= cpu.total_bytes


def test_run_verbose_shows_the_placement(target_gguf: Path, draft_gguf: Path) -> None:
    proc = run_cli("run", "--target", str(target_gguf), "--draft", str(draft_gguf), "-n", "3",
                   "--verbose", "--ctx", "256", "hello")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("placement: "))
    assert "no GPU" in line


def test_doctor_shows_the_placement(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) in (0, 1)
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert "no GPU" in checks["placement"]["summary"]
    assert checks["placement"]["details"]["free_bytes"] is None
    main(["doctor"])
    out = capsys.readouterr().out
    assert any("placement" in x and "no GPU" in x for x in out.splitlines())


def test_health_has_the_placement(target_gguf: Path) -> None:
    spec = EngineSpec(target=str(target_gguf), target_settings=ModelSettings(None, n_ctx=256),
                      draft_mode="lookup")
    app = create_app(lambda: load_engine(spec), ServerConfig(model_id="solo"))
    with BackgroundServer(app) as srv:
        assert app.state.localspec.worker.loaded.wait(120)
        body = httpx.get(srv.url + "/health").json()
        assert body["status"] == "ok" and "no GPU" in body["placement"]
        meta = httpx.get(srv.url + "/v1/models").json()["data"][0]["meta"]
        assert meta["placement"] == body["placement"]
