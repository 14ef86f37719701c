"""The suite keeps its own SPARK_HOME (tests/conftest.py): what its runs measure on a loaded machine
(CPU, disk and device calibrations, which `spark plan --predict-for` and the RAM tier read) never
lands in the user's, while the builds and downloads are the user's, built once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import SHARED_HOME_FOLDERS, SUITE_SPARK_HOME, USER_SPARK_HOME

from spark_cli.files.paths import models_dir, spark_home


def test_spark_home_is_the_suites_own_and_shares_the_builds() -> None:
    assert spark_home() == SUITE_SPARK_HOME != USER_SPARK_HOME
    for name in SHARED_HOME_FOLDERS:
        assert (SUITE_SPARK_HOME / name).resolve() == (USER_SPARK_HOME / name).resolve()
    assert models_dir().resolve() == (USER_SPARK_HOME / "models").resolve()


def test_a_spark_subprocess_keeps_its_calibration_in_the_suites_home() -> None:
    """What a `spark` run writes under calibration/ (here through the same helper bench uses) goes to
    the suite's home, which the user's never sees."""
    user_before = sorted((USER_SPARK_HOME / "calibration").glob("*")) \
        if (USER_SPARK_HOME / "calibration").is_dir() else []
    code = ("from spark_cli.files.paths import spark_home; from spark_cli.runs import miss_path as mp; "
            "p = mp.cache_file(spark_home(), 'probe', 'suite-home', 1); "
            "mp.save(p, mp.Calibration('probe', 'suite-home', {}, 1)); print(p)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=os.environ.copy()).stdout.strip()
    assert Path(out).parent.parent == SUITE_SPARK_HOME
    user_after = sorted((USER_SPARK_HOME / "calibration").glob("*")) \
        if (USER_SPARK_HOME / "calibration").is_dir() else []
    assert user_after == user_before
