"""Step costs: the seconds of one forward pass (pure NumPy)

A card's spec sheet under an engine's profile (EngineProfile: how near the engine gets to the
card's peaks, its fixed costs and its memory rules, ENGINE_RULES), a roofline of a run's
measured peaks, or a fit to passes timed by A and B or by D's engine. Calls the accounting.
"""
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from nn40.accounting import (
    attention_flops_per_key, card_kv_bytes_per_token, card_share, card_weight_bytes,
    dense_matmul_weights, ep_card_cost, kv_bytes_per_token, peak_activation_bytes, flops_and_bytes)
from nn40.config import KV_MEMORY_FRACTION
from nn40.replicas import Replica


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one forward pass: pass_s(tokens, kv_tokens, pairs) = f(tokens) + kv_s *
    kv_tokens + pair_s * pairs.

    f is piecewise linear through measured (or modelled) knots of tokens per pass, extended
    linearly beyond the last (flat if the last two knots fall); kv_s is the cost of reading
    one cached token's K and V: one value, or interpolated by tokens per pass between values
    measured at several batches (kv_by_batch: ((batch, seconds), ...)), since a small batch
    reads its cache less efficiently on some devices. pair_s prices a prompt's attention
    arithmetic: each (query, key) pair its prefill computes, the cached keys a chunk sees and
    its own up to each token (0 where f was timed on whole prompts, which include it).
    """
    tokens: tuple
    seconds: tuple
    kv_token_s: float
    source: object                # where the prices come from: a description (see describe)
    in_flight = 1                 # (one pass at a time: PassPrices)
    kv_by_batch: tuple = ()
    pair_s: float = 0.0
    # (f, kv_s) by tokens per pass: a simulation prices the same few shapes millions of times
    # (not an init field: dataclasses.replace must not carry one model's prices into another)
    _rates: dict = dataclasses.field(default_factory=dict, init=False, compare=False,
                                     repr=False)

    def rates(self, tokens):
        """(f(tokens) seconds, kv_s(tokens) seconds per cached token), memoized."""
        rates = self._rates.get(tokens)
        if rates is None:
            x, y = self.tokens, self.seconds
            if tokens > x[-1] and len(x) > 1:  # (never falling: noisy knots may)
                f = y[-1] + max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0) * (tokens - x[-1])
            else:
                f = float(np.interp(tokens, x, y))
            kv_s = self.kv_token_s
            if self.kv_by_batch:
                batches, seconds = zip(*self.kv_by_batch)
                kv_s = float(np.interp(tokens, batches, seconds))
            rates = self._rates[tokens] = (f, kv_s)
        return rates

    def kv_s(self, tokens):
        return self.rates(tokens)[1]

    def pass_s(self, tokens, kv_tokens=0, pairs=0):
        if tokens <= 0:
            return 0.0
        f, kv_s = self.rates(tokens)
        return f + kv_s * kv_tokens + self.pair_s * pairs

    def run_s(self, tokens, kv_tokens, steps, growth=None):
        """`steps` passes of `tokens` new tokens each (a decode of that many rows, or one
        prompt's chunk), the cache growing by `growth` tokens after every pass (None: by those
        tokens)."""
        growth = tokens if growth is None else growth
        return steps * self.pass_s(tokens, kv_tokens) + \
            self.kv_s(tokens) * growth * steps * (steps - 1) / 2

    def run_price(self, plan, decoders, cached, k, fused=False, growth=None):
        """The k steps of a run, a prefill pass (of the chunks in `plan`, [(Seq, tokens)]) and a
        decode pass (of `decoders` query tokens over `cached` tokens, their cache growing by
        `growth` a step: None, one a token) each (fused: one pass of both), whose caches grow:
        step j takes first_s + growth_s (j - 1) seconds. ->
        (prefill_s, decode_s: each pass summed over the run, first_s, growth_s, prompt tokens
        per step). (A plain tuple, as plan's: a NamedTuple made and unpacked at every event
        cost the loop 5-10%; a tuple subclass is built in Python and unpacked without 3.11's
        fast path.) A chunk of c tokens over x cached ones computes c x + c (c + 1) / 2
        attention pairs, c^2 more at each step of a run."""
        n, tokens, cached_pre = decoders, 0, 0
        grown = n if growth is None else growth
        for s, c in plan:
            tokens += c
            cached_pre += s.num_cached
        pair_first_s, pair_growth_s = self.pair_run_s(plan) if self.pair_s else (0.0, 0.0)
        known = self._rates.get  # (rates, memoized, without the call: read at every event)
        if fused and tokens and n:  # one pass of both: its time split by their tokens
            f, kv_s = known(tokens + n) or self.rates(tokens + n)
            first = f + kv_s * (cached_pre + cached) + pair_first_s
            growth = kv_s * (tokens + grown) + pair_growth_s
            run_s, share = first * k + growth * k * (k - 1) / 2, tokens / (tokens + n)
            return run_s * share, run_s * (1 - share), first, growth, tokens
        f_pre, kv_s_pre = known(tokens) or self.rates(tokens)
        f_dec, kv_s_dec = known(n) or self.rates(n)
        first_pre = f_pre + kv_s_pre * cached_pre + pair_first_s if tokens else 0.0
        first_dec = f_dec + kv_s_dec * cached if n else 0.0
        growth_pre, growth_dec = kv_s_pre * tokens + pair_growth_s, kv_s_dec * grown
        return (first_pre * k + growth_pre * k * (k - 1) / 2,
                first_dec * k + growth_dec * k * (k - 1) / 2,
                first_pre + first_dec, growth_pre + growth_dec, tokens)

    def pair_run_s(self, plan):
        """(seconds of the first step's prompt attention pairs, their growth a step), or
        nothing where the prices do not count pairs (prices timed on whole prompts)."""
        pair_s = self.pair_s
        if not pair_s:
            return 0.0, 0.0
        pairs = growth = 0
        for s, c in plan:
            pairs += c * s.num_cached + c * (c + 1) // 2
            growth += c * c
        return pair_s * pairs, pair_s * growth

    def decode_steps_to(self, n, cached, t, when, k, growth=None):
        """The first step count in 1..k whose decode run of n query tokens over `cached`
        tokens (growing by `growth` a step; None: by n), started at t, ends at or after
        `when` (else k)."""
        growth = n if growth is None else growth
        return steps_to(self.pass_s(n, cached), self.kv_s(n) * growth, t, when, k)

    def as_dict(self):
        """The model's numbers, for results.json."""
        return {"source": self.source, "tokens": list(self.tokens),
                "seconds": list(self.seconds), "kv_token_s": self.kv_token_s,
                "kv_by_batch": [list(p) for p in self.kv_by_batch], "pair_s": self.pair_s}


def analytic_costs(cfg, bandwidth_gbs, tflops):
    """Roofline pricing at a device's peaks (measured, given or the post's): each pass takes
    max(FLOPs / peak, bytes / bandwidth)."""
    knots = [2**i for i in range(15)]
    seconds = []
    for n in knots:
        cost = flops_and_bytes(cfg, n, 1, 0)
        seconds.append(max(cost["flops"] / (tflops * 1e12), cost["bytes"] / (bandwidth_gbs * 1e9)))
    source = {"kind": "pricing_analytic", "bandwidth_gbs": bandwidth_gbs, "tflops": tflops,
              "layers": cfg.layers, "hidden": cfg.hidden, "dtype": cfg.dtype}
    return StepCosts(tuple(knots), tuple(seconds), kv_bytes_per_token(cfg) / (bandwidth_gbs * 1e9),
                     source)


@dataclass(frozen=True)
class EngineProfile:
    """How close an engine comes to a card's spec sheet, and its batch limits.

    A pass of T tokens on one of tp cards (or one rank of an expert-parallel group) costs
        step_s + layers x layer_s
        + max(matmul FLOPs / (rate x matmul_share x T / (T + half_tokens)),
              (weights + activations) / (bandwidth x bandwidth_share))
        + (KV written + activation_passes x activations) / (bandwidth x bandwidth_share)
        + collectives x allreduce_s + their bytes / (link x link_share, or all_to_all_share)
    (collectives: two all-reduces a layer under tp, two all-to-alls an MoE layer under ep:
    different collectives, which reach different shares of one link);
    each cached token a decode reads costs its K and V bytes / (bandwidth x bandwidth_share),
    or its attention FLOPs where those take longer, and each (query, key) pair of a prompt's
    attention its FLOPs / (the 16-bit rate x matmul_share):
    the matmuls, the elementwise kernels (norms, rotary, activations: their traffic past the
    lower bound flops_and_bytes counts) and attention each at their own bound, summed; fixed costs
    per pass (schedule, sample) and per layer (kernel launches); and matmuls that reach less
    of the FLOP rate the fewer rows they have.
    Weight-only int8 and int4 add dequant_flops of work per weight at the 16-bit rate (their
    kernels reach less bandwidth: gpt-fast's README reports 69%, 52% and 42% of an A100's for
    bf16, int8 and int4). The KV cache gets kv_fraction of each card's memory left after the
    weights and reserved_gb (activations, workspace, CUDA graphs).
    """
    name: str
    bandwidth_share: float
    matmul_share: float
    half_tokens: float = 0.0
    step_s: float = 0.0
    layer_s: float = 0.0
    allreduce_s: float = 0.0
    link_share: float = 1.0
    all_to_all_share: float = 1.0
    reserved_gb: float = 0.0
    dequant_flops: float = 0.0
    activation_passes: float = 0.0
    kv_fraction: float = KV_MEMORY_FRACTION  # the engine's own: vLLM's gpu_memory_utilization,
                                  # SGLang's mem_fraction_static (None: by card), TensorRT-LLM's
                                  # free_gpu_memory_fraction (see EngineRules)
    rules: str = "fraction"       # how it sizes its KV cache and batch (ENGINE_RULES)
    max_batch: int = 256
    max_tokens: int = 8192
    fused: bool = True            # a step is one pass (see Replica)
    fitted_on: str = "none"

    def fields(self):
        return dataclasses.asdict(self)

    def replica(self, costs, **flags):
        """The Replica this engine runs on `costs`: max_batch seats, chunked steps of at most
        max_tokens tokens, one pass a step where fused; `flags` are what a run sets itself
        (C's --slots, --chunk-tokens, scheduler, queue order, KV budget)."""
        return dataclasses.replace(Replica(self.max_batch, costs, "chunked", self.max_tokens,
                                           fused=self.fused), **flags)


# What an engine leaves its KV cache on a card, and the batch limits it runs by default: each
# engine's own rule, a registered EngineRules. Memory in bytes per card; each rule returns its
# terms so that the KV line prints every one (in GiB, as the engines log them; a card's spec
# sheet sells GB). Read in the engines' code:
# - vLLM (vllm/v1/worker/gpu_worker.py, determine_available_memory): gpu_memory_utilization of
#   the card's whole memory, less the weights, the activations' peak in a profile run of
#   max_num_batched_tokens tokens, and the memory outside torch (NCCL, cuBLAS); CUDA graphs are
#   captured after the KV cache is sized (up to v0.20; later versions subtract an estimate and
#   raise the default fraction to match). Scheduler defaults (vllm/engine/arg_utils.py, for
#   `vllm serve`): on a card of at least 70 GiB that is no A100, 1,024 sequences and 8,192
#   tokens a step; else 256 and 2,048. Chunked prefill on, blocks of 16.
# - SGLang (srt/model_executor/model_runner.py, profile_max_num_token; server_args.py): the KV
#   pool is mem_fraction_static of the memory free before the weights, less the weights;
#   mem_fraction_static by default (card - a reserve for activations and CUDA graphs) / card,
#   the reserve 512 MiB + 1.5 x max(chunk, 2048) MiB + 2 x the largest graph batch + tp/8 GiB,
#   at least 10 GiB past 60 GiB; chunked_prefill_size by card: 2,048 under 35 GiB, 4,096 under
#   60, 8,192 under 160, else 16,384; max_running_requests min(max(pool / context x 512,
#   2048), 4096).
# - TensorRT-LLM (free_gpu_memory_fraction, 0.9, of what the weights and activations leave):
#   the `fraction` rule, its reserve fitted on calibration rows.
NON_TORCH_GIB = 0.25  # vLLM's non-torch memory at start-up (vllm-project/vllm#13061's log: 0.25)
CUDA_CONTEXT_GIB = 0.5  # held before an engine loads anything (SGLang's reserve counts 512 MiB)
ENGINE_RULES = {}


def engine_rules(cls):
    ENGINE_RULES[cls.name] = cls()
    return cls


class EngineRules:
    """The `fraction` rule: kv_fraction of what a card has left after its weights and the
    profile's reserved_gb; the profile's own max_batch and max_tokens. block_tokens: the
    granule the engine allocates its cache in (the tokens are rounded down to it)."""
    name, block_tokens = "fraction", 1

    def defaults(self, profile, cfg, card, tp, ep, drafting=None):
        """(max_num_seqs, max_num_batched_tokens, where they come from) on `card`, where a
        speculative method is `drafting` (None: none)."""
        return profile.max_batch, profile.max_tokens, "profile"

    def draft_terms(self, profile, card, tp, draft):
        """(the profile the cache is sized under, bytes of weights and bytes a cached token
        the draft (DraftMemory) adds to the model's): vLLM's, its weights loaded before the
        cache is sized and its layers' K and V in the same cache (see card_kv_terms)."""
        return profile, draft.weight_bytes, draft.kv_bytes_per_token

    def kv_terms(self, profile, cfg, card, tp, weights, limits):
        """{term: bytes per card, ..., "kv": what the KV cache gets} with `weights` bytes of
        weights on each card, under the run's limits (max_num_seqs, max_num_batched_tokens)."""
        reserved = profile.reserved_gb * 1e9
        return {"fraction": profile.kv_fraction, "total": card.memory_bytes, "weights": weights,
                "reserved": reserved,
                "kv": profile.kv_fraction * (card.memory_bytes - weights - reserved)}


@engine_rules
class FractionRules(EngineRules):
    pass


@engine_rules
class VLLMRules(EngineRules):
    name, block_tokens = "vllm", 16  # (whole blocks of 16: kv_cache_utils.py)

    def defaults(self, profile, cfg, card, tp, ep, drafting=None):
        large = card.memory_bytes >= 70 * 2**30 and "A100" not in card.name
        return (1024, 8192, "vllm_large") if large else (256, 2048, "vllm_small")

    def kv_terms(self, profile, cfg, card, tp, weights, limits):
        activation = peak_activation_bytes(cfg, limits[1], limits[0], tp)
        non_torch = NON_TORCH_GIB * 2**30
        return {"fraction": profile.kv_fraction, "total": card.memory_bytes, "weights": weights,
                "activation": activation, "non_torch": non_torch,
                "kv": profile.kv_fraction * card.memory_bytes - weights - activation - non_torch}


@engine_rules
class SGLangRules(EngineRules):
    name, block_tokens = "sglang", 16  # (as vLLM's: SGLang's page is 1 token, within 16)

    @staticmethod
    def chunk_and_graphs(card, tp):
        """(chunked_prefill_size, the largest CUDA-graph batch) by the card's memory."""
        gib = card.memory_bytes / 2**30
        for below, chunk, graphs in ((20, 2048, (8, 8)), (35, 2048, (24, 80)),
                                     (60, 4096, (32, 160)), (160, 8192, (256, 512))):
            if gib < below:
                return chunk, graphs[tp >= 4]
        return 16384, 512

    # A speculating server (srt/server_args.py): mem_fraction_static leaves more for the draft,
    # 2 GiB for EAGLE-type heads and MTP, 6 GiB for a draft model (STANDALONE), none for an
    # n-gram lookup; the draft worker keeps its own pool of as many tokens as the target's
    # (srt/model_executor/model_runner.py, draft_runner_cache_size), so the target's cache is
    # sized by its own bytes a token; and max_running_requests defaults to 48 for the EAGLE
    # family (EAGLE, EAGLE-3, MTP as NEXTN, STANDALONE).
    DRAFT_RESERVE_MIB = {"eagle": 2048, "eagle3": 2048, "mtp": 2048, "draft_model": 6144}
    DRAFTING_RUNNING = 48

    def fraction(self, profile, card, tp, draft_mib=0):
        """mem_fraction_static: the profile's, else (None) SGLang's default for the card, less
        `draft_mib` more reserved for a speculative draft."""
        if profile.kv_fraction is not None:
            return profile.kv_fraction
        chunk, graphs = self.chunk_and_graphs(card, tp)
        mib = card.memory_bytes / 2**20
        reserve = 512 + max(chunk, 2048) * 1.5 + graphs * 2 + tp / 8 * 1024
        if mib > 60 * 1024:
            reserve = max(reserve, 10 * 1024)
        return round((mib - reserve - draft_mib) / mib, 3)

    def defaults(self, profile, cfg, card, tp, ep, drafting=None):
        chunk = self.chunk_and_graphs(card, tp)[0]
        if drafting in self.DRAFT_RESERVE_MIB:
            return self.DRAFTING_RUNNING, chunk, "sglang_drafting"
        weights = card_weight_bytes(cfg, tp, ep)
        pool = self.kv_terms(profile, cfg, card, tp, weights, None)["kv"] / \
            card_kv_bytes_per_token(cfg, tp)
        running = min(max(int(pool / cfg.max_positions * 512), 2048), 4096)
        return running, chunk, "sglang"

    def draft_terms(self, profile, card, tp, draft):
        reserve = self.DRAFT_RESERVE_MIB.get(draft.method, 0)
        if profile.kv_fraction is None and reserve:
            profile = dataclasses.replace(profile, kv_fraction=self.fraction(profile, card, tp,
                                                                              reserve))
        return profile, 0.0, 0.0

    def kv_terms(self, profile, cfg, card, tp, weights, limits):
        fraction = self.fraction(profile, card, tp)
        free = card.memory_bytes - CUDA_CONTEXT_GIB * 2**30
        return {"fraction": fraction, "total": card.memory_bytes, "weights": weights,
                "context": CUDA_CONTEXT_GIB * 2**30, "kv": fraction * free - weights}


# `roofline` is C's pricing before it was checked against any engine (90% and 80% of a card's
# spec: an H200 in this workplace copied at about 4.3 of its 4.8 TB/s and ran a large bf16
# matmul at 769-798 of its 989 TFLOP/s; the post's RTX 5080 reached 105.5 of its 112.6). The
# others are fitted by tests/fit_profiles.py on their engine's rows of the published
# calibration file (../shared/published/calibration.csv) and on nothing else (a test refits
# them and finds these values); README gives the fit's errors.
# vLLM has no calibration rows: its profile takes TensorRT-LLM's efficiencies and vLLM's own
# defaults (max_num_seqs 256; the batch's token budget), and is checked on real vLLM runs.
ENGINE_PROFILES = {
    "roofline": EngineProfile("roofline", 0.9, 0.8, fused=False, fitted_on="the spec sheets"),
    # 48 rows: v0.5.0's GPT-J static batches and first tokens, v0.14.0's in-flight Llama-3.1
    # 8B and 70B (max_batch and max_tokens: trtllm-build's defaults, not fitted)
    "tensorrt-llm": EngineProfile("tensorrt-llm", bandwidth_share=0.86, matmul_share=0.66,
                                  half_tokens=64.0, step_s=1.05e-3, layer_s=75e-6,
                                  allreduce_s=80e-6, reserved_gb=7.0, activation_passes=1.5,
                                  max_batch=2048, max_tokens=8192,
                                  fitted_on="TensorRT-LLM's 48 dense calibration rows"),
    # 6 rows: Llama-2-7B at batch 1 in bf16, int8 and int4, and bf16 on 2, 4 and 8 cards; the
    # fields they cannot tell keep the fit's start (tests/fit_profiles.py). 82% of the A100's 2,039
    # GB/s is 1,672 GB/s: gpt-fast's README finds "about 1700 GB/s" on its power-capped cards
    "gpt-fast": EngineProfile("gpt-fast", bandwidth_share=0.82, matmul_share=0.8,
                              layer_s=52.5e-6, allreduce_s=5e-6, dequant_flops=35.0,
                              max_batch=1, fitted_on="gpt-fast's 6 calibration rows"),
}
ENGINE_PROFILES["vllm"] = dataclasses.replace(
    ENGINE_PROFILES["tensorrt-llm"], name="vllm", max_batch=256, max_tokens=2048,
    reserved_gb=0.0, rules="vllm", fitted_on="none (TensorRT-LLM's efficiencies)")
ENGINE_PROFILES["sglang"] = dataclasses.replace(
    ENGINE_PROFILES["tensorrt-llm"], name="sglang", max_batch=4096, max_tokens=8192,
    reserved_gb=0.0, kv_fraction=None, rules="sglang",
    fitted_on="none (TensorRT-LLM's efficiencies)")
DEFAULT_PROFILE = "tensorrt-llm"

def steps_to(a, e, t, when, k):
    """The first step count x in 1..k whose run, started at t, of steps taking a + e (j - 1)
    seconds (step j) ends at or after `when` (else k)."""
    gap = when - t  # solve a x + e x (x - 1) / 2 = gap, then settle on integers
    if e > 0:
        x = ((e / 2 - a) + math.sqrt((a - e / 2) ** 2 + 2 * e * max(gap, 0))) / e
    else:
        x = gap / a if a > 0 else k
    x = min(max(1, math.ceil(x)), k)
    while x > 1 and t + ((x - 1) * a + e * (x - 1) * (x - 2) / 2) >= when:
        x -= 1
    while x < k and t + (x * a + e * x * (x - 1) / 2) < when:
        x += 1
    return x


# C's pricing knots: tokens per pass, powers of two and the midpoints (x 1.5) between them
PRICE_KNOTS = tuple(sorted({2**i for i in range(17)} | {3 * 2**i for i in range(16)}))


@functools.lru_cache(maxsize=8192)
def pass_cost(cfg, tp, tokens, ep=1):
    """One card's FLOPs and bytes of a pass of `tokens` new tokens, on one of tp cards or one
    of an expert-parallel group of ep (a fit prices the same passes under thousands of
    profiles)."""
    if ep > 1:
        return ep_card_cost(cfg, tokens, ep)
    return card_share(cfg, flops_and_bytes(cfg, tokens, 1, 0), tp)


def pass_seconds(cfg, card, profile, tp, tokens, ep=1):
    """Seconds of one forward pass of `tokens` new tokens on one of `tp` cards (or one of an
    expert-parallel group of `ep`), its cache reads apart (see EngineProfile)."""
    cost = pass_cost(cfg, tp, tokens, ep)
    rate = card.matmul_tflops(cfg.fp8_compute) * 1e12 * profile.matmul_share
    rate *= tokens / (tokens + profile.half_tokens)
    bandwidth = card.bandwidth_gbs * 1e9 * profile.bandwidth_share
    matmuls = max(cost["matmul_flops"] / rate,
                  (cost["weight_bytes"] + cost["activation_bytes"]) / bandwidth)
    seconds = profile.step_s + cfg.layers * profile.layer_s + matmuls
    if cfg.weight_format in ("int8", "int4"):  # weight-only: every weight dequantized
        weights = dense_matmul_weights(cfg) / tp
        seconds += weights * profile.dequant_flops / (card.tflops * 1e12)
    seconds += (cost["kv_write_bytes"] + profile.activation_passes * cost["activation_bytes"]) \
        / bandwidth
    if cost["collectives"]:  # (tp: two all-reduces a layer; ep: two all-to-alls an MoE one)
        share = profile.all_to_all_share if ep > 1 else profile.link_share
        seconds += cost["collectives"] * profile.allreduce_s + \
            cost["collective_bytes"] / (card.link_gbs * 1e9 * share)
    return seconds


def card_costs(cfg, card, profile=None, tp=1, ep=1):
    """C's prices for a named card, an engine's profile of it, and tensor parallelism (or
    expert parallelism: one rank of an ep-card group, see ep_card_cost)."""
    profile = profile or ENGINE_PROFILES[DEFAULT_PROFILE]
    seconds = tuple(pass_seconds(cfg, card, profile, tp, n, ep) for n in PRICE_KNOTS)
    pair_s = attention_flops_per_key(cfg) * cfg.layers / tp / \
        (card.tflops * 1e12 * profile.matmul_share)
    # a decode reads each cached token once, for one query: at its bytes' bound or, where a
    # key costs more arithmetic than its bytes take (latent attention), at its FLOPs'
    kv_s = max(card_kv_bytes_per_token(cfg, tp) /
               (card.bandwidth_gbs * 1e9 * profile.bandwidth_share), pair_s)
    source = {"kind": "pricing_card", "card": card.name, "model": cfg.name, "tp": tp, "ep": ep,
              "weights": cfg.weight_format, "kv_dtype": cfg.kv_dtype, "profile": profile.name,
              "bandwidth_share": profile.bandwidth_share, "matmul_share": profile.matmul_share,
              "step_us": profile.step_s * 1e6, "layer_us": profile.layer_s * 1e6}
    return StepCosts(PRICE_KNOTS, seconds, kv_s, source, pair_s=pair_s)


class DraftMemory(NamedTuple):
    """What a speculative draft keeps on each card beside the model it drafts for: its own
    weights (what it does not share with the target) and its KV, bytes a token, and its
    method (see nn40.speculative.draft_memory; each engine's rule charges them its way:
    EngineRules.draft_terms)."""
    weight_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0
    method: str = None


NO_DRAFT = DraftMemory()


def card_kv_tokens(cfg, card, profile, tp=1, ep=1, limits=None):
    """The KV cache's tokens on `tp` cards (or on one of an expert-parallel group of `ep`):
    what the profile's engine leaves each card (see card_kv_terms; 0: nothing fits)."""
    return card_kv_terms(cfg, card, profile, tp, ep, limits)["tokens"]


def card_kv_terms(cfg, card, profile, tp=1, ep=1, limits=None, draft=NO_DRAFT):
    """Each term of the engine's memory rule on one card (EngineRules.kv_terms), in bytes,
    with the batch limits its activations were sized at (limits: (max_num_seqs,
    max_num_batched_tokens); None: the engine's defaults on the card) and the KV tokens. A
    speculative `draft` (DraftMemory) is charged by the engine's rule (draft_terms): vLLM adds
    its weights to the model's and its KV a token to each cached token's, sizing one cache for
    every attention layer it loaded, the draft's with the target's
    (vllm/v1/worker/gpu_model_runner.py, get_kv_cache_spec); SGLang reserves it memory apart."""
    rules = ENGINE_RULES[profile.rules]
    limits = limits or rules.defaults(profile, cfg, card, tp, ep, draft.method)[:2]
    weights = card_weight_bytes(cfg, tp, ep)
    profile, draft_weights, draft_per_token = rules.draft_terms(profile, card, tp, draft)
    terms = rules.kv_terms(profile, cfg, card, tp, weights + draft_weights, limits)
    terms["weights"] = weights
    if draft_weights:
        terms["draft_weights"] = draft_weights
    per_token = card_kv_bytes_per_token(cfg, tp) + draft_per_token
    whole = int(max(terms["kv"], 0) // per_token)
    return {**terms, "rules": profile.rules, "limits": list(limits),
            "tokens": whole // rules.block_tokens * rules.block_tokens}


def fit_step_costs(decode_rows, prefill_rows, context, kv_token_s, source):
    """StepCosts from measured passes: decode rows (batch, context, step_ms) and prefill rows
    (tokens, step_ms). Each batch timed at two contexts gives the cost of its cached tokens
    (else the given kv_token_s); the knots are the decodes at `context` less their KV reads,
    then the prefills."""
    by_batch = {}  # the cost of a cached token, from the same batch at two contexts
    for b in sorted({r["batch"] for r in decode_rows}):
        pts = sorted((r["batch"] * r["context"], r["step_ms"] / 1e3) for r in decode_rows
                     if r["batch"] == b)
        if len(pts) > 1 and pts[-1][0] > pts[0][0]:
            by_batch[b] = max((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), 0.0)
    if by_batch:
        kv_token_s = float(np.median(list(by_batch.values())))
    costs = StepCosts((1,), (0.0,), kv_token_s, source, tuple(by_batch.items()))
    knots = {r["batch"]: r["step_ms"] / 1e3 - costs.kv_s(r["batch"]) * r["batch"] * r["context"]
             for r in decode_rows if r["context"] == context}
    for r in prefill_rows:
        knots.setdefault(r["tokens"], r["step_ms"] / 1e3)
    x = sorted(knots)
    return dataclasses.replace(costs, tokens=tuple(x),
                               seconds=tuple(max(knots[k], 1e-9) for k in x))


def measured(rows):
    return [r for r in rows if "skipped" not in r]


def measured_costs(cfg, results):
    """Pricing from this run's A rows (decode, by batch) and B rows (prefill, by tokens)."""
    A = results["A"]
    mode = A["modes"][-1]  # (decode and prefill both from this mode)
    ceil = results["environment"]["ceilings"]
    prefills = [r for r in measured(results.get("B", {}).get("rows", []))
                if r["phase"] == "prefill" and r["mode"] == mode]
    return fit_step_costs([r for r in measured(A["rows"]) if r["mode"] == mode], prefills,
                          A["context"], kv_bytes_per_token(cfg) / (ceil["bandwidth_gbs"] * 1e9),
                          {"kind": "pricing_measured",
                           "device": results["environment"]["device"], "mode": mode})


def fit_passes(passes, source):
    """StepCosts fitted to an engine's own timed passes [(tokens, cached tokens, seconds)]: for
    each number of tokens per pass, a least-squares line in the cached tokens (its mean where
    they do not vary, or too few passes tell), so that a simulation priced with it replays the
    run's own costs: the seconds of each kind of pass sum to what the engine measured."""
    by_tokens = {}
    for tokens, kv, seconds in passes:
        by_tokens.setdefault(tokens, []).append((kv, seconds))
    slopes = {}
    for tokens, points in by_tokens.items():
        kv, seconds = np.array(points, dtype=np.float64).T
        if len(points) > 2 and np.ptp(kv) > 0:
            slopes[tokens] = max(float(np.polyfit(kv, seconds, 1)[0]), 0.0)
    costs = StepCosts((1,), (0.0,), float(np.median(list(slopes.values()))) if slopes else 0.0,
                      source, tuple(sorted(slopes.items())))
    knots = {}
    for tokens, points in by_tokens.items():
        kv, seconds = np.array(points, dtype=np.float64).T
        knots[tokens] = max(float((seconds - costs.kv_s(tokens) * kv).mean()), 1e-9)
    x = sorted(knots)
    return dataclasses.replace(costs, tokens=tuple(x), seconds=tuple(knots[k] for k in x))
