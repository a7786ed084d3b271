"""The main job, end to end: `graphshard train` launches its own ranks and reports."""

from __future__ import annotations

import re
import subprocess
import sys


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "graphshard", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_train_demo_compiled_shows_progress_loss_time_and_memory():
    # compiler=eager keeps the test fast: the graphshard passes run, Inductor is skipped
    proc = _run("train", "--nproc", "2", "--steps", "3", "--option", "compiler=eager",
                "--batch", "4", "--seq", "16")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert len(re.findall(r"step +\d+/3 +loss \d+\.\d+ +time", out)) == 3
    assert "params MiB" in out and "optimizer MiB" in out
    rows = re.findall(r"^\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    full = float(re.search(r"full model parameters: ([\d.]+) MiB", out).group(1))
    assert len(rows) == 2
    for _, params, grads, optim in rows:  # each rank holds half of params / grads, 2x for Adam
        assert abs(float(params) - full / 2) < 0.05 and abs(float(optim) - full) < 0.1


def test_train_rejects_bad_arguments():
    proc = _run("train", "--strategy", "zero9")
    assert proc.returncode != 0 and "invalid choice: 'zero9'" in proc.stderr
    proc = _run("train", "--option", "bucket_size=3")
    assert proc.returncode != 0 and "unknown graphshard option 'bucket_size'" in proc.stderr
    proc = _run("train", "--nproc", "3", "--batch", "8")
    assert proc.returncode != 0 and "--batch 8 must be divisible by --nproc 3" in proc.stderr


def test_train_demo_under_torchrun():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         "-m", "graphshard", "train", "--steps", "2", "--no-compile", "--batch", "4", "--seq", "8"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(re.findall(r"step +\d+/2 +loss", proc.stdout)) == 2  # rank 0 reports once
    assert "params MiB" in proc.stdout


def _free_port() -> int:
    from graphshard.launch import free_port

    return free_port()
