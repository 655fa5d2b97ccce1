"""Global monitor: worker stats, SLO accounting, a memory or Redis store, Prometheus text and
the operator dashboard. It imports nothing else of ours; workers, the gateway and the
controller report to it."""

from monitor.config import MonitorConfig
from monitor.monitor import Monitor
from monitor.records import BatchRecord, BucketState, RequestRecord, WorkerStats, WorkerStatus
from monitor.store import MonitorStore
from monitor.stores import create_store, register_store

__all__ = [
    "BatchRecord",
    "BucketState",
    "Monitor",
    "MonitorConfig",
    "MonitorStore",
    "RequestRecord",
    "WorkerStats",
    "WorkerStatus",
    "create_store",
    "register_store",
]
