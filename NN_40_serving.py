"""
NN_40_serving.py -- inference serving, measured.

The runnable companion to the post "Inference serving: throughput, latency and empty seats".
It measures, on your GPU (or your CPU), the post's three claims, then checks the simulation:

  A  decode batch sweep   a bigger decode batch barely lengthens anyone's wait, because a
                          decode step is bound by reading the weights, not by arithmetic
  B  prefill vs decode    the same device runs prefill near its arithmetic peak and decode
                          hundreds of times below it (arithmetic intensity ~ tokens per read)
  C  static vs continuous static batching leaves seats empty until a batch's longest request
                          ends; refilling a freed seat at once (continuous) fills them; in
                          seconds, with arrivals and tail latency, and against a KV-cache
                          memory budget (reserved vs paged)
  D  a real engine        both policies run for real on the model, the measured speedup set
                          beside the one C predicts

A, B and D run a real decoder-only transformer (random weights, nothing downloaded) with a
static KV cache; C is a pure Python/NumPy simulation that touches no torch device.

    python NN_40_serving.py                    # A-D; CUDA if present, else a CPU preset
    python NN_40_serving.py --experiments C    # the simulation alone
    python NN_40_serving.py --quick            # a smoke run of everything
    python NN_40_serving.py --help             # every flag

It prints a banner and one table per experiment, and writes OUT/results.json and the figures
(OUT defaults to ./figures).
"""

import contextlib
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import signal
import sys
import threading
from typing import NamedTuple

import numpy as np

from nn40.accounting import param_count, weight_bytes
from nn40.cli import build_parser, mode_config, run_config
from nn40.config import GPUS
from nn40.errors import UsageError
from nn40.experiment_c import run_batching_sim
from nn40.figures import FIGURES, FORMATS, draw_figures
from nn40.host import (
    cpu_clock, fit_lines, load_between, log, one_line, prepare_out_dir, to_json, write_atomic)
from nn40.kv import KVUnfit
from nn40.modes import MODES
from nn40.profiles import engine_profile
from nn40.runs import kv_setup, run_step_costs
from nn40.speculative_study import check_drafting_fits
from nn40.tables import ceilings_line, describe, dtype_probe_line, machine_warnings
from nn40.tables_c import format_tables
from nn40.text_ko import TEXT
from nn40.workload import Requests, make_requests
# (the device code, nn40.model to nn40.engine_check, loads torch: it is imported where A, B or
# D runs, so that experiment C and the modes run in a Python without torch)

# -----------------------------------------------------------------------------
# the run: main, the banner, the experiments in order, results.json and the figures


def main(argv=None):
    """Run the chosen experiments; print tables; write results.json and figures. -> results."""
    argv = sys.argv[1:] if argv is None else list(argv)
    tolerant_output()
    try:
        return _main(argv)
    except UsageError as e:
        print(f"NN_40_serving.py: error: {error_text(e)}", file=sys.stderr)
        raise SystemExit(2)


def error_text(error):
    """A UsageError as its line (a KV budget's in words: the pure code raises a description)."""
    if isinstance(error, KVUnfit):
        return f"the {error.policy} KV budget of a replica cannot hold every request: " + \
            describe(TEXT["en"], error.why)
    return str(error)


def tolerant_output():
    """Where the console's encoding is not UTF-8 (a Windows code page, output redirected to a
    file), a character it cannot encode (Korean, µ) prints as '?', never a traceback."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")
            except (ValueError, OSError):
                pass


def torch_version():
    """torch's version as its package records it (C alone never imports torch), or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(run, device, argv):
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": " ".join(["NN_40_serving.py"] + list(argv)),
           "python": platform.python_version(), "torch": torch_version(),
           "numpy": np.__version__}
    if device is not None:
        import torch
        from nn40.device import device_name
        env.update({"device": device_name(device), "device_type": device.type,
                    "cuda": torch.version.cuda if device.type == "cuda" else None,
                    "threads": torch.get_num_threads()})
    return env


