"""Names as people write them, and calibration on the user's own runs (--calibrate)."""
import csv

import pytest

import NN_40_serving as S
from test_cli import run_main

# (spelling, kind, C's name): vendors' sheets, benchmark tables, Hugging Face ids
SPELLINGS = [
    ("NVIDIA GeForce RTX 4090", "card", "rtx-4090"), ("RTX4090", "card", "rtx-4090"),
    ("rtx 4090 24GB", "card", "rtx-4090"), ("H100 SXM5 80GB HBM3", "card", "h100"),
    ("NVIDIA H100 80GB HBM3", "card", "h100"), ("h100-sxm", "card", "h100"),
    ("H100", "card", "h100"), ("NVIDIA H100 PCIe Gen5", "card", "h100-pcie"),
    ("A100-SXM4-80GB", "card", "a100-80gb"), ("A100 80GB SXM", "card", "a100-80gb"),
    ("a100", "card", "a100-80gb"), ("A100-SXM4-40GB", "card", "a100-40gb"),
    ("A100-PCIE-80GB", "card", "a100-pcie-80gb"), ("NVIDIA L40S", "card", "l40s"),
    ("H200 141GB HBM3e", "card", "h200"), ("RTXPRO6000", "card", "rtx-pro-6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "card", "rtx-pro-6000"),
    ("meta-llama/Llama-3.1-8B-Instruct", "model", "llama-3.1-8b"),
    ("Meta-Llama-3.1-70B-Instruct", "model", "llama-3.1-70b"),
    ("llama 3.1 8b", "model", "llama-3.1-8b"), ("Llama3.1-8B", "model", "llama-3.1-8b"),
    ("meta-llama/Llama-3.3-70B-Instruct", "model", "llama-3.3-70b"),
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "model", "qwen3-30b-a3b"),
    ("Qwen/Qwen3-235B-A22B", "model", "qwen3-235b-a22b"),
    ("deepseek-ai/DeepSeek-R1", "model", "deepseek-r1"),
    ("deepseek-ai/DeepSeek-V3", "model", "deepseek-v3"),
    ("meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8", "model", "llama-4-maverick"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "model", "mistral-7b"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "model", "mixtral-8x7b"),
    ("EleutherAI/gpt-j-6b", "model", "gpt-j-6b"), ("facebook/opt-13b", "model", "opt-13b"),
]


@pytest.mark.parametrize("text, kind, name", SPELLINGS)
def test_a_name_as_people_write_it(text, kind, name):
    assert S.find_name(text, kind) == name


@pytest.mark.parametrize("kind", ["card", "model"])
def test_every_spelling_in_the_table_names_its_own_entry(kind):
    entries = S.GPUS if kind == "card" else S.MODELS
    assert set(S.NAME_ALIASES[kind]) <= set(entries)
    for name, entry in entries.items():
        for spelling in (name, entry.name) + S.NAME_ALIASES[kind].get(name, ()):
            assert S.find_name(spelling, kind) == name, spelling


@pytest.mark.parametrize("text, kind, near", [("H100 NVL", "card", "h100"),
                                              ("Llama-3.2-3B", "model", "llama-3.2-1b"),
                                              ("Falcon-180B", "model", None)])
def test_an_unknown_name_is_one_line_with_the_closest(text, kind, near, capsys):
    assert S.find_name(text, kind) is None
    flag = "--gpu" if kind == "card" else "--model"
    with pytest.raises(SystemExit) as e:
        S.main(["--experiments", "C", flag, text])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"unknown {kind} {text!r}" in err
    if near:
        assert "closest: " + near in err


def test_flags_take_names_as_people_write_them():
    run = S.parse_args(["--experiments", "C", "--model", "meta-llama/Llama-3.1-8B-Instruct",
                        "--gpu", "NVIDIA H100 SXM5 80GB"])
    assert run.model.name == "llama-3.1-8b" and run.gpu == "h100"


@pytest.mark.parametrize("name, total, active", [
    ("llama-3.3-70b", 70.6e9, 70.6e9),     # the model card: 70B (Llama-3.1-70B's shape)
    ("qwen3-235b-a22b", 235e9, 22e9),      # "235B in total and 22B activated"
    ("deepseek-r1", 671e9, 37e9),          # "671B total, 37B activated" (V3's config)
    ("llama-4-maverick", 400e9, 17e9)])    # "17B (activated), 400B (total)"
def test_the_new_presets_hold_their_published_parameter_counts(name, total, active):
    cfg = S.MODELS[name]
    assert S.param_count(cfg) == pytest.approx(total, rel=2e-3)
    assert S.active_param_count(cfg) == pytest.approx(active, rel=0.02)


# The same published rows in calibration.csv's columns, spelled as other tables spell them
COLUMNS = ["source_id", "model", "params_b", "gpu", "n_gpus", "tp", "engine_version",
           "weight_dtype", "kv_dtype", "batch_or_concurrency", "isl", "osl", "metric", "value",
           "unit", "notes"]
PLAIN = dict(source_id="trtllm_perf_v0.14.0", model="Llama-3.1-8B", params_b=8.03,
             gpu="H100 80GB HBM3", n_gpus=1, tp=1, engine_version="TensorRT-LLM v0.14.0",
             weight_dtype="fp8", kv_dtype="fp8", batch_or_concurrency="max-load", isl=128,
             osl=128, metric="output_tokens_per_s", value=27000, unit="tokens/s", notes="")
VARIED = [("Llama-3.1-8B", "H100 80GB HBM3"),
          ("meta-llama/Llama-3.1-8B-Instruct", "NVIDIA H100 SXM5 80GB"),
          ("Meta-Llama-3.1-8B", "H100-SXM"), ("llama 3.1 8b", "h100 sxm 80gb hbm3"),
          ("Llama3.1-8B-Instruct", "NVIDIA H100")]


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def test_validate_refuses_rows_for_missing_features_not_spelling(tmp_path, capsys):
    rows = [{**PLAIN, "model": m, "gpu": g} for m, g in VARIED]
    rows.append({**PLAIN, "source_id": "mlperf_x", "engine_version": "TensorRT-LLM 0.12",
                 "n_gpus": 8, "tp": 8, "model": "Llama-3.1-70B", "metric":
                 "output_tokens_per_s_per_gpu", "value": 3000})  # 24,000 for the group
    rows.append({**PLAIN, "metric": "requests_per_s", "value": 90})      # a metric C lacks
    rows.append({**PLAIN, "batch_or_concurrency": "server-slo"})         # an SLO-bound load
    rows.append({**PLAIN, "model": "Falcon-180B"})                       # a model C lacks
    path = tmp_path / "varied.csv"
    write_csv(path, rows)
    results, _ = run_main(["--validate", str(path), "--calibration", str(tmp_path / "none"),
                           "--out", str(tmp_path)], capsys)
    V = results["validation"]
    assert V["left_out"] == {"metric requests_per_s": 1, "batch server-slo": 1,
                             "model Falcon-180B": 1}
    got = V["rows"]
    assert [(r["model"], r["gpu"]) for r in got[:5]] == [("llama-3.1-8b", "h100")] * 5
    assert len({r["predicted"] for r in got[:5]}) == 1  # (each spelling, the same row)
    per_gpu = got[5]
    assert (per_gpu["model"], per_gpu["tp"], per_gpu["metric"], per_gpu["value"]) == \
        ("llama-3.1-70b", 8, "output_tokens_per_s", 24000)
