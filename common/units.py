"""Byte sizes as every message prints them: binary units, labelled as such, through one function.

npu-smi's HBM figures, MindSpore's max_device_memory and the planner count in 2**30 bytes; a size printed as
"GB" beside them would be 7% off or mislabelled, so every size reads GiB (MiB, KiB, B when smaller).
"""

KiB, MiB, GiB = 2 ** 10, 2 ** 20, 2 ** 30


def byte_size(n: float) -> str:
    """'341.23 GiB' from 1 GiB up, '1.9 MiB' from 1 MiB, '12.0 KiB' from 1 KiB, '8 B' below; a negative count keeps
    its sign."""
    size = abs(n)
    sign = "-" if n < 0 else ""
    if size >= GiB:
        return f"{sign}{size / GiB:,.2f} GiB"
    if size >= MiB:
        return f"{sign}{size / MiB:,.1f} MiB"
    if size >= KiB:
        return f"{sign}{size / KiB:,.1f} KiB"
    return f"{sign}{size:,.0f} B"
