"""A cost is what its fix takes off the step on the step's bound (auditor.findings.saving_on_path),
and fixes together save the step before less the step after all of them (together_ms). Figures
below are the recorded traces' clocks (test_recoverable reads them from the traces themselves):
the V100 ResNet's host-bound 176.27 ms step with 98.0 ms of GPU work, the A100 rank's device-bound
375.13 ms step against 216.12 ms on the host."""
from __future__ import annotations

import pytest

from auditor.findings import DEVICE, HOST, STEP, saving_on_path, together_ms

RESNET = dict(bound="host", host_ms=176.273, device_ms=118.612, device_busy_ms=97.997)
RANK0 = dict(bound="device", host_ms=216.119, device_ms=375.129, device_busy_ms=76.286)


def test_a_host_bound_step_counts_host_savings_up_to_the_step_less_the_devices_work() -> None:
    assert saving_on_path(69.81, HOST, **RESNET) == pytest.approx(69.81)
    assert saving_on_path(120.0, HOST, **RESNET) == pytest.approx(176.273 - 97.997)
    # a device-side saving: as measured only where no trace says what the host waits for; else at
    # most the device's work inside the host's syncs (faster kernels shorten nothing else)
    assert saving_on_path(55.55, DEVICE, **RESNET) == 55.55
    assert saving_on_path(55.55, DEVICE, **RESNET, waited_ms=0.08) == pytest.approx(0.08)
    assert saving_on_path(55.55, DEVICE, **RESNET, waited_ms=0.0) == 0.0
    assert saving_on_path(5.0, DEVICE, **RESNET, waited_ms=30.0) == 5.0


def test_a_device_bound_step_counts_host_savings_only_past_the_devices_time() -> None:
    assert saving_on_path(0.86, HOST, **RANK0) == 0.0
    assert saving_on_path(32.4, DEVICE, **RANK0) == pytest.approx(32.4)
    assert saving_on_path(200.0, DEVICE, **RANK0) == pytest.approx(375.129 - 216.119)
    assert saving_on_path(5.0, STEP, **RANK0) == 5.0  # (a whole-step cost is the step's own time)


def test_no_device_clock_keeps_the_saving_as_measured() -> None:
    assert saving_on_path(12.5, HOST, None, 40.0, None, None) == 12.5
    assert together_ms(30.0, 0.0, 20.0, 40.0, None, 40.0, None, None) == 40.0  # (at most the step)


def test_fixes_together_are_neither_their_sum_nor_the_largest() -> None:
    # ResNet: dataloader-bound 69.81 + launch-bound 6.91 + pageable-copy 1.915 of host time would
    # take the host below the GPU's 98.0 ms of work: together they save the step less that work
    got = together_ms(69.81 + 6.91 + 1.915, 0.0, 0.0, 176.273, **RESNET)
    assert got == pytest.approx(176.273 - 97.997)
    assert together_ms(10.0, 0.0, 0.0, 176.273, **RESNET) == pytest.approx(10.0)
    # the A100 rank: host savings save nothing until the device is faster; 32.4 ms of device time does
    assert together_ms(0.86, 32.4, 0.0, 375.129, **RANK0) == pytest.approx(32.4)
    # past the host's time the host is the step again
    assert together_ms(0.0, 200.0, 0.0, 375.129, **RANK0) == pytest.approx(375.129 - 216.119)
    assert together_ms(100.0, 200.0, 0.0, 375.129, **RANK0) == pytest.approx(375.129 - 175.129)


def test_fixes_together_on_a_host_bound_step_take_device_savings_off_its_waits_only() -> None:
    # the ResNet's host waits 0.08 ms per step for the device: 10 ms of faster kernels and 20 ms of
    # host time save 20.08 ms, not 30
    got = together_ms(20.0, 10.0, 0.0, 176.273, **RESNET, waited_ms=0.08)
    assert got == pytest.approx(20.08)

