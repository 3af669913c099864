"""The GPU reference run's script, checked on CPU: its plan (dry run) and its probe."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from nn40.config import MODELS, ModelConfig
import gpu_probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_check_plan_fits_one_call(tmp_path):
    done = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu_check.sh"), "--dry-run"],
                          env={**os.environ, "OUT": str(tmp_path),
                               "GPU_CHECK_WORK": str(tmp_path / "work")},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "gpu_check.log").read_text()
    assert log == done.stdout
    steps = re.findall(r"^== (\S+) \(timeout (\d+) s\): (.*)$", log, re.M)
    assert [name for name, _, _ in steps] == ["versions", "cuda-tests", "attention-probe",
                                              "quick", "default", "post-proxy", "moe"]
    total = sum(int(limit) for _, limit, _ in steps)
    limits = {name: int(limit) for name, limit, _ in steps}
    # the MoE step: one mode (graphs where its step can be captured), and the time its work
    # needs (near 30 s eager), taken from the default run's slack
    assert limits["moe"] >= 60 and limits["default"] == 200 and "--graphs on" in steps[-1][2]
    assert total <= 540 and f"timeouts add up to {total} s" in log  # (the device's 600 s)
    outs = [re.search(r"--out (\S+)", cmd).group(1) for _, _, cmd in steps if "--out" in cmd]
    assert len(set(outs)) == 4  # each run into its own folder
    assert "--arch post --experiments AB" in log and "--quick" in log
    bring = re.search(r"^== bring back \(with the log, (\d+) files\): (.*)$", log, re.M)
    assert int(bring.group(1)) <= 8 == len(bring.group(2).split()) + 1
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.log", "work"]  # (nothing ran)


STUB_PYTHON = r"""#!/bin/bash
out=""; prev=""
for a in "$@"; do [[ $prev == --out ]] && out=$a; prev=$a; done
[[ -z $out ]] && exit 0  # (the versions, the tests, the probe: done at once)
trap 'mkdir -p "$out"; echo "{\"interrupted\": true}" > "$out/results.json"; exit 130' TERM
sleep 30 > /dev/null 2>&1 &  # (started before the line the test waits for; holding no pipe)
echo "stub running $*"
wait
"""


def test_the_gpu_check_stopped_by_a_signal_brings_back_what_it_has(tmp_path):
    # a stand-in for python that, like NN_40_serving.py, writes results.json when sent SIGTERM;
    # the check's process group signalled during --quick: no later step runs, the quick
    # run's results.json comes back, the log says so
    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(tmp_path / "work"),
           "PYTHON": str(stub)}
    with subprocess.Popen(["bash", os.path.join(ROOT, "tests", "gpu_check.sh")], env=env,
                          stdout=subprocess.PIPE, text=True, start_new_session=True) as child:
        for line in child.stdout:
            if line.startswith("stub running") and "--quick" in line:
                os.killpg(child.pid, signal.SIGTERM)
                break
        rest, _ = child.communicate(timeout=30)
    assert child.returncode == 1
    log = (out / "gpu_check.log").read_text()
    assert "== quick: exit 130" in log and "== default: not run (interrupted)" in log
    assert "== moe: not run (interrupted)" in log and "stub running" not in rest
    assert json.loads((out / "quick_results.json").read_text()) == {"interrupted": True}


def test_the_probe_names_the_largest_32_bit_view_and_its_kernels():
    # the post's model on CUDA: batch 256 at 4,097 keys is past 2^31 elements; 128 is not
    assert gpu_probe.largest_view(MODELS["post"], (1, 8, 32, 128, 256),
                                  (128, 1024, 4096)) == (128, 4097)
    tiny = ModelConfig(layers=1, hidden=64, heads=4, kv_heads=2, vocab=97, dtype="float32")
    with torch.inference_mode():
        result = gpu_probe.probe(torch.device("cpu"), tiny, 4, 33)
    assert result["policy_kernels"] == ["_scaled_dot_product_flash_attention_for_cpu"]
    assert result["default_kernels"] and result["max_abs_vs_flash"] < 1e-5


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_run_keeps_what_finished_in_results_json(tmp_path, tiny_args, signum):
    # what `timeout` sends a step of the GPU check past its limit: the run stops as after Ctrl-C
    # and results.json comes back, saying so
    args = tiny_args + ["--experiments", "AC", "--reps", "100000", "--no-figures"]
    # (a shell that started the suite in the background left SIGINT ignored, and a child
    # inherits that: Ctrl-C's handler is the child's default, as at a terminal)
    with subprocess.Popen([sys.executable, os.path.join(ROOT, "NN_40_serving.py"), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) \
            as child:
        for line in child.stderr:  # (each A row takes its 2 s budget: stop it after the first)
            if "A context 8 eager batch 1:" in line:
                child.send_signal(signum)
                break
        out, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["interrupted"] is True and "C" not in saved
    assert "Traceback" not in err and "interrupted" in err
