"""Progress bars, one rule for all of them: a live bar where someone can watch it redraw (a terminal, a notebook open
in JupyterLab), one summary line at the end where the output is saved as first drawn (a notebook executed by
papermill or nbconvert, whose saved widget would show its first frame, "0%", forever)."""
from __future__ import annotations

import io
import sys

from tqdm import std
from tqdm.auto import tqdm as live_bar


def live_display() -> bool:
    """False inside a Jupyter kernel whose requests come from an executor (nbclient, under papermill and
    `nbconvert --execute`, asks with stdin disallowed: no person at the frontend); True anywhere else."""
    try:
        from IPython import get_ipython
    except ImportError:
        return True
    kernel = getattr(get_ipython(), "kernel", None)
    return kernel is None or bool(getattr(kernel, "_allow_stdin", True))


class _Discard(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)


class SummaryBar(std.tqdm):
    """A tqdm that draws nothing while it runs and prints one line when it closes, "desc: N unit in T s" (N/total
    when it stopped short), with its last postfix; a bar made with leave=False prints nothing, as a live one would
    leave nothing behind."""

    def __init__(self, *args, **kwargs):
        kwargs["file"] = _Discard()
        kwargs.setdefault("mininterval", 3600.0)  # the frames go nowhere; format them rarely
        super().__init__(*args, **kwargs)

    def summary(self) -> str:
        n = self.n if self.total is None or self.n == self.total else f"{self.n}/{self.total}"
        line = f"{self.desc.rstrip(': ') or 'done'}: {n} {self.unit} in {self._time() - self.start_t:.1f} s"
        return f"{line} ({self.postfix})" if self.postfix else line

    def close(self) -> None:
        if self.disable:  # disabled, or closed already
            return super().close()
        line, leave = self.summary(), self.leave
        super().close()
        if leave:
            print(line, file=sys.stdout, flush=True)


def progress_bar(iterable=None, **kwargs) -> std.tqdm:
    """A progress bar over `iterable` (or updated by hand), with tqdm's arguments: the live one where it is watched,
    else a `SummaryBar` (see `live_display`)."""
    return (live_bar if live_display() else SummaryBar)(iterable, **kwargs)


def write_above_bars(message: str) -> None:
    """A line printed above any live bar instead of through it."""
    live_bar.write(message)
