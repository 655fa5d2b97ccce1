"""The prefill:decode split that ``serve --prefill-workers auto --decode-workers auto`` starts with.

The capacity simulator (``bucketserve simulate --target-rate R --save-split``, in ``bench/``) tries every split of
the workers on this machine's calibrated cost model and the given workload and SLOs, and keeps the best one here,
under ``$BUCKETSERVE_CACHE/splits/``, one file per model. ``serve`` reads that file; it never runs the simulator
itself (the product does not import the benchmarks), so starting stays fast and the choice is the one the
operator saw recommended.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"


@dataclass(frozen=True)
class WorkerSplit:
    """A recommended split and what it was recommended for."""

    model: str
    prefill_workers: int
    decode_workers: int
    target_rate: float  # req/s the split was chosen for
    workload: str
    slo_ttft_ms: float
    slo_tpot_ms: float
    attainment: float | None  # the simulated SLO attainment of the split at target_rate
    cost_model: str  # which calibration or projection the simulator ran on
    made_at: str  # ISO time

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"WorkerSplit.{name} must be an integer >= 1, got {value!r}")
        if not self.target_rate > 0:
            raise ValueError(f"WorkerSplit.target_rate must be > 0, got {self.target_rate!r}")

    def describe(self) -> str:
        att = "?" if self.attainment is None else f"{self.attainment:.0%}"
        return (
            f"{self.prefill_workers} prefill + {self.decode_workers} decode workers, recommended by the simulator "
            f"for {self.target_rate:g} req/s of {self.workload} (TTFT <= {self.slo_ttft_ms:g} ms, TPOT <= "
            f"{self.slo_tpot_ms:g} ms: {att} simulated attainment, cost model {self.cost_model}, {self.made_at})"
        )


def split_path(model: str, cache: Path | None = None) -> Path:
    """Where the split of ``model`` (a built-in name or a checkpoint folder) is kept."""
    if cache is None:
        from engine.model_builder import cache_root

        cache = cache_root()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name or "model")
    if name != model:  # a path: two checkpoints with the same folder name must not share a file
        name += "-" + hashlib.sha256(str(Path(model).expanduser().resolve()).encode()).hexdigest()[:10]
    return cache / "splits" / f"{name}.json"


def save_split(split: WorkerSplit, path: Path | None = None) -> Path:
    path = path or split_path(split.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(split), indent=2) + "\n")
    tmp.replace(path)  # a reader never sees half a file
    return path


def load_split(model: str, path: Path | None = None) -> WorkerSplit:
    """The split kept for ``model``; ValueError naming the command that makes one when there is none."""
    path = path or split_path(model)
    if not path.is_file():
        raise ValueError(
            f"--prefill-workers/--decode-workers auto: no split has been recommended for model {model!r} (none at "
            f"{path}); make one with `bucketserve simulate --model {model} --target-rate REQ_PER_S --cards "
            f"WORKERS --save-split`, or give the counts"
        )
    try:
        data = json.loads(path.read_text())
        fields = {f.name for f in dataclasses.fields(WorkerSplit)}
        return WorkerSplit(**{k: v for k, v in data.items() if k in fields})
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"--prefill-workers auto: the split file {path} is not valid ({e}); make it again"
        ) from None


def parse_worker_count(text: str | int) -> int | str:
    """A worker-count flag's value (a config file may give an integer): an integer or ``auto``. The range is the
    cluster config's to check, which names the flag as it does for every count."""
    text = str(text)
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer or 'auto', got {text!r}") from None


def resolve_counts(
    prefill: int | str, decode: int | str, model: str, mode: str, path: Path | None = None
) -> tuple[tuple[int, int], WorkerSplit | None]:
    """The prefill and decode worker counts to start, and the split they came from when ``auto``."""
    autos = [name for name, v in (("--prefill-workers", prefill), ("--decode-workers", decode)) if v == AUTO]
    if not autos:
        return (int(prefill), int(decode)), None
    if len(autos) == 1:
        other = "--decode-workers" if autos[0] == "--prefill-workers" else "--prefill-workers"
        raise ValueError(f"{autos[0]} auto needs {other} auto too: the split divides one number of workers")
    if mode != "disaggregated":
        return (1, 1), None  # colocated mode starts --colocated-workers; these counts are not used
    split = load_split(model, path)
    return (split.prefill_workers, split.decode_workers), split
