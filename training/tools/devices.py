"""The devices the planner knows: memory and peak FLOP/s per device, each figure with its source.

GB means 2**30 bytes throughout, the unit of npu-smi's HBM figures and of MindSpore's
`context.max_device_memory`. training/tools/planner.py plans against these; recipes name one in
hardware.device. Import-light: no MindSpore.
"""

import os
from dataclasses import dataclass, replace
from typing import Optional

GB = 2 ** 30

# Collective bandwidth per device, by the links a group crosses (training/tools/planner.py link_bytes_per_s).
# Within a node, HCCS: ~100 GB/s bus bandwidth per device, an assumption (no Huawei figure we could confirm for a
# collective over an Atlas 800T A2's 8-device HCCS mesh), the planner's single figure before it told links apart.
# Across nodes, RoCE: an Atlas 800T A2 has one 200GE RoCE port per NPU (8 x 200GE, Huawei's Atlas 800T A2
# specification), 200 Gb/s = 25 GB/s per device, before protocol overhead. The 910A's Atlas 800 (model 9000) is
# planned with the same two figures: none of its own here.
HCCS_BYTES_PER_S = 100e9
ROCE_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: Optional[int]        # HBM (RAM for CPU); the runtime keeps a share of it
    peak_flops_16bit: Optional[float]  # dense bf16/fp16 matmul peak, FLOP/s; None: no figure we trust
    peak_flops_fp32: Optional[float]   # dense fp32 peak, FLOP/s; None: no figure we trust
    bf16: bool = True
    source: str = ""
    intra_node_bytes_per_s: float = HCCS_BYTES_PER_S  # a collective among devices of one node
    inter_node_bytes_per_s: float = ROCE_BYTES_PER_S  # a collective whose group spans nodes


def _mem_total_bytes() -> Optional[int]:
    """This machine's RAM: MemTotal from /proc/meminfo (Linux), else the page count."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# Capacities: npu-smi reports 32768 MB (910A, 910B4) and 65536 MB (910B1-B3) of HBM; HAMi's
# Ascend device table (Project-HAMi, vNPU memoryCapacity) lists the same.
ASCEND_910A = DeviceSpec(
    "Ascend910A", 32 * GB,
    # 256 TFLOPS fp16: Huawei's Ascend 910 launch figure (press release Aug 2019, Hot Chips 31).
    # No bf16 on this chip (fp16 only). Huawei published no fp32 figure.
    256e12, None, bf16=False,
    source="32 GB HBM; 256 TFLOPS fp16 (Huawei launch figure, 2019); no bf16; fp32 peak unpublished")

# Huawei publishes no per-bin datasheet for the 910B family. The 16-bit peaks below are the
# approximate figures commonly quoted for each bin, not vendor numbers: treat them as +-10%.
# A measured bf16 4096^3 matmul reaches ~315 TFLOP/s on a 910B2 (zzc0721/torch-performance-
# test-data issue 109), consistent with B2's figure. fp32: no vendor figure (the same
# measurement gives ~85 TFLOP/s for fp32 matmul, a lower bound only).
_910B_CAVEAT = "approximate third-party figure, not a Huawei datasheet (+-10%); fp32 peak unpublished"
ASCEND_910B1 = DeviceSpec(
    "Ascend910B1", 64 * GB, None, None,  # no peak figure we could confirm for this bin
    source="64 GB HBM; no 16-bit peak figure we could confirm for the B1 bin")
ASCEND_910B2 = DeviceSpec("Ascend910B2", 64 * GB, 376e12, None,
                          source=f"64 GB HBM; ~376 TFLOPS bf16/fp16, {_910B_CAVEAT}")
ASCEND_910B3 = DeviceSpec("Ascend910B3", 64 * GB, 313e12, None,
                          source=f"64 GB HBM; ~313 TFLOPS bf16/fp16, {_910B_CAVEAT}")
# 32 GB is the B4's difference from the other bins (vllm-ascend issue 129, HAMi's table).
ASCEND_910B4 = DeviceSpec("Ascend910B4", 32 * GB, 280e12, None,
                          source=f"32 GB HBM; ~280 TFLOPS bf16/fp16, {_910B_CAVEAT}")
# A 64 GB B4 variant exists: npu-smi names it 910B4-1 and shows 65536 MB (Project-HAMi/HAMi-WebUI
# issue 47); no peak figure for it.
ASCEND_910B4_1 = DeviceSpec("Ascend910B4-1", 64 * GB, None, None,
                            source="64 GB HBM (npu-smi: 65536 MB); no peak figure for this variant")


def _server(name: str, chip: DeviceSpec, what: str) -> DeviceSpec:
    return replace(chip, name=name, source=f"{what}, per device: {chip.source}")


DEVICES = {spec.name: spec for spec in (
    ASCEND_910A, ASCEND_910B1, ASCEND_910B2, ASCEND_910B3, ASCEND_910B4, ASCEND_910B4_1,
    # Servers, for people who know the box rather than the chip. An Atlas 800T A2 holds 8
    # devices of one 910B bin; `npu-smi info` names it (Name column: 910B1, 910B2, 910B3).
    _server("Atlas800T-A2-910B1", ASCEND_910B1, "Atlas 800T A2 training server, 8 x 910B1"),
    _server("Atlas800T-A2-910B2", ASCEND_910B2, "Atlas 800T A2 training server, 8 x 910B2"),
    _server("Atlas800T-A2-910B3", ASCEND_910B3, "Atlas 800T A2 training server, 8 x 910B3"),
    _server("Atlas800-9000", ASCEND_910A, "Atlas 800 training server (model 9000), 8 x 910A"),
    # This machine: its RAM; a CPU's peak FLOP/s depends on cores, clock and vector width.
    DeviceSpec("CPU", _mem_total_bytes(), None, None,
               source="this machine's MemTotal (/proc/meminfo); peak FLOP/s unknown"),
)}

DEFAULT_DEVICE = {"CPU": "CPU", "Ascend": "Ascend910B2"}


# Assumed (no Huawei datasheet figure): 910B HBM ~1.6 TB/s. Collectives: link_bytes_per_s, no overlap with compute.
HBM_BYTES_PER_S = 1.6e12


def spans_nodes(recipe, size: int, stride: int = 1) -> bool:
    """Whether a communication group of `size` ranks, `stride` apart, spans nodes of hardware.devices_per_node.

    Ranks fill the nodes in order. A pipeline stage holds consecutive ranks (MindFormers' _get_pipeline_group,
    mindformers/core/callback/callback.py:567-577); within it the device matrix is (DP, TP), TP the last dimension,
    so a TP group is `tp` consecutive ranks and a DP group `dp` ranks `tp` apart; an expert-parallel group is `ep`
    consecutive ranks (mindformers/parallel_core/training_graph/transformer/moe/utils.py:61-64).
    """
    return (size - 1) * stride + 1 > recipe.hardware.devices_per_node


def link_bytes_per_s(recipe, spec: DeviceSpec, size: int, stride: int = 1) -> float:
    """The bus bandwidth per device of a collective over that group: inter-node (RoCE) once it leaves a node."""
    return spec.inter_node_bytes_per_s if spans_nodes(recipe, size, stride) else spec.intra_node_bytes_per_s
