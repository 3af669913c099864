"""A practitioner's first answers as their engine gives them: the KV cache each engine's
memory rule leaves (checked on published start-up logs), the scheduler each engine profile
brings, one capacity answer, traces in the forms people have, and a summary that says what
its numbers say."""
import dataclasses
import json

import pytest

from nn40.accounting import weight_bytes
from nn40.capacity import capacity_choice
from nn40.cli import parse_args
from nn40.config import GPUS, MODELS
from nn40.pricing import ENGINE_PROFILES, ENGINE_RULES, card_kv_terms, card_kv_tokens
from nn40.runs import kv_setup
from nn40.tables import summary_text
from nn40.tables_c import capacity_answer, capacity_text, counted
from nn40.text_ko import TEXT
from nn40.workload import make_requests
from test_cli import expect_usage_error, run_main


def said(text, out):
    return " ".join(text.split()) in " ".join(out.split())


def kv_tokens(model, gpu, profile, tp=1, limits=None, fraction=None):
    p = ENGINE_PROFILES[profile]
    if fraction is not None:
        p = dataclasses.replace(p, kv_fraction=fraction)
    return card_kv_tokens(MODELS[model], GPUS[gpu], p, tp, 1, limits)


# Published start-up logs: (model, card, profile, tp, (max_num_seqs, max_num_batched_tokens),
# the engine's memory fraction, the KV tokens the engine logged). Checks, never fitted on.
LOGS = [
    # vLLM 0.19.0 on an H100 80GB, gpu_memory_utilization 0.95, defaults 1024 / 8192, no
    # connector, quantization or speculation: llm-d-incubation/llm-d-planner @d3121e05,
    # accuracy/results/v0.19.0/logs/meta-llama-llama-3-1-8b---h100-80gb--tp1pp1dp1--8192.log
    # ("Available KV cache memory: 58.11 GiB", "GPU KV cache size: 476,016 tokens")
    ("llama-3.1-8b", "h100", "vllm", 1, (1024, 8192), 0.95, 476_016),
    # the same set, tp2 and tp4 ("GPU KV cache size: 1,044,688 tokens", "2,209,792 tokens")
    ("llama-3.1-8b", "h100", "vllm", 2, (1024, 8192), 0.95, 1_044_688),
    ("llama-3.1-8b", "h100", "vllm", 4, (1024, 8192), 0.95, 2_209_792),
    # the same set, Qwen2.5-7B-Instruct, tp1 and tp2 (1,096,000 and 2,390,592 tokens)
    ("qwen2.5-7b", "h100", "vllm", 1, (1024, 8192), 0.95, 1_096_000),
    ("qwen2.5-7b", "h100", "vllm", 2, (1024, 8192), 0.95, 2_390_592),
    # vLLM 0.19.0 on an RTX 4090 at its defaults (0.9; 256 sequences, 2,048 tokens a step):
    # LLMServingSim's run (casys-kaist/LLMServingSim @5daddb21, RTX4090_Llama-3.1-8B_tp1's
    # meta.json: num_gpu_blocks 2,588 of 16 = 41,408 tokens)
    ("llama-3.1-8b", "rtx-4090", "vllm", 1, (256, 2048), None, 41_408),
    # SGLang's docs (docs.sglang.ai/start/send_request.html, build of 2025-01-23): Llama-3.1-8B
    # on an 80 GB card (78.81 GB free at start), mem_fraction_static 0.88: "KV Cache is
    # allocated. #tokens: 444500"
    ("llama-3.1-8b", "h100", "sglang", 1, None, 0.88, 444_500),
]


@pytest.mark.parametrize("model, gpu, profile, tp, limits, fraction, logged", LOGS)
def test_each_engines_rule_gives_the_kv_tokens_its_start_up_log_does(
        model, gpu, profile, tp, limits, fraction, logged):
    assert kv_tokens(model, gpu, profile, tp, limits, fraction) == pytest.approx(logged, rel=0.1)


