"""The device facts (metal/device.py): the multiprocessor count asked of the CUDA driver through
ctypes, None wherever no driver or device answers, and the split plans' count from it."""

from __future__ import annotations

import ctypes

import mlx.core as mx

from metal import device
from metal.cuda.ragged_decode import plan_splits

HAS_CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()


class FakeDriver:
    """``libcuda.so.1``'s three calls: each returns ``codes[name]`` (0: CUDA_SUCCESS) and, on
    success, writes its answer through the pointer it was given, as the driver does."""

    def __init__(self, count: int = 114, **codes: int):
        self.count, self.codes, self.calls = count, codes, []

    def cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return self.codes.get("cuInit", 0)

    def cuDeviceGet(self, handle, ordinal):
        self.calls.append(("cuDeviceGet", ordinal))
        handle._obj.value = 7 + ordinal
        return self.codes.get("cuDeviceGet", 0)

    def cuDeviceGetAttribute(self, out, attribute, handle):
        self.calls.append(("cuDeviceGetAttribute", attribute, handle.value))
        if self.codes.get("cuDeviceGetAttribute", 0) == 0:
            out._obj.value = self.count
        return self.codes.get("cuDeviceGetAttribute", 0)


def test_the_count_is_the_driver_s_answer():
    driver = FakeDriver(count=114)
    loaded = []
    assert device.query_multiprocessor_count(lambda name: loaded.append(name) or driver) == 114
    assert loaded == ["libcuda.so.1"]
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 0), ("cuDeviceGetAttribute", 16, 7)]


def test_no_driver_or_no_device_gives_none():
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    assert device.query_multiprocessor_count(missing) is None
    assert device.query_multiprocessor_count(lambda name: FakeDriver(cuInit=100)) is None  # CUDA_ERROR_NO_DEVICE
    assert device.query_multiprocessor_count(lambda name: FakeDriver(cuDeviceGet=101)) is None  # invalid device
    assert device.query_multiprocessor_count(lambda name: FakeDriver(cuDeviceGetAttribute=1)) is None
    assert device.query_multiprocessor_count(lambda name: FakeDriver(count=0)) is None
    assert device.query_multiprocessor_count(lambda name: object()) is None  # a library without the symbols


def test_the_real_query_answers_cleanly_here():
    """On this machine: None without a CUDA driver (the CPU), a positive count on a CUDA GPU."""
    count = device.query_multiprocessor_count(ctypes.CDLL)
    if HAS_CUDA:
        assert isinstance(count, int) and count > 0
    else:
        assert count is None or count > 0  # a driver may be installed without MLX's CUDA backend


def test_plans_aim_at_the_given_count_else_the_device_s(monkeypatch):
    assert device.planning_sms(114) == 114
    monkeypatch.setattr(device, "multiprocessor_count", lambda: None)
    assert device.planning_sms() == device.SMS_WITHOUT_CUDA
    monkeypatch.setattr(device, "multiprocessor_count", lambda: 66)
    assert device.planning_sms() == 66
    # the ragged plan's split size follows the count: half the multiprocessors, splits twice as long
    lengths = [32768] * 16
    assert len(plan_splits(lengths, 8)) < len(plan_splits(lengths, 8, num_sms=132))
