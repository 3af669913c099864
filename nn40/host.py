"""Helpers: the console, the host's memory, atomic files, worker processes, the load beside
a run (Python and NumPy)

What every later module may call; imports only errors.
"""
import contextlib
import json
import math
import os
import sys
import tempfile
import textwrap
import time

import numpy as np

from nn40.errors import UsageError


def log(message):
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


OUTPUT_WIDTH = 100  # the widest line printed to stdout (tables split, prose wrapped to it)


def columns(line):
    """The columns a line takes in a terminal: Korean is two a character (wcwidth comes with
    tabulate[widechars]; without it, one a character)."""
    try:
        from wcwidth import wcswidth
    except ImportError:
        return len(line)
    return max(wcswidth(line), len(line))


def fit_lines(text, width=OUTPUT_WIDTH):
    """Every line of text at most `width` columns: a longer one wrapped at spaces, its
    continuation indented two past its own indent (tables arrive already split)."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()))
        out += textwrap.wrap(line, width, subsequent_indent=indent + "  ",
                             break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def log_labelled(label, message):
    log(f"{label}: {message}")


def one_line(error):
    """An exception as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def gib(n_bytes):
    return f"{n_bytes / 2**30:.2f} GiB"


def free_host_memory_bytes():
    """Available RAM: Linux's MemAvailable, Windows' GlobalMemoryStatusEx, else sysconf's
    available pages, else (macOS, which has no such count) all physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "win32":
        return windows_available_bytes()
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):
        try:
            return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            pass
    return math.inf


def windows_available_bytes():
    import ctypes

    class MemoryStatus(ctypes.Structure):  # MEMORYSTATUSEX
        _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong)] + [
            (name, ctypes.c_ulonglong) for name in ("total", "available", "total_page",
                                                    "available_page", "total_virtual",
                                                    "available_virtual", "extended")]
    status = MemoryStatus()
    status.length = ctypes.sizeof(status)
    try:
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
            return int(status.available)
    except (AttributeError, OSError):
        pass
    return math.inf


BUSY_SHARE = 0.25  # other processes using this share of the CPUs (or one whole CPU, where
# that is less: torch runs a thread a core, so one busy core slows every matmul) disturb a run


def cpu_clock(stat="/proc/stat"):
    """(wall s, this process's CPU s, the machine's busy and stolen CPU s) now; the last two
    from /proc/stat (Linux), None elsewhere. Two readings apart give the load beside the run
    (see load_between)."""
    wall, own = time.perf_counter(), sum(os.times()[:2])
    try:
        with open(stat, encoding="ascii") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return wall, own, None, None
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal (guest time is inside user's)
    busy_ticks = sum(ticks[i] for i in (0, 1, 2, 5, 6) if i < len(ticks))
    return wall, own, busy_ticks / hz, (ticks[7] / hz if len(ticks) > 7 else 0.0)


def load_between(start, end):
    """What the machine did beside this process between two cpu_clock readings: its CPUs'
    shares used by other processes and stolen by the hypervisor (None where unmeasured)."""
    wall = max(end[0] - start[0], 1e-9)
    load = {"wall_s": wall, "process_cpu_s": end[1] - start[1], "cpus": os.cpu_count(),
            "others_share": None, "steal_share": None}
    if start[2] is not None and end[2] is not None:
        machine = wall * (os.cpu_count() or 1)
        others = (end[2] - start[2]) - (end[1] - start[1])
        load.update(others_share=min(1.0, max(0.0, others / machine)),
                    steal_share=min(1.0, max(0.0, (end[3] - start[3]) / machine)))
    return load


def busy(load):
    """Whether other processes (or the hypervisor) took BUSY_SHARE of the machine's CPUs, or
    one whole CPU where that is less."""
    if load.get("others_share") is None:
        return False
    return load["others_share"] + load["steal_share"] > min(BUSY_SHARE, 1 / (load["cpus"] or 1))


def write_atomic(path, data, mode="w"):
    """Write a file whole or not at all: a temporary file beside it, then a rename."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if "b" not in mode else {})) as f:
            f.write(data)
        umask = os.umask(0)  # mkstemp makes the file private; give it a plain file's mode
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def to_json(results):
    def default(o):
        if isinstance(o, (np.integer,)):
            return int(o)
        if isinstance(o, (np.floating,)):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
        raise TypeError(type(o).__name__)
    return json.dumps(results, indent=1, ensure_ascii=False, default=default)


def run_parallel(calls, jobs, cluster=None):
    """[(function, args)] -> [function(*args)], in order; in up to `jobs` worker processes,
    or on a Dask cluster when one is named (see parallel_executor)."""
    with parallel_executor(min(jobs, len(calls)), cluster) as pool:
        futures = [pool.submit(fn, *args) for fn, args in calls]
        return [f.result() for f in futures]


class InlineExecutor:
    """An executor of no workers: each call made as it is submitted."""

    def submit(self, fn, *args):
        import concurrent.futures
        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future


@contextlib.contextmanager
def parallel_executor(jobs, cluster=None):
    """The one executor seam, a concurrent.futures executor: `jobs` worker processes (on Linux
    forked: they inherit the loaded module, no fresh torch import, and touch no device, which
    is what makes forking safe after CUDA has been used; none at one job); or, given
    `cluster`, a Dask cluster's (dask.distributed: a pure-Python wheel whose
    Client.get_executor() is this same interface; "local" starts a LocalCluster of `jobs`
    worker processes here, else a scheduler's address, whose workers need numpy, and this
    script on their path where it is imported rather than run)."""
    import concurrent.futures
    import multiprocessing
    if cluster is None:
        if jobs <= 1:
            yield InlineExecutor()
            return
        context = multiprocessing.get_context("fork" if sys.platform.startswith("linux")
                                              else None)
        with concurrent.futures.ProcessPoolExecutor(jobs, context) as pool:
            yield pool
        return
    distributed = dask_distributed()
    with contextlib.ExitStack() as stack:
        try:
            if cluster == "local":
                cluster = stack.enter_context(distributed.LocalCluster(
                    n_workers=jobs, threads_per_worker=1, processes=True,
                    dashboard_address=None))
            client = stack.enter_context(distributed.Client(cluster, timeout="20s"))
        except (OSError, TimeoutError, ValueError) as e:  # (ValueError: not an address)
            raise UsageError(f"--cluster {cluster}: no Dask scheduler answered ({one_line(e)})")
        yield client.get_executor()


def dask_distributed():
    """dask.distributed, or one line saying how to get it."""
    try:
        import distributed
    except ImportError:
        raise UsageError("--cluster runs on Dask, which is not installed: pip install "
                         "distributed (or leave --cluster out: worker processes)") from None
    return distributed


def prepare_out_dir(path):
    """Create OUT and prove it is writable before any experiment runs."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"cannot write to output directory {path}: {e.strerror}")
