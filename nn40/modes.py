"""The modes: runs other than the experiments, each reading its ModeConfig and exiting,
registered in MODES by the flag that chooses it (--replot, --catalog, --validate,
--calibrate, --replay-distserve, --placement-search). A mode that saves writes its own file
into --out (print_and_save: validation.json, distserve_replay.json, placement_search.json;
--calibrate its profile and calibration.json), never a main run's results.json.
"""
import datetime
import math
import os
import platform

import numpy as np

from nn40.calibration import (
    CALIBRATED, CALIBRATE_FIELDS, calibrate, calibration_errors, leave_one_out,
    read_measured_run, replay_run, run_label)
from nn40.config import GPUS, MODELS
from nn40.disaggregated import distserve_runs, replay_distserve_runs, search_placements
from nn40.errors import UsageError, read_json
from nn40.experiment_c import catalog
from nn40.figures import draw_figures
from nn40.handoff import kv_link
from nn40.host import (
    dask_distributed, fit_lines, one_line, prepare_out_dir, to_json, write_atomic)
from nn40.pricing import DEFAULT_PROFILE
from nn40.profiles import engine_profile
from nn40.published import Published, validate
from nn40.tables import spec_table
from nn40.tables_c import catalog_table, distserve_table, placement_table, validation_tables
from nn40.text_ko import TEXT
from nn40.workload import read_engine_run


def replot(mode):
    """--replot: redraw from a saved results.json; no experiment runs, no device is touched."""
    results = read_json(mode.given)
    if not (isinstance(results, dict) and isinstance(results.get("environment"), dict)
            and isinstance(results.get("config"), dict)):
        raise UsageError(f"{mode.given}: not a results.json written by NN_40_serving.py")
    prepare_out_dir(mode.out)
    try:
        written, missing = draw_figures(results, mode.out, mode.dpi, mode.format, mode.jobs)
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise UsageError(f"{mode.given}: lacks a field the figures need ({e!r}); it may come "
                         "from another version of the script")
    print(fit_lines(f"redrew {', '.join(written) or 'nothing'} into {mode.out}"))
    for name, why in missing.items():
        print(f"could not draw {name}: {why}")
    return {"written": written, "missing": missing}


def run_validation(mode):
    """--validate: C's prices against the published rows; prints them, writes
    validation.json."""
    try:
        V = validate(mode.given, mode.calibration)
    except OSError as e:
        raise UsageError(f"cannot read {e.filename}: {e.strerror}")
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"{mode.given}: not a file of published rows ({one_line(e)}); its "
                         "columns: " + ", ".join(Published._fields[:-1]))
    if not V["rows"]:
        raise UsageError(f"{mode.given}: no row C can express")
    return print_and_save(mode, validation_tables(TEXT[mode.lang], V), {"validation": V})


CALIBRATION_COLUMNS = [("run_col", "run", "text"), ("metric_col", "metric", "text"),
                       ("cal_measured_col", "measured_ms", ",.1f"),
                       ("cal_start_col", "start_error", "spct"),
                       ("cal_fitted_col", "calibrated_ms", ",.1f"),
                       ("cal_error_col", "error", "spct"), ("cal_loo_col", "loo_error", "spct")]


def calibration_result(runs, start):
    """The fit on the runs, each run's p50s under the start and the fitted profile, and (for
    several runs) each left out. -> the results' "calibration" dictionary."""
    for run in runs:
        if replay_run(run, start) is None:
            raise UsageError(f"{run.path}: {run.model} on {run.tp} x {run.gpu}: the KV cache "
                             "cannot hold its longest request (give --kv-tokens)")
    profile, rms = calibrate(runs, start)
    before, after = calibration_errors(runs, start), calibration_errors(runs, profile)
    loo = leave_one_out(runs, start)
    rows = []
    for i, run in enumerate(runs):
        label = run_label(run)
        for k in ("ttft_s", "tpot_s", "e2e_s"):
            rows.append({"run": label, "metric": k, "fitted": k in CALIBRATED,
                         "measured_ms": 1e3 * run.measured[k]["p50"],
                         "start_error": before[i][1][k], "calibrated_ms": 1e3 * after[i][0][k],
                         "error": after[i][1][k],
                         "loo_error": loo[i][1][k] if loo and loo[i][1] else None})
    return {"profile": profile.fields(), "start": start.fields(), "rms_log_error": rms,
            "fields": list(CALIBRATE_FIELDS), "rows": rows,
            "runs": [{"path": r.path, "label": run_label(r), "kind": r.kind, "model": r.model,
                      "gpu": r.gpu, "tp": r.tp, "ep": r.ep, "replicas": r.replicas,
                      "slots": r.slots, "chunk_tokens": r.chunk_tokens, "kv_tokens": r.kv_tokens,
                      "requests": len(r.requests.output), "settings": r.settings,
                      "measured": r.measured} for r in runs]}


