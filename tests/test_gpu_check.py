"""The GPU reference run's script, checked on CPU: its plan (dry run) and its probe."""
import os
import re
import subprocess

import torch

import NN_40_serving as S
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
    assert total <= 540 and f"timeouts add up to {total} s" in log  # (the device's 600 s)
    outs = [re.search(r"--out (\S+)", cmd).group(1) for _, _, cmd in steps if "--out" in cmd]
    assert len(set(outs)) == 4  # each run into its own folder
    assert "--arch post --experiments AB" in log and "--quick" in log
    bring = re.search(r"^== bring back \(with the log, (\d+) files\): (.*)$", log, re.M)
    assert int(bring.group(1)) <= 8 == len(bring.group(2).split()) + 1
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.log", "work"]  # (nothing ran)


def test_the_probe_names_the_largest_32_bit_view_and_its_kernels():
    # the post's model on CUDA: batch 256 at 4,097 keys is past 2^31 elements; 128 is not
    assert gpu_probe.largest_view(S.MODELS["post"], (1, 8, 32, 128, 256),
                                  (128, 1024, 4096)) == (128, 4097)
    tiny = S.ModelConfig(layers=1, hidden=64, heads=4, kv_heads=2, vocab=97, dtype="float32")
    with torch.inference_mode():
        result = gpu_probe.probe(torch.device("cpu"), tiny, 4, 33)
    assert result["policy_kernels"] == ["_scaled_dot_product_flash_attention_for_cpu"]
    assert result["default_kernels"] and result["max_abs_vs_flash"] < 1e-5
