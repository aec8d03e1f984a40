"""What the DataLoader probe records about a loader when it is made: its settings, whether an
IterableDataset splits its stream between workers, and which parameters the call gave."""
from __future__ import annotations

from typing import Any, Callable

from auditor.capture.frames import is_library

DATALOADER_SETTINGS = ("batch_size", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                       "drop_last", "timeout")


def _shards_by_worker(dataset: Any, worker_init_fn: Any) -> bool:
    """Whether an IterableDataset splits its stream between workers: its `__iter__` asks
    `get_worker_info()`, or a `worker_init_fn` is given (where sharding is commonly set up).
    Without either, every worker yields the whole stream: num_workers=4 repeats each sample 4x,
    so workers are no fix to recommend blindly. Only the user's own classes are judged: a
    library's stream (webdataset, datasets) shards in code this cannot read, and is taken to."""
    if worker_init_fn is not None:
        return True
    import inspect

    try:
        file = inspect.getsourcefile(type(dataset))
        if not file or is_library(file):
            return True
        return "get_worker_info" in inspect.getsource(type(dataset).__iter__)
    except (OSError, TypeError):
        return True  # (no source to read: not claimed unsharded)


def _passed(init: Callable, self: Any, args: tuple, kwargs: dict) -> list[str] | None:
    """The parameters a DataLoader(...) call gave, by position, by name or through `**mapping`:
    a fix adding one of them as a keyword would make the call raise "got multiple values"."""
    import inspect

    try:
        bound = inspect.signature(init).bind_partial(self, *args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    return sorted(k for k in bound if k != "self")
