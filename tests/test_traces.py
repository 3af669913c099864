"""Traces in the forms people have (nn40.traces): each read row by row into token counts and
arrival seconds, column names whatever their case and spaces, bad rows named, and each form
replayed by C with --rate trace."""
import json

import numpy as np
import pytest

from nn40.errors import UsageError
from nn40 import traces
from test_cli import expect_usage_error, run_main

FORMS = {  # file name: (its text, the prompts, the outputs, the arrival seconds)
    # BurstGPT (HPMLL/BurstGPT README's schema): seconds from the first day's midnight; a
    # failed request keeps 0 response tokens, left out
    "burstgpt.csv": ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n"
                     "45,GPT-4,1087,0,1087,API log\n"
                     "46.5,ChatGPT,100,20,120,Conversation log\n",
                     [472, 100], [18, 20], [0.0, 41.5]),
    # Azure's 2023 trace (AzurePublicDataset): seven digits of a second, no zone
    "azure2023.csv": ("TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                      "2023-11-16 18:15:46.6805900,374,44\r\n"
                      "2023-11-16 18:15:50.9951690,396,109\r\n",
                      [374, 396], [44, 109], [0.0, 4.314579]),
    # Azure's 2024 trace: a zone, and sometimes no fraction
    "azure2024.csv": ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                      "2024-05-12 00:00:00+00:00,1452,3\n"
                      "2024-05-12 00:00:00.041683+00:00,584,3\n",
                      [1452, 584], [3, 3], [0.0, 0.041683]),
    # Azure's columns with seconds for times, names in another case
    "azure_seconds.csv": ("timestamp, contexttokens, generated tokens\n0.0,120,40\n2.5,80,9\n",
                          [120, 80], [40, 9], [0.0, 2.5]),
    # Mooncake's JSONL without hash_ids (timestamps in ms): no prefix sharing
    "mooncake.jsonl": ('{"timestamp": 0, "input_length": 6758, "output_length": 500}\n\n'
                       '{"timestamp": 3052, "input_length": 7236, "output_length": 794}\n',
                       [6758, 7236], [500, 794], [0.0, 3.052]),
    # Vidur's and Splitwise's columns
    "vidur.csv": ("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.3,396,109\n",
                  [374, 396], [44, 109], [0.0, 4.3]),
    # plain names, in --help
    "plain.csv": ("Arrival S,Prompt Tokens,Output Tokens\n0,100,20\n0.5,200,30\n",
                  [100, 200], [20, 30], [0.0, 0.5]),
}

# vLLM's benchmark result with --save-detailed (vllm/benchmarks/serve.py): requests by their
# start on the client's clock
BENCH = {"backend": "vllm", "input_lens": [100, 200, 300], "output_lens": [20, 30, 40],
         "ttfts": [0.03, 0.03, 0.04], "start_times": [1000.1, 1001.4, 1000.62]}


@pytest.mark.parametrize("name", FORMS)
def test_each_form_reads_its_counts_and_seconds(name, tmp_path):
    text, prompt, output, arrival = FORMS[name]
    path = tmp_path / name
    path.write_text(text, encoding="utf-8", newline="")
    trace = traces.read_named_trace(str(path))
    assert trace.prompt.tolist() == prompt and trace.output.tolist() == output
    np.testing.assert_allclose(trace.arrival_s, arrival, atol=1e-6)
    assert trace.failed == (1 if name == "burstgpt.csv" else 0)


def test_vllms_benchmark_json_reads_its_requests_by_their_start(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    trace = traces.read_named_trace(str(path))
    assert trace.prompt.tolist() == [100, 300, 200] and trace.output.tolist() == [20, 40, 30]
    np.testing.assert_allclose(trace.arrival_s, [0.0, 0.52, 1.3])
    path.write_text(json.dumps({k: v for k, v in BENCH.items() if k != "start_times"}))
    assert traces.read_named_trace(str(path)).arrival_s is None  # (lengths alone)


def test_a_bench_result_leaves_out_failed_requests_and_checks_its_lists(tmp_path):
    path = tmp_path / "bench.json"
    failed = {**BENCH, "output_lens": [20, 0, 40], "errors": ["", "timeout", ""]}
    path.write_text(json.dumps(failed))
    trace = traces.read_named_trace(str(path))
    assert trace.prompt.tolist() == [100, 300] and trace.failed == 1
    path.write_text(json.dumps({**BENCH, "output_lens": [20, 30]}))
    with pytest.raises(UsageError, match="input_lens 3, output_lens 2, start_times 3"):
        traces.read_named_trace(str(path))
    path.write_text(json.dumps({**BENCH, "output_lens": [20, True, 40]}))
    with pytest.raises(UsageError, match="request 1: the output.s tokens True"):
        traces.read_named_trace(str(path))


def test_unknown_columns_are_one_line_naming_them_and_every_accepted_set(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    path.write_text("when,question,answer\n0,10,5\n")
    with pytest.raises(UsageError) as e:
        traces.read_named_trace(str(path))
    message = str(e.value)
    assert "\n" not in message and "mine.csv:1" in message and "when, question, answer" in message
    for form in traces.TRACE_FORMATS:
        assert form.prompt in message and form.output in message
    assert "input_lens" in message
    expect_usage_error(["--experiments", "C", "--trace", str(path)], capsys, "mine.csv:1")


def test_every_bad_row_is_named_and_counted(tmp_path):
    path = tmp_path / "bad.csv"
    rows = ["1,10,5", "2,x,5", "3,10,0", "0.5,10,5", "4,10,-1", "5,1e30,5", "6,10,5"]
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    with pytest.raises(UsageError) as e:
        traces.read_named_trace(str(path))
    message = str(e.value)
    assert "line 3: " in message and "line 4: an output of 0 tokens" in message
    assert "line 5: a timestamp earlier than the row before" in message
    assert "and 2 more" in message and "\n" not in message  # (lines 6 and 7)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,5\n")
    with pytest.raises(UsageError, match="line 2: timestamp 'yesterday' is neither"):
        traces.read_named_trace(str(path))


def test_a_limit_keeps_the_first_requests(tmp_path):
    text = FORMS["plain.csv"][0]
    (tmp_path / "t.csv").write_text(text)
    assert traces.read_named_trace(str(tmp_path / "t.csv"), limit=1).prompt.tolist() == [100]


@pytest.mark.parametrize("name", ["burstgpt.csv", "azure_seconds.csv", "mooncake.jsonl",
                                  "bench.json"])
def test_each_form_replays_with_rate_trace(name, tmp_path, capsys):
    path = tmp_path / name
    if name == "bench.json":
        path.write_text(json.dumps(BENCH))
    else:
        path.write_text(FORMS[name][0], encoding="utf-8", newline="")
    results, out = run_main(["--experiments", "C", "--trace", str(path), "--rate", "trace",
                             "--no-figures", "--out", str(tmp_path / "out")], capsys)
    C = results["C"]
    assert C["requests"] == (3 if name == "bench.json" else 2)
    assert C["schedulers"]["continuous"]["throughput_rps"] > 0
    if name == "mooncake.jsonl":
        assert "no hash ids, so no prompts share a prefix" in out.err