def calibration_text(T, C, path):
    p = C["profile"]
    rows = [{**r, "metric": T["metric_" + r["metric"]] + ("" if r["fitted"] else " *")}
            for r in C["rows"]]
    return "\n".join([T["calibration"].format(start=C["start"]["name"], n=len(C["runs"])),
                      spec_table(T, rows, CALIBRATION_COLUMNS),
                      T["calibration_fit"].format(
                          link=p["link_share"], a2a=p["all_to_all_share"],
                          step_ms=p["step_s"] * 1e3,
                          layer_us=p["layer_s"] * 1e6, bandwidth=p["bandwidth_share"],
                          matmul=p["matmul_share"], rms=math.expm1(C["rms_log_error"])),
                      T["calibration_wrote"].format(path=path)] +
                     cached_runs_text(T, [run["label"] for run in C["runs"]
                                          if run["settings"].get("prefix_caching") == "on"]))


def cached_runs_text(T, runs):
    """[A line naming the measured runs whose engine cached prefixes, which C replays without
    hits] (none: [])."""
    return [T["replay_cached"].format(runs=", ".join(runs))] if runs else []


def run_calibration(mode):
    """--calibrate RUN...: fit the engine profile on the runs, print the fit, write the
    profile (engine_profile.json, for --engine-profile) and calibration.json into --out."""
    runs = [read_measured_run(path, mode.settings) for path in mode.given]
    cards = sorted({r.gpu for r in runs})
    if len(cards) > 1:
        raise UsageError(f"a profile is one engine's on one card: the runs are on "
                         f"{', '.join(cards)}; calibrate each apart")
    start = engine_profile(mode.engine_profile or "vllm")
    C = calibration_result(runs, start)
    prepare_out_dir(mode.out)
    path = os.path.join(mode.out, "engine_profile.json")
    write_atomic(path, to_json({"profile": C["profile"], "card": cards[0],
                                "rms_log_error": C["rms_log_error"], "runs": C["runs"]}))
    write_atomic(os.path.join(mode.out, "calibration.json"), to_json({"calibration": C}))
    print(fit_lines(calibration_text(TEXT[mode.lang], C, path)))
    return {"calibration": C, "profile_path": path}


def print_and_save(mode, table, results):
    """A mode that exits after its table (--validate, --replay-distserve, ...): the table
    printed, its results written into --out under the mode's own name (its one results key:
    validation.json, distserve_replay.json, placement_search.json), so that no mode overwrites
    a main run's results.json in the same folder. -> results"""
    print(table)
    prepare_out_dir(mode.out)
    name = next(key for key in ("validation", "distserve_replay", "placement_search")
                if key in results)
    path = os.path.join(mode.out, f"{name}.json")
    write_atomic(path, to_json(results))
    print(TEXT[mode.lang]["wrote_json"].format(json=path))
    return results


def run_distserve_replay(mode):
    """--replay-distserve: DistServe's logs replayed; prints the table, writes
    distserve_replay.json."""
    if mode.cluster:
        dask_distributed()
    link = None
    if mode.link_flags:
        link = kv_link(MODELS["opt-13b"], GPUS["a100-80gb"], mode.link_name, mode.link_gbs,
                       mode.link_latency_us, mode.layerwise)
    R = replay_distserve_runs(mode.given, link, mode.pp_micro_batches, mode.jobs,
                              mode.cluster)
    return print_and_save(mode, distserve_table(TEXT[mode.lang], R), {"distserve_replay": R})


def run_placement_search(mode):
    """--placement-search: the placements ranked; prints them, writes placement_search.json."""
    if mode.cluster:
        dask_distributed()  # (refused before anything runs when Dask is not installed)
    if mode.link_flags:
        raise UsageError("--placement-search prices each placement on the card's own link: "
                         f"{', '.join(mode.link_flags)} apply to --replay-distserve")
    paths, profiles = distserve_runs(mode.given)
    lengths = [read_engine_run(p) for p in paths]
    lengths = (np.concatenate([r["prompt"] for r in lengths]),
               np.concatenate([r["output"] for r in lengths]))
    R = search_placements(profiles, lengths, mode.gpu_budget, seed=mode.seed,
                          workers=mode.jobs, cluster=mode.cluster)
    results = {"environment": {"date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "python": platform.python_version(), "numpy": np.__version__},
        "config": {"model": {"name": "opt-13b"}, "gpu_budget": mode.gpu_budget,
                   "seed": mode.seed}, "placement_search": R}
    print_and_save(mode, placement_table(TEXT[mode.lang], R), results)
    if mode.figures:  # (--replot on its results.json draws them again)
        written, _ = draw_figures(results, mode.out, mode.dpi, mode.format, 1)
        print(fit_lines(TEXT[mode.lang]["wrote_json"].format(
            json=", ".join(os.path.join(mode.out, name) for name in written))))
    return results


def run_catalog(mode):
    """--catalog: every named model on every named card (the accounting alone) under
    --engine-profile's rules and prices (else the default profile's), at --kv-fraction where
    given; prints it."""
    results = {"catalog": catalog(profile_name=mode.engine_profile or DEFAULT_PROFILE,
                                  kv_fraction=mode.kv_fraction)}
    print(fit_lines(catalog_table(TEXT[mode.lang], results["catalog"])))
    return results


MODES = {"replot": replot, "catalog": run_catalog, "validate": run_validation,
         "calibrate": run_calibration, "replay_distserve": run_distserve_replay,
         "placement_search": run_placement_search}  # ModeConfig.name -> the mode
