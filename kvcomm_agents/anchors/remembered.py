"""A model's re-rotation measurements, remembered from one engine to the next.

Re-rotation is served where the gate would compute once its first-token KL against dense was
measured within the KL budget (:meth:`.tracker.OffsetTracker.rerotation_within_budget`). That
measure belongs to the model and its settings more than to a graph: it is pooled over every
receiver. An engine that starts without it computes its first graph's shared text once more only
to measure what an earlier engine on the same model already measured, and its first request runs
behind re-rotation only's (``docs/benchmarks.md``, "A restarted engine's first request").

So the engine writes the pooled samples, the last ``window`` of them, to
``<folder>/<fingerprint>-<settings digest>.json`` each time it records new ones, and reads them back when it
starts (:meth:`.tracker.OffsetTracker.remember`): pooled with every receiver's samples, never
one receiver's own, and kept measuring by audits as any sample is. A file is read only for the
same model fingerprint (weights, dtype, tokenizer) and the settings that shape what a check
measures (:data:`.persist.MEASURED_WITH`); a missing, unreadable or foreign file costs the
samples, never an error: it is a cache.

File: JSON ``{"format": FORMAT, "fingerprint", "library", "settings": {name: value for
MEASURED_WITH}, "rerotated": [kl, ...]}``: the remembered samples still held, then this
engine's receiver by receiver (finite ones only), written atomically. Engines writing one file
at once each write their own view (the last one stays); nothing is written inside
``freeze_anchors`` (reproducible runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import threading
from pathlib import Path
from typing import Optional

from .persist import MEASURED_WITH, measured_alike
from .tracker import OffsetTracker

__all__ = ["FORMAT", "MAX_FILES", "RememberedMeasurements", "default_folder", "measurements_folder", "remembered", "under_cache_dir"]

FORMAT = "kvcomm-measurements/1"
#: Measurement files a folder keeps, the least recently written going first beyond: weights
#: that change as a process runs (online fine-tuning) each get a file, and a cache must not grow
#: without end.
MAX_FILES = 64
logger = logging.getLogger("kvcomm_agents")
#: A measurement file's name (:attr:`RememberedMeasurements.path`): fingerprint, settings digest.
_FILE_NAME = re.compile(r"[0-9a-f]+-[0-9a-f]{8}\.json")


def default_folder(cache_dir: Optional[os.PathLike | str] = None) -> Path:
    """``measurements/`` under ``cache_dir``, else the cache directory (``$KVCOMM_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/kvcomm-agents`` or ``~/.cache/kvcomm-agents``)."""
    from ..embedded import default_cache_root

    return default_cache_root(cache_dir) / "measurements"


def under_cache_dir(config, cache_dir: Optional[os.PathLike | str]):
    """``config`` (a ``KVCommConfig`` or None) remembering under ``cache_dir`` where it
    remembers in the default folder and a ``cache_dir`` is given (``from_pretrained``)."""
    from ..config import KVCommConfig

    config = config or KVCommConfig()
    if cache_dir is None or config.remember_measurements is not True:
        return config
    return config.model_copy(update={"remember_measurements": str(default_folder(cache_dir))})


class RememberedMeasurements:
    """The file that carries one model's re-rotation samples between engines.

    Args:
        folder: where the files live (one per model fingerprint).
        fingerprint: the engine's model fingerprint.
        settings: the engine's settings as JSON (``KVCommConfig.model_dump(mode="json")``).
        tracker: the engine's tracker (read by :meth:`sync`, given the file's samples by
            :meth:`load`).
    """

    def __init__(self, folder: os.PathLike | str, fingerprint: str, settings: dict, tracker: OffsetTracker) -> None:
        self.folder, self.fingerprint = Path(folder), fingerprint
        self.settings = {name: settings[name] for name in MEASURED_WITH}
        self.tracker = tracker
        self._written = tracker.rerotation_recorded
        self._lock = threading.Lock()
        self._broken = False  # a folder that cannot be written: said once, then left alone

    @property
    def path(self) -> Path:
        """One file per model and measuring settings: engines of one model measuring alike share
        it, others never overwrite it."""
        digest = hashlib.sha1(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:8]
        return self.folder / f"{self.fingerprint}-{digest}.json"

    def load(self) -> int:
        """Give the tracker the file's samples; returns how many (0 where there is no file, or
        it is unreadable, of another model or measured with other settings)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, RecursionError) as error:  # RecursionError: JSON nested past the parser's depth
            logger.warning("remembered measurements %s unreadable (%s): measuring again", self.path, error)
            return 0
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("fingerprint") != self.fingerprint:
            return 0
        if not measured_alike(data, self.settings):
            logger.info("remembered measurements %s were taken with other settings: measuring again", self.path)
            return 0
        try:
            samples = OffsetTracker.parse_measurements({"rerotated": {"remembered": data["rerotated"]}}).rerotated
        except (KeyError, ValueError, TypeError, AttributeError) as error:
            logger.warning("remembered measurements %s malformed (%s): measuring again", self.path, error)
            return 0
        self.tracker.remember(samples["remembered"])
        return len(samples["remembered"])

    def sync(self, frozen: bool = False) -> bool:
        """Write the tracker's pooled samples where it recorded any since the last write;
        returns whether it wrote. ``frozen``: the anchors are frozen (nothing written)."""
        with self._lock:
            recorded = self.tracker.rerotation_recorded
            if recorded == self._written or self._broken or frozen:
                return False
            samples = [kl for kl in self.tracker.pooled_rerotation_samples() if math.isfinite(kl)][-self.tracker.window:]
            from .. import __version__

            data = {"format": FORMAT, "fingerprint": self.fingerprint, "library": __version__,
                    "settings": self.settings, "rerotated": samples}
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(data, allow_nan=False))
                os.replace(tmp, self.path)
            except OSError as error:
                self._broken = True
                logger.warning("cannot remember measurements in %s (%s): each engine measures again", self.folder, error)
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
                return False
            self._written = recorded
            _keep_newest(self.folder, MAX_FILES)
            return True


