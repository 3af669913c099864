"""Speculative decoding by method: C's speedup (plain TPOT p50 over speculating) against the
concurrency for Llama-3.1-8B on one H100 under the vllm profile, 3 drafts a step, each method
at a published acceptance (nothing fitted):

- EAGLE-3: vLLM's own baseline on MT-Bench (0.7296, 0.5208, 0.3545 by position:
  tests/v1/spec_decode/test_acceptance_length.py);
- EAGLE and n-gram lookup on ShareGPT: SpecDecode-Bench's published traces (arXiv 2601.11580;
  SpecDecode-Bench/simulator @2fdccbd, data/llama3.1-8B/combined_sharegpt.jsonl), a 3-draft
  chain walked over each generated position's acc_len: EAGLE 0.6215, 0.3811, 0.2516; n-gram
  0.1602, 0.1283, 0.1065.

Requests of ShareGPT's mean lengths in those traces (355 prompt, 728 generated tokens), that
many in flight, all waiting at t=0, as a benchmark's clients keep them; the paged KV cache the
engine leaves beside each draft. C runs k + 1 tokens a decoder every verify step; vLLM's n-gram
lookup proposes nothing where it finds no match (vllm/v1/spec_decode/ngram_proposer.py), so the
n-gram line is an upper bound on its cost where the batch is compute-bound. Prints the table
and writes the figure:

    python tests/speculation_methods.py [--out figures/speculation-methods/speculation_methods.png]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nn40.cli import parse_args  # noqa: E402
from nn40.config import GPUS  # noqa: E402
from nn40.figures import speedup_figure  # noqa: E402
from nn40.kv import KVBudget  # noqa: E402
from nn40.loop import simulate_serving  # noqa: E402
from nn40.pricing import ENGINE_PROFILES, card_costs, card_kv_tokens  # noqa: E402
from nn40.speculative_study import (  # noqa: E402
    run_speculation, speculating, speedup, summary)
from nn40.workload import Requests  # noqa: E402

METHODS = [("EAGLE-3 (vLLM's MT-Bench baseline)", "eagle3", (0.7296, 0.5208, 0.3545)),
           ("EAGLE (SpecDecode-Bench, ShareGPT)", "eagle", (0.6215, 0.3811, 0.2516)),
           ("n-gram (SpecDecode-Bench, ShareGPT; drafting every step)", "ngram",
            (0.1602, 0.1283, 0.1065))]
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PROMPT, OUTPUT = 355, 728


def replicas(method, rates, slots):
    """(plain, speculating) replicas of Llama-3.1-8B on one H100 under the vllm profile, `slots`
    seats and 8,192 tokens a step, its paged KV cache, the speculating one drafting by `method`
    with 3 drafts at the per-position `rates` (its cache what the engine leaves beside the
    draft)."""
    run = parse_args(["--experiments", "C", "--model", "llama-3.1-8b", "--gpu", "h100",
                      "--engine-profile", "vllm", "--speculative-config",
                      f'{{"method": "{method}", "num_speculative_tokens": 3}}',
                      "--acceptance-rates", ",".join(map(str, rates))])
    cfg, card, profile = run.hardware.model, GPUS["h100"], ENGINE_PROFILES["vllm"]
    kv = KVBudget("paged", card_kv_tokens(cfg, card, profile), 16)
    plain = profile.replica(card_costs(cfg, card, profile), slots=slots, chunk_tokens=8192,
                            kv=kv)
    return plain, speculating(plain, *run_speculation(run))


def waiting(n, prompt=PROMPT, output=OUTPUT):
    """n requests of `prompt` and `output` tokens, all waiting at t=0."""
    return Requests(np.zeros(n), np.full(n, prompt), np.full(n, output))


def speedups(method, rates):
    """C's speedup (speedup: TPOT p50, plain over speculating) at each concurrency of
    CONCURRENCY for one method and its acceptance."""
    out = []
    for c in CONCURRENCY:
        req = waiting(max(4 * c, 40))
        plain, spec = (summary(req, simulate_serving(req, r))
                       for r in replicas(method, rates, c))
        out.append(speedup(plain, spec))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="the figure's path (default: none drawn)")
    args = ap.parse_args()
    rows = {label: speedups(method, rates) for label, method, rates in METHODS}
    print("concurrency  " + "  ".join(f"{c:>6,}" for c in CONCURRENCY))
    for label, values in rows.items():
        print(f"{label}\n             " + "  ".join(f"{v:5.2f}x" for v in values))
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        fig = speedup_figure(CONCURRENCY, rows, "C: speculative decoding by method, 3 drafts a "
                             "step (Llama-3.1-8B, one H100, vllm profile)")
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
