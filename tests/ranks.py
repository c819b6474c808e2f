"""Running a worker script on several ranks under ``torch.distributed.run`` from a test.

The ranks run as a subprocess with a hard time limit, in a process group of their own that is
ended whatever happens: ``torch.distributed.run`` starts its workers in sessions of their own,
and a rank that waits in a collective for one that failed waits for the backend's timeout.
A worker is called as ``worker DIR RESULTS``: it reads its inputs from ``DIR`` and each rank
writes ``RESULTS/rank<N>.safetensors`` and ``RESULTS/rank<N>.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def run_ranks(
    worker: Path,
    directory: Path,
    ranks: int = 2,
    limit_s: int = 300,
    env: dict[str, str] | None = None,
    results: str = "results",
) -> list[tuple[dict[str, torch.Tensor], dict]]:
    """Each rank's tensors and report (from ``directory / results``); fails with the ranks'
    output if they did not finish."""
    out = directory / results
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(worker), str(directory), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        # ranks that registered faulthandler on SIGUSR1 print where they wait
        for pid in _pids(directory):
            _kill(pid, signal.SIGUSR1)
        time.sleep(5)
        _stop(proc, directory)
        output = proc.communicate(timeout=30)[0] + f"\n(stopped after {limit_s} s)"
    finally:
        _stop(proc, directory)
    if proc.returncode != 0:
        pytest.fail(f"the ranks failed (exit {proc.returncode}):\n{output[-12000:]}")
    return [(load_file(out / f"rank{r}.safetensors"), json.loads((out / f"rank{r}.json").read_text())) for r in range(ranks)]


def _stop(proc: subprocess.Popen, directory: Path) -> None:
    """End the launcher's process group and the ranks, which run in sessions of their own."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in _pids(directory):
        _kill(pid)
    proc.wait()


def _pids(directory: Path) -> list[int]:
    """The ranks (not their launcher): processes whose command line names ``directory``."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").exists() else []:
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            if entry.name.isdigit() and str(directory) in cmdline and "torch.distributed.run" not in cmdline:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