def banner(results, T):
    env, cfg = results["environment"], results["config"]["model"]
    lines = [f"NN_40_serving  {env['date']}", T["command"].format(**env),
             f"python {env['python']}, torch {env['torch'] or 'not installed'}, "
             f"numpy {env['numpy']}"]
    if "device" in env:
        lines.append(T["device"].format(**env) + (T["cuda"] if env["cuda"] else
                                                  T["threads"]).format(**env))
    lines.append(T["model_post" if cfg.get("arch") == "post" else "model"].format(
        **{**cfg, "params": cfg["params"] / 1e6, "gib": cfg["weight_bytes"] / 2**30,
           "label": T["label_post"] if cfg["name"] == "post" else cfg["name"],
           "kv": T["kv_heads"].format(n=cfg["n_kv_heads"]) if cfg["n_kv_heads"] < cfg["heads"]
           else "", "mlp_text": T["mlp_" + cfg["mlp"]]}))
    if cfg.get("experts"):
        lines.append(T["experts_line"].format(**cfg, width=cfg["expert_ffn"] or cfg["ffn"]) +
                     (T["expert_skew"].format(**cfg) if cfg.get("expert_skew") else ""))
    if results["config"].get("preset"):
        lines.append(T["preset"].format(fields=", ".join(results["config"]["preset"])))
    if "dtype_probe" in env:
        lines.append(dtype_probe_line(T, env["dtype_probe"]))
    if "layout_probe" in env:
        probe = env["layout_probe"]
        lines.append(T["layout_probe" if probe["weight_first_rows"] else "layout_linear"].format(
            rows=probe["weight_first_rows"], counts="/".join(map(str, probe["rows"])),
            linear=" / ".join(f"{ms:.1f}" for ms in probe["linear_ms"]),
            first=" / ".join(f"{ms:.1f}" for ms in probe["weight_first_ms"])))
    if results["config"].get("gpu"):
        card = GPUS[results["config"]["gpu"]]
        profile = engine_profile(results["config"]["engine_profile"])
        lines.append(T["card"].format(name=card.name, bandwidth=card.bandwidth_gbs,
                                      tflops=card.tflops, memory=card.memory_gb,
                                      link=card.link, tp=results["config"]["tp"],
                                      profile=profile.name,
                                      bandwidth_share=profile.bandwidth_share,
                                      matmul_share=profile.matmul_share) +
                     (T["card_ep"].format(ep=results["config"]["ep"])
                      if results["config"].get("ep", 1) > 1 else ""))
    if env.get("device_type") == "cpu" and cfg["name"] != "post" and \
            cfg["weight_bytes"] > 2**30:
        lines.append(T["slow_cpu"].format(name=cfg["name"], gib=cfg["weight_bytes"] / 2**30))
    return fit_lines("\n".join(lines))


def _main(argv):
    args = build_parser().parse_args(argv)
    mode = mode_config(args, argv)
    if mode is not None:  # (a mode runs instead of the experiments, and exits)
        return MODES[mode.name](mode)
    run, device, inputs, probes = prepare_run(args)
    cfg = run.hardware.model
    results = {"environment": environment(run, device, argv),
               "config": {"model": {**dataclasses.asdict(cfg), "params": param_count(cfg),
                                    "weight_bytes": weight_bytes(cfg),
                                    "n_kv_heads": cfg.n_kv_heads, "ffn": cfg.ffn},
                          **{k: v for k, v in run.flat().items() if k != "model"}}}
    results["environment"].update(probes)
    print(banner(results, TEXT[run.output.lang]), flush=True)
    interrupted = run_experiments(run, device, results, inputs)
    finish_run(run, results, interrupted)
    return results


class Inputs(NamedTuple):
    """What the experiments read, made and checked before any of them runs."""
    requests: Requests = None  # C's requests
    kv_budgets: tuple = None   # C's KV budgets (see kv_setup)
    lengths: np.ndarray = None  # D's output lengths
    arrival: np.ndarray = None  # D's arrivals (None: all at once)


