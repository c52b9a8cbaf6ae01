"""Hardware profiles (`canzona.hardware`): shipped figures, relations, loading and validation."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest

from canzona.cost import DeviceRate, default_rate
from canzona.errors import SpecError
from canzona.hardware import (
    DEFAULT_PROFILE,
    DEVICE_PROFILES,
    GPUSpec,
    HardwareProfile,
    NCCLSpec,
    NetworkSpec,
    NodeSpec,
    load_profile,
    profile_for_device,
    profile_from_dict,
    profile_names,
)

SECTIONS = {"gpu": GPUSpec, "node": NodeSpec, "network": NetworkSpec, "nccl": NCCLSpec}


def raw(name: str) -> dict:
    return json.loads((resources.files("canzona") / "profiles" / f"{name}.json").read_text())


def test_shipped_profiles():
    names = profile_names()
    assert {"h100-sxm", "h200", "a100-sxm"} <= set(names)
    assert DEFAULT_PROFILE in names
    assert names == sorted(names)


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_loads_and_names_its_sources(name):
    p = load_profile(name)
    assert isinstance(p, HardwareProfile)
    assert p.name == name
    assert p.sources and all(isinstance(s, str) and s.strip() for s in p.sources)
    assert p.description
    assert isinstance(p.measured, bool)
    g = p.gpu
    assert isinstance(g.sms, int) and isinstance(g.gemm_tile, int)
    for dtype, eff in g.gemm_efficiency.items():
        assert 0 < eff <= 1
        assert dtype in g.peak_flops
    # large-GEMM rate = peak * efficiency
    for dtype, rate in g.gemm_flops().items():
        assert rate == pytest.approx(g.peak_flops[dtype] * g.gemm_efficiency[dtype], rel=1e-15)
        assert rate <= g.peak_flops[dtype]
    assert g.peak_flops["bf16"] >= g.peak_flops["fp32"]
    n = p.node
    assert isinstance(n.gpus, int) and n.gpus >= 1
    assert n.nvlink_ring_busbw <= n.nvlink_bytes_per_s  # bus bandwidth never beats the link
    assert n.nvls_allreduce_busbw >= n.nvlink_ring_busbw
    assert p.network.nic_busbw <= p.network.nic_bytes_per_s
    assert p.network.nic_busbw < n.nvlink_ring_busbw  # a NIC is slower than NVLink
    c = p.nccl
    assert c.network_step_latency_s > c.nvlink_step_latency_s > 0
    assert c.base_latency_s < 1e-3  # microseconds, not milliseconds


def test_h100_datasheet_figures():
    p = load_profile("h100-sxm")
    assert p.gpu.peak_flops["bf16"] == 989e12
    assert p.gpu.peak_flops["fp8"] == 1979e12  # dense
    # the boost-clock tensor-core rates and the power-limited clock fitted with the GEMM model
    # (canzona/data/gemm_measurements.json)
    assert p.gpu.gemm_flops()["bf16"] == pytest.approx(0.875 * 989e12)
    assert p.gpu.gemm_flops()["fp8"] == pytest.approx(0.843 * 1979e12)
    assert p.gemm_kernels().sustained_clock == 0.91
    assert p.gpu.hbm_bytes_per_s == 3.35e12
    assert p.gpu.sms == 132
    assert p.gpu.launch_s == 5e-6
    # what CUDA gives a process (79.11 GiB), below NVML's 81,559 MiB total by what the driver keeps
    assert p.gpu.memory_bytes == round(79.11 * 2**30) < 81559 * 2**20
    assert p.node.nvlink_bytes_per_s == 450e9
    assert p.node.nvlink_ring_busbw == 370e9
    assert p.node.nvls_allreduce_busbw == 480e9
    assert p.network.nic_bytes_per_s == 50e9  # 400 Gb/s
    assert p.network.nic_busbw == 48e9


def test_h200_has_h100_compute_and_more_memory_bandwidth():
    h100, h200 = load_profile("h100-sxm"), load_profile("h200")
    assert h200.gpu.peak_flops == h100.gpu.peak_flops
    assert h200.gpu.gemm_efficiency == h100.gpu.gemm_efficiency
    assert h200.gpu.gemm_flops() == h100.gpu.gemm_flops()
    assert h200.gpu.sms == h100.gpu.sms
    assert h200.gpu.hbm_bytes_per_s > h100.gpu.hbm_bytes_per_s
    assert h200.gpu.hbm_bytes_per_s == 4.8e12
    # what CUDA gives a process on the "141 GB" H200 (139.81 GiB), below NVML's 143,771 MiB
    assert h200.gpu.memory_bytes == round(139.81 * 2**30) < 143771 * 2**20
    assert h200.gpu.memory_bytes > h100.gpu.memory_bytes
    assert h200.node == h100.node


def test_shipped_profiles_are_datasheet_defaults_on_8_gpu_nodes():
    for name in ("h100-sxm", "h200", "a100-sxm"):
        p = load_profile(name)
        assert p.measured is False
        assert p.node.gpus == 8


def test_a100_is_slower_than_h100():
    a100, h100 = load_profile("a100-sxm"), load_profile("h100-sxm")
    assert a100.gpu.peak_flops["bf16"] < h100.gpu.peak_flops["bf16"]
    assert a100.gpu.hbm_bytes_per_s < h100.gpu.hbm_bytes_per_s
    assert a100.node.nvlink_bytes_per_s < h100.node.nvlink_bytes_per_s
    assert a100.network.nic_busbw < h100.network.nic_busbw


def test_a100_capacity_is_what_cuda_gives_a_process():
    # an A100-SXM4-80GB's cudaDeviceProp totalGlobalMem (79.15 GiB, the least of the published
    # figures, which vary with the driver), below NVML's 81,920 MiB total by what the driver keeps
    a100 = load_profile("a100-sxm")
    assert a100.gpu.memory_bytes == 84987740160 < 81920 * 2**20
    assert f"{a100.gpu.memory_bytes / 2**30:.2f}" == "79.15"  # PyTorch's out-of-memory message
    assert not any("gpu.memory_bytes" in s and "assumption" in s for s in a100.sources)


def test_default_profile_is_h100():
    assert load_profile() == load_profile("h100-sxm")


def test_loading_a_json_path(tmp_path):
    path = tmp_path / "mine.json"
    data = raw("h100-sxm")
    data["name"] = "my-h100"
    data["measured"] = True
    data["gpu"]["hbm_bytes_per_s"] = 3.0e12
    path.write_text(json.dumps(data))
    for arg in (path, str(path)):
        p = load_profile(arg)
        assert p.name == "my-h100"
        assert p.measured is True
        assert p.gpu.hbm_bytes_per_s == 3.0e12
        assert p.node == load_profile("h100-sxm").node


def test_a_copied_shipped_profile_loads_identically(tmp_path):
    for name in profile_names():
        path = tmp_path / f"copy-{name}.json"
        path.write_text(json.dumps(raw(name)))
        assert load_profile(path) == load_profile(name)


# --- malformed profiles -----------------------------------------------------------------------


def broken(mutate) -> dict:
    data = copy.deepcopy(raw("h100-sxm"))
    mutate(data)
    return data


def _del(*keys):
    def f(d):
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
    return f


def _set(value, *keys):
    def f(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return f


MALFORMED = {
    "wrong schema": (_set("canzona.plan", "schema"), "schema"),
    "no schema": (_del("schema"), "schema"),
    "wrong version": (_set(2, "version"), "version"),
    "bool version": (_set(True, "version"), "version"),
    "missing section": (_del("nccl"), "nccl"),
    "section not a dict": (_set([1, 2], "node"), "node"),
    "missing field": (_del("gpu", "hbm_bytes_per_s"), "hbm_bytes_per_s"),
    "missing node field": (_del("node", "nvls_allreduce_busbw"), "nvls_allreduce_busbw"),
    "zero number": (_set(0, "network", "nic_busbw"), "nic_busbw"),
    "negative number": (_set(-1.0, "nccl", "base_latency_s"), "base_latency_s"),
    "string number": (_set("fast", "gpu", "launch_s"), "launch_s"),
    "bool number": (_set(True, "node", "gpus"), "gpus"),
    "null number": (_set(None, "gpu", "sms"), "sms"),
    "negative in a map": (_set({"bf16": -1.0}, "gpu", "peak_flops"), "peak_flops"),
    "empty sources": (_set([], "sources"), "sources"),
    "sources not a list": (_set("datasheet", "sources"), "sources"),
    "non-string source": (_set(["ok", 3], "sources"), "sources"),
    "no sources": (_del("sources"), "sources"),
    "empty name": (_set("", "name"), "name"),
    # a per-dtype map where a number belongs, and a number where a map belongs (tracebacks or a dict
    # of rates reaching the simulator as a bandwidth)
    "map for a number": (_set({"bf16": 1.0}, "gpu", "hbm_bytes_per_s"), "hbm_bytes_per_s"),
    "map for a count": (_set({"bf16": 1.0}, "gpu", "sms"), "sms"),
    "number for a map": (_set(989e12, "gpu", "peak_flops"), "peak_flops"),
    "empty source": (_set(["ok", "  "], "sources"), "sources"),
    "description not a string": (_set(5, "description"), "description"),
    # a misspelt field would silently be its default (hbm_efficiency 1.0: memory-bound kernels 11% faster)
    "misspelt gpu field": (_set(0.5, "gpu", "hbm_efficency"), "hbm_efficency"),
    "unknown node field": (_set(1e9, "node", "nvlink_bytes_per_sec"), "nvlink_bytes_per_sec"),
    "unknown nccl field": (_set(1e-6, "nccl", "base_latency"), "base_latency"),
    "unknown dtype of peak_flops": (_set(1e15, "gpu", "peak_flops", "bf61"), "bf61"),
    "unknown dtype of gemm_efficiency": (_set(0.5, "gpu", "gemm_efficiency", "fp-8"), "fp-8"),
    # no memory left beside the CUDA context allowance (DEFAULT_FIXED_OVERHEAD): nothing can ever fit
    "memory under the CUDA allowance": (_set(5e8, "gpu", "memory_bytes"), "memory_bytes"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_profiles_are_spec_errors(case, tmp_path):
    mutate, needle = MALFORMED[case]
    data = broken(mutate)
    with pytest.raises(SpecError) as e:
        profile_from_dict(data, "x")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError) as e:
        load_profile(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("data", [None, [], "h100", 3])
def test_non_objects_are_rejected(data):
    with pytest.raises(SpecError):
        profile_from_dict(data)


@pytest.mark.parametrize("text", ["{", "not json at all", '{"schema": "canzona.hardware",}', ""])
def test_not_json_is_a_spec_error(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_profile(path)
    msg = str(e.value)
    assert "JSON" in msg and str(path) in msg and "\n" not in msg


def test_unreadable_or_unknown_profiles(tmp_path):
    with pytest.raises(SpecError) as e:
        load_profile(tmp_path / "missing.json")
    assert "cannot read" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecError) as e:
        load_profile("nope")
    assert "h100-sxm" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecError):
        load_profile(tmp_path)  # a directory
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"name": "\xff"}')
    with pytest.raises(SpecError):
        load_profile(bad)


# --- DeviceRate -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", profile_names())
def test_device_rate_from_profile(name):
    p = load_profile(name)
    r = DeviceRate.from_profile(p)
    assert r.name == name
    assert r.gemm_flops == p.gpu.gemm_flops()
    assert r.elementwise_flops == p.gpu.elementwise_flops
    assert r.hbm_bytes_per_s == p.gpu.hbm_bytes_per_s
    assert r.solver_flops == p.gpu.solver_flops
    assert r.launch_s == p.gpu.launch_s
    assert r.sms == p.gpu.sms
    assert r.tile == p.gpu.gemm_tile
    for s in p.sources:
        assert s in r.source


def test_cost_module_h100_rate_is_the_profile():
    assert default_rate() == DeviceRate.from_profile(load_profile("h100-sxm"))
    assert default_rate().gemm_flops["bf16"] == pytest.approx(989e12 * 0.875)


# --- validation of values a profile could get wrong -------------------------------------------


@pytest.mark.parametrize("key", ["sms", "gemm_tile"])
def test_fractional_integer_fields_are_rejected(key):
    with pytest.raises(SpecError):
        profile_from_dict(broken(_set(0.5, "gpu", key)))


def test_fractional_gpus_per_node_is_rejected():
    with pytest.raises(SpecError):
        profile_from_dict(broken(_set(8.5, "node", "gpus")))


def test_profile_without_bf16_rate_is_rejected():
    with pytest.raises(SpecError):
        profile_from_dict(broken(_set({"fp16": 1e15}, "gpu", "peak_flops")))


@pytest.mark.parametrize("mutate", [_set({"bf16": 1.5}, "gpu", "gemm_efficiency"),
                                    _set({"fp32": 2.0}, "gpu", "gemm_efficiency")], ids=["bf16", "fp32"])
def test_fractions_above_one_are_rejected(mutate):
    with pytest.raises(SpecError):
        profile_from_dict(broken(mutate))


def test_an_older_profile_with_a_model_flops_utilization_still_loads():
    """The simulator no longer takes an MFU factor (MFU is an output, docs/design.md §9.3); a
    profile written before keeps loading and the figure is ignored."""
    raw = json.loads((resources.files("canzona") / "profiles" / "h100-sxm.json").read_text())
    raw["gpu"]["model_flops_utilization"] = 0.45
    assert profile_from_dict(raw).gpu == load_profile("h100-sxm").gpu


@pytest.mark.parametrize(("device_name", "profile"), [
    # what torch.cuda.get_device_name gives on each shipped profile's GPU
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-sxm"),
    (" NVIDIA  H200 ", "h200"),  # spacing aside
    # other products of those families (other power limits, clocks or HBM) and other GPUs: none
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None), ("NVIDIA H20", None),
    ("NVIDIA H800", None), ("NVIDIA GH200 480GB", None), ("NVIDIA A100-PCIE-40GB", None),
    ("NVIDIA A100-SXM4-40GB", None), ("NVIDIA A100 80GB PCIe", None), ("NVIDIA GeForce RTX 4090", None),
    ("NVIDIA B200", None), ("", None),
])
def test_a_device_name_matches_its_shipped_profile_and_no_other_gpu(device_name, profile):
    assert profile_for_device(device_name) == profile


def test_every_device_profile_is_a_shipped_one():
    assert set(DEVICE_PROFILES.values()) == set(profile_names())
