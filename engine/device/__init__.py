"""Device backends. Each registers a loader so its imports (CUDA, Gaudi) run only when chosen."""

from engine.device.base import Device, device_class, device_names, get_device, register_device


def _cpu():
    from engine.device.cpu import CpuDevice

    return CpuDevice


def _cuda():
    from engine.device.cuda import CudaDevice

    return CudaDevice


def _hpu():
    # Raises ImportError where the Gaudi software is absent; get_device('auto') then moves on.
    from engine.device.hpu import HpuDevice

    return HpuDevice


register_device("cpu", _cpu)
register_device("cuda", _cuda)
register_device("hpu", _hpu)

__all__ = ["Device", "device_class", "device_names", "get_device", "register_device"]
