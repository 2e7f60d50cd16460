"""Facts of the GPU the kernels run on, asked of the device itself.

The split plans (``metal.paged_plan``, ``metal.cuda.ragged_decode``) aim at a few blocks per
streaming multiprocessor, so they need the device's multiprocessor count. MLX's CUDA
``device_info()`` does not report it (name, architecture, compute capability, memory), so it is
asked of the CUDA driver: ``libcuda.so.1`` through ``ctypes``, once, at the first plan that needs it.
Where no CUDA driver or device answers (Apple GPUs, CPUs) the plans use ``SMS_WITHOUT_CUDA``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import lru_cache

log = logging.getLogger(__name__)
CUDA_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
# where no CUDA driver answers (Apple GPUs: the Metal twin shares the CUDA plan; CPU tests pass their own count):
# the H200's count, the machine the plans' constants were measured on
SMS_WITHOUT_CUDA = 132


def query_multiprocessor_count(load: Callable[[str], object] = ctypes.CDLL, device: int = 0) -> int | None:
    """The multiprocessor count of CUDA device ``device`` through the driver API (``cuInit(0)``,
    ``cuDeviceGet``, ``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)``), or None
    where the driver library does not load or any call fails (no driver, no device). ``load``
    opens a shared library by name (``ctypes.CDLL``; tests pass a stand-in). Never raises."""
    try:
        lib = load("libcuda.so.1")
        handle, count = ctypes.c_int(0), ctypes.c_int(0)
        if lib.cuInit(0) != CUDA_SUCCESS or lib.cuDeviceGet(ctypes.byref(handle), device) != CUDA_SUCCESS:
            return None
        if lib.cuDeviceGetAttribute(ctypes.byref(count), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                    handle) != CUDA_SUCCESS:
            return None
    except (OSError, AttributeError) as exc:  # no libcuda here, or one without these symbols
        log.debug("no CUDA driver answers (%s)", exc)
        return None
    return count.value if count.value > 0 else None


@lru_cache(maxsize=1)
def multiprocessor_count() -> int | None:
    """CUDA device 0's multiprocessor count, asked of the driver once a process (None: no CUDA)."""
    return query_multiprocessor_count()


def planning_sms(num_sms: int | None = None) -> int:
    """The multiprocessor count a split plan aims at: ``num_sms`` where given, else the device's,
    else ``SMS_WITHOUT_CUDA``."""
    if num_sms is not None:
        return num_sms
    return multiprocessor_count() or SMS_WITHOUT_CUDA
