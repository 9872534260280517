"""How many threads a worker computes with and how its idle OpenMP threads wait
(`raylm.executors.cpu_threads`): the arithmetic, and what GNU OpenMP itself reports it runs
with (OMP_DISPLAY_ENV) in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raylm.executors.cpu_threads import apply_openmp_defaults, user_thread_count, worker_thread_count

OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")


def openmp_report(code: str, **env: str) -> str:
    """What libgomp prints about itself when `code` runs in a fresh interpreter."""
    full_env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}
    full_env.update(OMP_DISPLAY_ENV="VERBOSE", **env)
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_importing_raylm_before_torch_makes_idle_openmp_threads_sleep():
    # libgomp's own default: spin 300,000 times before sleeping.
    assert "GOMP_SPINCOUNT = '300000'" in openmp_report("import torch")
    report = openmp_report("import raylm.engine, torch")
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in report and "GOMP_SPINCOUNT = '0'" in report


def test_a_wait_setting_of_the_user_is_kept():
    report = openmp_report("import raylm.engine, torch, os; assert 'OMP_WAIT_POLICY' not in os.environ",
                           GOMP_SPINCOUNT="1234")
    assert "GOMP_SPINCOUNT = '1234'" in report
    assert apply_openmp_defaults({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert apply_openmp_defaults({}) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_torch_loaded_first_is_reported_once_when_it_matters():
    code = ("import logging, torch; logging.basicConfig()\n"
            "from raylm.executors import cpu_threads as t\n"
            "t.apply_openmp_defaults(); t.warn_if_openmp_started_first(1); print('one thread: quiet')\n"
            "t.warn_if_openmp_started_first(2); t.warn_if_openmp_started_first(2)")
    report = openmp_report(code)
    assert report.count("torch was imported before raylm") == 1
    assert "torch was imported before raylm" not in openmp_report(code.replace("import logging, torch;",
                                                                            "import logging, raylm.engine, torch;"))


@pytest.mark.parametrize("cores, sharing, reserved, user, expected", [
    (16, 1, 0.5, None, 16),   # a fractional bundle (the default): every core of the machine
    (16, 2, 0.5, None, 8),    # two ranks on the machine split it
    (16, 3, None, None, 5),   # a GPU bundle, three ranks: 16 // 3
    (16, 1, 4.0, None, 4),    # a bundle of whole CPUs: that many
    (16, 1, 2.5, None, 2),    # rounded down
    (16, 4, 8.0, None, 4),    # never more than the worker's share of the machine
    (2, 4, 0.5, None, 1),     # more ranks than cores: one each
    (16, 1, 4.0, 3, 3),       # the user's OMP_NUM_THREADS wins
])
def test_worker_thread_count(cores, sharing, reserved, user, expected):
    assert worker_thread_count(cores, sharing, reserved, user) == expected


@pytest.mark.parametrize("value, expected", [("4", 4), (" 2 ", 2), ("0", None), ("two", None), (None, None)])
def test_only_a_positive_omp_num_threads_is_the_users_choice(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert user_thread_count() == expected