def prepare_run(args):
    """The run's config, device and inputs, each checked before anything long runs: C's
    input read once, D's requests against the positions, the model and D's cache against
    the device's memory. -> (run, device, Inputs, the probes run: {name: probe})"""
    run = run_config(args)
    if not run.hardware.device:  # C alone: no device, no torch
        requests = make_requests(run)
        kv = kv_setup(run, requests, None)
        check_drafting_fits(run, requests, kv[1])
        prepare_out_dir(run.output.out)
        return run, None, Inputs(requests, kv, None, None), {}
    import torch
    from nn40.device import (
        check_cuda_arch, check_memory, device_memory, with_probed_dtype, with_probed_layout)
    from nn40.engine_check import check_engine, engine_requests
    device = torch.device(run.hardware.device)
    if device.type == "cuda":
        check_cuda_arch(device)
    start = cpu_clock()
    run, dtype_probe = with_probed_dtype(run)
    run, layout_probe = with_probed_layout(run)
    probes = {k: v for k, v in (("dtype_probe", dtype_probe), ("layout_probe", layout_probe))
              if v}
    if probes:
        probes["load"] = {"probes": load_between(start, cpu_clock())}
    requests = kv = None
    if "C" in run.measurement.experiments:
        requests = make_requests(run)
        kv = kv_setup(run, requests, device_memory(device))
        check_drafting_fits(run, requests, kv[1])
    lengths, arrival = engine_requests(run) if "D" in run.measurement.experiments else (None, None)
    if lengths is not None:  # D's cache must hold the longest request
        check_engine(run, lengths)
    check_memory(run, device, lengths)  # the model (and D's cache) must fit, before allocating
    prepare_out_dir(run.output.out)
    return run, device, Inputs(requests, kv, lengths, arrival), probes


def run_experiments(run, device, results, inputs):
    """Every experiment in turn into results. A late failure keeps what finished and names
    itself in results["failed"]. -> whether Ctrl-C stopped them."""
    stage, benches = None, []
    try:
        with interrupt_on_sigterm(), device_context(device):
            for stage in run.measurement.experiments:
                start = cpu_clock()
                run_experiment(stage, run, device, results, benches, inputs)
                if stage in "ABD":  # (the timed ones: C times nothing)
                    results["environment"].setdefault("load", {})[stage] = load_between(
                        start, cpu_clock())
            remeasure_ceilings(run, device, results)
    except KeyboardInterrupt:
        results["interrupted"] = True
        return True
    except UsageError:
        raise
    except Exception as e:  # a late failure keeps what finished, and says so in one line
        results["failed"] = {"experiment": stage, "error": one_line(e)}
    return False


def device_context(device):
    """Where a device runs (A, B, D): torch's inference mode and the attention backends
    allowed (sdpa_policy); nothing where C runs alone."""
    stack = contextlib.ExitStack()
    if device is not None:
        import torch
        from nn40.device import sdpa_policy
        stack.enter_context(torch.inference_mode())
        stack.enter_context(sdpa_policy())
    return stack