def _keep_newest(folder: Path, limit: int) -> None:
    """Delete all but the ``limit`` most recently written measurement files in ``folder`` (other
    files there, such as the weight layout's, are left alone); a file another process removes
    or writes meanwhile is skipped."""
    dated = []
    for path in folder.glob("*-*.json"):
        if _FILE_NAME.fullmatch(path.name):
            with contextlib.suppress(OSError):
                dated.append((path.stat().st_mtime, path))
    for _, path in sorted(dated, reverse=True)[limit:]:
        with contextlib.suppress(OSError):
            path.unlink()


def measurements_folder(config) -> Optional[Path]:
    """Where ``config`` (a ``KVCommConfig``) remembers what engines measured (re-rotation samples,
    the weight layout: :mod:`..engines.weight_layout`): the :func:`default_folder` for
    ``remember_measurements=True``, the folder it names, None where it is False."""
    if config.remember_measurements is False:
        return None
    return default_folder() if config.remember_measurements is True else Path(config.remember_measurements)


def remembered(config, fingerprint: str, tracker: OffsetTracker) -> Optional[RememberedMeasurements]:
    """The remembered measurements ``config`` (a ``KVCommConfig``) asks for, loaded into
    ``tracker``: ``remember_measurements`` True, the :func:`default_folder`; a folder, there;
    None where it is False or nothing trusts re-rotation on samples (another method, no KL
    budget, no audits, ``measured_rerotation=False``)."""
    folder = measurements_folder(config)
    if folder is None or not config.measures_rerotation:
        return None
    memory = RememberedMeasurements(folder, fingerprint, config.model_dump(mode="json"), tracker)
    memory.load()
    return memory