def test_vllms_rule_by_hand():
    cfg, card = MODELS["llama-3-8b"], GPUS["rtx-4090"]
    terms = card_kv_terms(cfg, card, ENGINE_PROFILES["vllm"])
    assert terms["limits"] == [256, 2048]  # (vllm serve's on a card under 70 GiB)
    # activations at 2,048 tokens: the residual and its normed copy (2 x 4,096) beside the
    # gated MLP's 2 x 14,336 + 14,336, in bf16; the sampler's 256 rows of 128,256 float32
    # logits and probabilities
    activation = 2048 * (2 * 4096 + 3 * 14336) * 2 + 256 * 128256 * 4 * 2
    assert terms["activation"] == activation
    kv = 0.9 * card.memory_bytes - weight_bytes(cfg) - activation - 0.25 * 2**30
    assert terms["kv"] == pytest.approx(kv)
    assert terms["tokens"] == int(kv // 131_072) // 16 * 16
    assert 25_000 <= terms["tokens"] <= 50_000


def test_sglangs_defaults_by_hand():
    rules, P = ENGINE_RULES["sglang"], ENGINE_PROFILES["sglang"]
    # RTX 4090 (24,081 MiB): chunk 2,048, graphs to 24; reserve 512 + 1.5 x 2,048 + 2 x 24 +
    # 1,024 / 8 = 3,760 MiB
    assert rules.fraction(P, GPUS["rtx-4090"], 1) == round((24081 - 3760) / 24081, 3)
    # H100 (81,559 MiB): chunk 8,192, graphs to 256: 512 + 12,288 + 512 + 128 = 13,440 MiB
    assert rules.fraction(P, GPUS["h100"], 1) == round((81559 - 13440) / 81559, 3)
    assert [rules.chunk_and_graphs(GPUS[g], 1)[0] for g in ("rtx-4090", "h100", "b200")] \
        == [2048, 8192, 16384]


@pytest.mark.parametrize("gpu, limits", [("h100", (1024, 8192, "vllm_large")),
                                         ("rtx-4090", (256, 2048, "vllm_small")),
                                         ("a100-80gb", (256, 2048, "vllm_small"))])
def test_the_vllm_profile_brings_vllm_serves_scheduler(gpu, limits):
    run = parse_args(["--experiments", "C", "--model", "llama-3-8b", "--gpu", gpu,
                        "--engine-profile", "vllm"])
    sched = run.scheduler
    assert (sched.serve_slots, sched.serve_chunk_tokens, sched.serve_source) == limits
    assert (sched.slots, sched.chunk_tokens) == (32, 512)  # (the post's table keeps its own)
    flagged = parse_args(["--experiments", "C", "--model", "llama-3-8b", "--gpu", gpu,
                            "--engine-profile", "vllm", "--max-num-seqs", "64"])
    assert (flagged.scheduler.serve_slots, flagged.scheduler.serve_chunk_tokens,
            flagged.scheduler.serve_source) == (64, limits[1], limits[2] + "+flag")
    assert flagged.scheduler.slots == 64
    post = parse_args(["--experiments", "C"])
    assert (post.scheduler.serve_slots, post.scheduler.serve_chunk_tokens,
            post.scheduler.serve_source) == (32, 512, "post")


def test_the_kv_line_shows_each_term_and_a_short_card_says_what_fits(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--model", "llama-3-8b", "--gpu",
                             "rtx-4090", "--engine-profile", "vllm", "--requests", "200",
                             "--no-figures", "--out", str(tmp_path)], capsys)
    kv = results["C"]["kv"]
    assert 25_000 <= kv["budget_tokens"] <= 50_000
    for text in ("vLLM's rule on each of 1 x RTX 4090", "0.9 x 23.52 GiB", "14.96 GiB of "
                 "weights", "GiB of activations at 2,048 tokens a step and 256 sequences",
                 "0.25 GiB outside torch"):
        assert said(text, out.out), text
    # an 8B model in bf16 on a 16 GB RTX 5080: its 14.96 GiB of weights fit the card, not 0.9
    # of it (14.33 GiB)
    results, out = run_main(["--experiments", "C", "--model", "llama-3-8b", "--gpu",
                             "rtx-5080", "--engine-profile", "vllm", "--requests", "50",
                             "--no-figures", "--out", str(tmp_path)], capsys)
    why = results["C"]["kv"]["unfit"]["paged"]
    assert why["kind"] == "kv_short" and 0.6 < why["short_gib"] < 2
    assert why["would"] == "--weights fp8, --tp 2"  # (fp8 KV alone leaves it short)
    assert said("GiB a card short; it would fit with", out.out)