@contextlib.contextmanager
def interrupt_on_sigterm():
    """SIGTERM (what `timeout` and job schedulers send) stops the block as Ctrl-C does, so a
    run stopped either way keeps what finished in results.json."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def finish_run(run, results, interrupted):
    """The tables, results.json and (unless interrupted) the figures; then the exit status:
    130 after Ctrl-C, 1 after a late failure (a figure's among them)."""
    T = TEXT[run.output.lang]
    results["machine_warnings"] = machine_warnings(results)
    print("\n" + format_tables(results, run.output.lang) + "\n", flush=True)
    json_path = os.path.join(run.output.out, "results.json")
    write_atomic(json_path, to_json(results))
    written = []
    if run.output.figures and not interrupted:
        try:
            written, missing = draw_figures(results, run.output.out, run.output.dpi,
                                            run.output.format, run.measurement.jobs)
            results["figures"] = {"written": written, "not_drawn": missing}
        except Exception as e:  # (a worker's too: a figure failed late, like an experiment)
            results["failed"] = {"experiment": "figures", "error": one_line(e)}
        write_atomic(json_path, to_json(results))
    older = tidy_figures(run.output.out, written)
    if older:
        results["figures"] = {**results.get("figures", {}), "older": older}
        write_atomic(json_path, to_json(results))
    if written:
        print(fit_lines(T["wrote"].format(json=json_path, figures=", ".join(written))))
    else:
        print(T["wrote_json"].format(json=json_path))
    if older:
        print(fit_lines(T["older_figures"].format(figures=", ".join(older))))
    if interrupted:
        print(T["interrupted"], file=sys.stderr)
        raise SystemExit(130)
    if "failed" in results:
        failed = results["failed"]
        stage = "the" if failed["experiment"] == "figures" else "experiment"
        print(f"NN_40_serving.py: error: {stage} {failed['experiment']} failed "
              f"({failed['error']}); results.json keeps what finished before it",
              file=sys.stderr)
        raise SystemExit(1)


def tidy_figures(out_dir, written):
    """The figures in out_dir that this run did not draw (only the file names the script gives
    its figures, in either format). After a run that drew figures they are removed, so an
    output folder never mixes two runs; after one that drew none (--no-figures, Ctrl-C) they
    are kept, since nothing replaces them. -> the names of those kept, older than results.json."""
    stale = [path for name in FIGURES
             for path in (os.path.join(out_dir, name.replace(".png", "." + f)) for f in FORMATS)
             if os.path.basename(path) not in written and os.path.isfile(path)]
    if not written:
        return [os.path.basename(path) for path in stale]
    for path in stale:
        os.remove(path)
    return []


def run_experiment(name, run, device, results, benches, inputs):
    """One experiment into results. benches: [the model on its device, a Bench], built by the
    first experiment that needs it and kept for the next."""
    if device is not None:
        from nn40.engine_check import run_serving_engine
        from nn40.experiment_ab import (
            Bench, kv_device_check, measure_ceilings, run_decode_sweep, run_prefill_decode)
    if not benches and (name in "ABD" or (device and inputs.kv_budgets)):
        benches.append(Bench(run, device))
    bench = benches[0] if benches else None
    if name in "AB" and "ceilings" not in results["environment"]:
        ceilings = measure_ceilings(run, device, log)
        results["environment"]["ceilings"] = ceilings
        print(ceilings_line(TEXT[run.output.lang], ceilings, run.hardware.device), flush=True)
    ceilings = results["environment"].get("ceilings")
    if name == "A":
        results["A"] = run_decode_sweep(bench, ceilings, log)
    elif name == "B":
        results["B"] = run_prefill_decode(bench, ceilings, log)
    elif name == "C":
        results["C"] = run_batching_sim(run, inputs.requests, log,
                                        run_step_costs(run.hardware, results), inputs.kv_budgets)
        if device and "peak" in results["C"].get("kv", {}):  # the budget is real
            results["C"]["kv"]["device_check"] = kv_device_check(bench, results["C"]["kv"])
    elif name == "D":
        before = measure_ceilings(run, device, log)
        results["D"] = run_serving_engine(bench, inputs.lengths, inputs.arrival, log)
        results["D"]["machine"] = {"before": before, "after": measure_ceilings(run, device, log)}


def remeasure_ceilings(run, device, results):
    """The ceilings measured again at the end of the run (after D, D's own): a busy machine's
    speed moves, and A's, B's and D's numbers with it (see machine_warnings)."""
    env = results["environment"]
    if "ceilings" in env and not (run.hardware.peak_bandwidth_gbs and run.hardware.peak_tflops):
        from nn40.experiment_ab import measure_ceilings
        after = results.get("D", {}).get("machine", {}).get("after")
        env["ceilings_end"] = after or measure_ceilings(run, device, log)


if __name__ == "__main__":
    main()
