"""The engine profiles' fit: where nn40.pricing.ENGINE_PROFILES' constants come from.

`python tests/fit_profiles.py` fits each calibrated engine's profile on its rows of the
published calibration file (../shared/published/calibration.csv beside the project) and on
nothing else, and prints the fitted fields beside the committed ones; test_published.py refits
them and checks that the committed values are what the fit finds.
"""
import dataclasses
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nn40.config import CALIBRATION_CSV, MODELS  # noqa: E402
from nn40.pricing import ENGINE_PROFILES, EngineProfile  # noqa: E402
from nn40.published import (  # noqa: E402
    PROFILE_GRID, coordinate_search, published_errors, read_published)

FIT_FIELDS = ("bandwidth_share", "matmul_share", "half_tokens", "step_s", "layer_s",
              "allreduce_s", "reserved_gb", "dequant_flops", "activation_passes")
# What each engine's rows can tell: gpt-fast's are all batch-1 decodes of one model, which
# see neither the FLOP rate, the memory reserve nor the activations' traffic apart from the
# weights' (fitting those too overfits its 6 rows: its validation rows' error trebles)
FITTED = {"tensorrt-llm": FIT_FIELDS,
          "gpt-fast": ("bandwidth_share", "layer_s", "allreduce_s", "dequant_flops")}
# Where each profile's fit starts (and what a field the rows cannot tell keeps)
FIT_START = EngineProfile("fit start", 0.9, 0.8)
FIT_GRID = PROFILE_GRID  # (the grid the project's own fit, --calibrate, searches)


def fit_loss(rows, profile):
    """Mean squared log error of a profile on rows (a row it cannot fit counts as 100% off)."""
    errors = [math.log(got / row.value) if got else math.log(2.0)
              for row, got, _ in published_errors(rows, {row.engine: profile for row in rows})]
    return float(np.mean(np.square(errors)))


def fit_rows(rows, engine):
    """The rows a profile is fitted on: its engine's calibration rows of dense models (the
    profiles were fitted before C priced experts; MoE rows are checked, not fitted)."""
    return [r for r in rows if r.role == "calibration" and r.engine == engine
            and not MODELS[r.model].experts]


def fit_start(profile):
    """Where a profile's fit starts: FIT_START's fields, the profile's batch limits."""
    return dataclasses.replace(profile, **{f: getattr(FIT_START, f) for f in FIT_FIELDS})


def fit_profile(rows, profile, fields=FIT_FIELDS, rounds=12):
    """The profile's FIT_FIELDS fitted to `rows` (calibration rows only: the caller's
    contract, checked by a test) by the project's coordinate search (coordinate_search,
    which --calibrate runs on a user's own runs): each field in turn takes the grid value of
    least fit_loss, until a round changes nothing. A field the rows cannot tell (the FLOP
    rate, from batch-1 rows) keeps its value."""
    profile, best, _ = coordinate_search(profile, lambda p: fit_loss(rows, p), fields, rounds)
    return profile, best


def refit(engine, calibration_rows):
    """-> (the fitted profile, its loss) of a committed engine profile, from the fit's start."""
    committed = ENGINE_PROFILES[engine]
    return fit_profile(fit_rows(calibration_rows, engine), fit_start(committed), FITTED[engine])


if __name__ == "__main__":
    cal, _ = read_published(CALIBRATION_CSV, "calibration")
    for engine in FITTED:
        fitted, loss = refit(engine, cal)
        print(f"{engine}: {len(fit_rows(cal, engine))} rows, loss {loss:.4g}")
        for field in FIT_FIELDS:
            print(f"  {field:18s} fitted {getattr(fitted, field):<12.6g} "
                  f"committed {getattr(ENGINE_PROFILES[engine], field):.6g}")