def test_a_memory_fraction_flag_needs_a_card_and_moves_the_cache(capsys):
    expect_usage_error(["--experiments", "C", "--gpu-memory-utilization", "0.8"], capsys,
                       "--kv-fraction prices a named card: give --gpu")
    for bad in ("0", "1.5"):
        expect_usage_error(["--experiments", "C", "--gpu", "h100", "--kv-fraction", bad],
                           capsys, "from 0.01 to 1")
    expect_usage_error(["--experiments", "C", "--gpu", "h100", "--kv-fraction", "0.8",
                        "--kv-tokens", "1000"], capsys, "give one or the other")
    # SGLang's default is the card's; a fraction given is taken as it is
    sglang = ENGINE_PROFILES["sglang"]
    assert sglang.kv_fraction is None and ENGINE_RULES["sglang"].fraction(
        dataclasses.replace(sglang, kv_fraction=0.5), GPUS["h100"], 1) == 0.5
    base = ["--experiments", "C", "--model", "llama-3-8b", "--gpu", "h100", "--engine-profile"]
    tokens = [kv_setup(run, make_requests(run), None)[0]["budget_tokens"] for run in (
        parse_args(base + ["vllm"]), parse_args(base + ["vllm", "--gpu-memory-utilization",
                                                           "0.8"]),
        parse_args(base + ["sglang", "--mem-fraction-static", "0.8"]))]
    assert tokens[1] < tokens[0] and tokens[2] < tokens[0]


def test_one_capacity_answer_the_fewest_replicas_then_the_most_met():
    cap = {"gpus_per_replica": 2, "routers": {
        "round-robin": {"replicas": 7, "attainment": 0.985},
        "least-requests": {"replicas": 7, "attainment": 1.0},
        "power-of-two": {"replicas": 8, "attainment": 1.0},
        "least-kv": {"replicas": None, "attainment": 0.5}}}
    assert capacity_choice(cap) == {"router": "least-requests", "replicas": 7, "gpus": 14,
                                      "tie": True}
    # round-robin met at the same count: a true tie, and the routers' order decides
    cap["routers"]["round-robin"]["attainment"] = 1.0
    assert capacity_choice(cap)["router"] == "round-robin"  # (a true tie: the routers' order)
    assert capacity_choice({"routers": {"round-robin": {"replicas": None}}}) is None


def test_both_answers_print_the_one_stored(capsys):
    # the routers tie at 7 replicas, round-robin meeting the SLO less often: both the answer
    # first and the one under the table name least-requests (each once picked its own)
    cap = {"slo_ttft_s": 0.5, "slo_tpot_s": 0.03, "attainment": 0.9, "target_rate": 200.0,
           "fleet_requests": 16000, "requests": 4000, "seeds": 5, "gpus_per_replica": 1,
           "kv_policy": "paged", "longest_output": 1327,
           "serving": {"slots": 32, "chunk_tokens": 512, "source": "flag"},
           "one_replica": {"rate_rps": 31.0, "rates_rps": [30.7, 31.2],
                           "output_tokens_per_s": 3223.0, "tried": [(31.0, 0.9)]},
           "routers": {"round-robin": {"replicas": 7, "attainment": 0.985, "below": 0.495},
                       "least-requests": {"replicas": 7, "attainment": 1.0, "below": 0.243}}}
    cap["answer"] = capacity_choice(cap)
    results = {"config": {"model": {"name": "llama-3-8b"}, "burstiness": 1.0,
                          "chunk_tokens": 512},
               "C": {"capacity": cap, "cost_model": {"source": {"kind": "pricing_card",
                                                               "card": "H100 SXM"}},
                     "prompt_tokens": {"p50": 128}, "output_tokens": {"p50": 70},
                     "source": "the post's law", "slots": 32}}
    T = TEXT["en"]
    top = " ".join(capacity_answer(T, results).split())
    bottom = " ".join(capacity_text(T, cap).split())
    assert "routed least-requests" in top and "with least-requests" in bottom
    assert "32 sequences a replica and 512 tokens a step (the flags')" in top


