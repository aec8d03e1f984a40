"""A progress bar on stderr fed by the child's evidence stream (rich), off when quiet or not a TTY."""
from __future__ import annotations

from typing import Any

from auditor.capture import wire


class StepProgress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> "StepProgress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]audit[/] {task.description}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(),
                                      console=Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("importing target", total=self.total)
        return self

    def on_record(self, record: wire.Record) -> None:
        if self._progress is None:
            return
        if isinstance(record, wire.Setup):
            self._progress.update(self._task, description="steps")
        elif isinstance(record, wire.Step):
            self._progress.update(self._task, completed=record.index + 1,
                                  description="profiled step" if record.profiled else "steps")

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