def test_the_answer_at_the_top_and_the_bottom_name_one_router(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--model", "llama-3-8b", "--gpu", "h100",
                             "--engine-profile", "vllm", "--requests", "300", "--rate", "50",
                             "--slo-ttft-ms", "500", "--slo-tpot-ms", "30", "--target-rate",
                             "150", "--rates", "50", "--no-figures", "--out", str(tmp_path)],
                            capsys)
    answer = results["C"]["capacity"]["answer"]
    text = " ".join(out.out.split())
    T = TEXT["en"]
    replicas = counted(T, answer["replicas"], "replica")
    top = text.split("answer: ")[1].split("assuming")[0]
    bottom = text.split("answer: ")[-1]
    assert f"need {replicas}" in top and f"routed {answer['router']} (" in top
    assert bottom.startswith(f"{replicas} (") and f"with {answer['router']}" in bottom
    assert said("1,024 sequences a replica and 8,192 tokens a step (vllm serve's defaults on "
                "a card of 70 GiB or more)", out.out)


def claims(batch8=6.0, prefill_bound="compute", speedup=3.9, d_measured=None):
    """A results dict holding just what the summary reads."""
    rows = [{"batch": 1, "context": 128, "mode": "eager", "bound": "memory",
             "throughput_vs_1": 1.0, "wait_vs_1": 1.0},
            {"batch": 8, "context": 128, "mode": "eager", "bound": "memory",
             "throughput_vs_1": batch8, "wait_vs_1": 8 / batch8}]
    B = [{"phase": "prefill", "tokens": 2048, "intensity": 50.0, "bound": prefill_bound,
          "tflops": 1.0}, {"phase": "decode", "batch": 1, "intensity": 1.0, "tflops": 0.01}]
    results = {"environment": {"ceilings": {"ridge_flop_per_byte": 80.0}},
               "A": {"rows": rows, "context": 128, "modes": ["eager"]}, "B": {"rows": B},
               "C": {"static": {"occupancy": 0.2}, "continuous": {"occupancy": 0.8},
                     "speedup": speedup}}
    if d_measured:
        results["D"] = {"verdict": {"measured": d_measured, "predicted": 1.5}}
    return " ".join(summary_text(TEXT["en"], results).split())


def test_the_summary_says_what_its_numbers_say():
    agreed = claims()
    assert "1. decode is bound by bytes" in agreed and "2. prefill is bound by arithmetic" \
        in agreed and "3. continuous batching fills the seats" in agreed
    assert "1. decode did not batch nearly free here, as the post has it: batch 8 decodes " \
        "1.6x batch 1's tokens/s for 5.00x its wait" in claims(batch8=1.6)
    assert "2. prefill was not bound by arithmetic here, as the post has it: 2,048 prompt " \
        "tokens at 50 FLOP/byte, under this machine's ridge of 80" in claims(
            prefill_bound="memory")
    assert "3. continuous batching was not ahead here" in claims(speedup=3.9, d_measured=0.9)
    assert "3. continuous batching was not ahead here" in claims(speedup=0.95)
    assert "연속 배칭이 앞서지 않았다" in summary_text(TEXT["ko"], {"C": {
        "static": {"occupancy": 0.2}, "continuous": {"occupancy": 0.8}, "speedup": 0.9}})
