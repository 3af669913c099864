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

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import collections
import heapq
import itertools
import json
import math
import os
import platform
import signal
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from nn40.errors import UsageError
from nn40.traces import COUNT_MAX, read_named_trace
from nn40.stats import percentiles
from nn40.config import (  # noqa: F401 (the script's names, while they move)
    CALIBRATION_CSV, CAPACITY_REQUESTS, CAPACITY_SEEDS, CPU_KV_MEMORY_GB, CPU_PRESET,
    DTYPE_BYTES, DTYPE_FORMAT, DTYPE_NAMES, ENGINE_CPU, ENGINE_QUICK, EXPERIMENTS, GPU, GPUS,
    HF_COMMON, HF_FIELDS, HF_OPTIONAL, HF_TYPES, HOST_LINKS, KV_DTYPES, KV_MEMORY_FRACTION,
    LENGTH_MAX, LENGTH_MU, LENGTH_SEED, LENGTH_SIGMA, MAX_SPAN_S, MODELS, ModelConfig,
    PROJECT_DIR, PUBLISHED_CSV, RATES, REFERENCE_BANDWIDTH_GBS, REFERENCE_MEMORY_GB,
    REFERENCE_TFLOPS, REPLICAS_MAX, REQUEST_BYTES, SEED_OFFSET, SWEEP_REQUESTS,
    VLLM_MAX_NUM_SEQS, WEIGHT_FORMATS, WHO_WAITS_REQUESTS, _LLAMA, _NVLINK3, _NVLINK4,
    _NVLINK5, _PCIE4, _PCIE5, read_model_config)
from nn40.host import (  # noqa: F401 (the script's names, while they move)
    BUSY_SHARE, InlineExecutor, OUTPUT_WIDTH, busy, columns, cpu_clock, dask_distributed,
    fit_lines, free_host_memory_bytes, gib, load_between, log, log_labelled, one_line,
    parallel_executor, run_parallel, to_json, windows_available_bytes, write_atomic)
from nn40.accounting import (  # noqa: F401 (the script's names, while they move)
    active_param_count, all_expert_bytes, attention_flops_per_key, attention_weights,
    card_experts, card_kv_bytes_per_token, card_kv_share, card_share, card_weight_bytes,
    dense_matmul_weights, dense_twin, ep_card_cost, expert_inclusion, expert_weights,
    experts_touched, kv_bytes_per_token, kv_crossover_batch, kv_heads_per_card, layer_weights,
    memory_needed_bytes, moe_step_bytes, norm_weights, param_count, peak_activation_bytes,
    post_step_cost, routed_expert_bytes, step_cost, weight_bytes, weight_parts)
from nn40.workload import (  # noqa: F401 (the script's names, while they move)
    CHAIN_MASK, HASH_BLOCK_TOKENS, HashedPrompts, PrefixWorkload, Requests, SharedPrompts,
    arrival_times, engine_settings, first_jsonl_line, hashed_trace_row, is_engine_run,
    is_hashed_trace, lognormal_lengths, make_requests, random_stream, read_bench_result,
    read_engine_run, read_hashed_trace, read_lengths_file, read_run_meta, read_trace,
    request_lengths, seed_for, shared_prompts)
from nn40.slot_steps import (  # noqa: F401 (the script's names, while they move)
    continuous_starts, occupied_per_step, simulate_slots, static_starts)
from nn40.queues import (  # noqa: F401 (the script's names, while they move)
    BlockQueue, FifoQueue, Ledger, ORDERS, Order, PriorityQueue, RequestTimes, kendall_tau,
    queue_order, waiting_queue)
from nn40.kv import (  # noqa: F401 (the script's names, while they move)
    KVBudget, KVManager, KVUnfit, KV_MANAGERS, PREFIX_REPORT, PagedBlocks, PrefixCache,
    Reservation, Seq, check_kv_budget, kv_manager, leading, merged_reports, plain_twin)
from nn40.replicas import (  # noqa: F401 (the script's names, while they move)
    DecodeBatch, PassPrices, PrefillQueue, Replica, SCHEDULERS, SimulationStalled,
    schedule_prefill)
from nn40.loop import (  # noqa: F401 (the script's names, while they move)
    FleetReplica, MemoryRecord, ServingSim, simulate_serving)
from nn40.text import (  # noqa: F401 (the script's names, while they move)
    DESCRIPTION, EPILOG, SHARED_TEXT, TEXT_EN, USAGE)
from nn40.text_ko import (  # noqa: F401 (the script's names, while they move)
    TEXT, TEXT_KO)
from nn40.settings import (  # noqa: F401 (the script's names, while they move)
    EngineConfig, HardwareConfig, MeasurementConfig, OutputConfig, RUN_FIELDS, RUN_GROUP,
    RUN_GROUPS, RunConfig, SLOConfig, SchedulerConfig, WorkloadConfig, attainment,
    experiment_letters, fraction, integer, integers, known_fields, milliseconds, number,
    numbers, rate_value, usage_type)
from nn40.names import (  # noqa: F401 (the script's names, while they move)
    NAME_ALIASES, NAME_NOISE, _spellings, closest_names, find_name, name_index, name_key, named)
from nn40.pricing import (  # noqa: F401 (the script's names, while they move)
    CUDA_CONTEXT_GIB, DEFAULT_PROFILE, ENGINE_PROFILES, ENGINE_RULES, EngineProfile,
    EngineRules, FractionRules, NON_TORCH_GIB, PRICE_KNOTS, SGLangRules, StepCosts, VLLMRules,
    analytic_costs, card_costs, card_kv_terms, card_kv_tokens, engine_rules, fit_passes,
    fit_step_costs, measured, measured_costs, pass_cost, pass_seconds)
from nn40.profiles import (  # noqa: F401 (the script's names, while they move)
    engine_profile, profile_named, read_profile_file, run_profile)
from nn40.published import (  # noqa: F401 (the script's names, while they move)
    GPT_FAST_OUTPUT, PROFILE_GRID, PUBLISHED_ENGINES, PUBLISHED_METRICS, PUBLISHED_PER_GPU,
    Published, coordinate_search, error_summary, max_load_tokens_per_s, predict_published,
    prompt_pairs, published_engine, published_errors, published_row, published_weights,
    read_published, row_model, validate)
from nn40.memory import (  # noqa: F401 (the script's names, while they move)
    DeviceMemory, check_card_fits, fitting_split, kv_budget_bytes, memory_source)
from nn40.metrics import (  # noqa: F401 (the script's names, while they move)
    LATENCIES, quantile_curve, serving_metrics, thin)
from nn40.routers import (  # noqa: F401 (the script's names, while they move)
    CacheAware, LeastKV, LeastRequests, PowerOfTwo, ROUTERS, RoundRobin, route)
from nn40.events import (  # noqa: F401 (the script's names, while they move)
    ARRIVE, COMMIT, EventQueue, PLAN, SENT)
from nn40.handoff import (  # noqa: F401 (the script's names, while they move)
    GPUS_PER_NODE, HandOff, KVLink, KVSends, NETWORK_DEFAULT, NETWORK_LATENCY_US,
    NETWORK_LINKS, kv_link, network_link)
from nn40.pools import (  # noqa: F401 (the script's names, while they move)
    Fleet, Pool, PoolStage, pool_stage, pooled_memory, pools_result, simulate_fleet,
    simulate_pools)
from nn40.disaggregated import (  # noqa: F401 (the script's names, while they move)
    BIG_BATCH, DISTSERVE_MODELS, DISTSERVE_PLACEMENTS, DISTSERVE_PROFILES, DISTSERVE_SLO,
    DISTSERVE_SLOTS, PhaseCosts, PipelineCosts, SEARCH_ATTAINMENT, SEARCH_PP, SEARCH_TP,
    VLLM_WATERMARK, check_placement, distserve_kv_tokens, distserve_placement, distserve_pools,
    distserve_replica, distserve_runs, pipeline_costs, placement_goodput, placement_name,
    placement_pools, profiled_costs, read_distserve_profile, replay_distserve,
    replay_distserve_runs, search_candidates, search_placements, steps_reaching)
from nn40.runs import (  # noqa: F401 (the script's names, while they move)
    HIT_BUCKETS, Work, arrivals, every_nth, host_tier, kv_metrics, kv_setup, memory_metrics,
    no_memory, order_info, prefix_metrics, run_order, step_costs, study_budget, timed_task,
    work_of, workload)
from nn40.capacity import (  # noqa: F401 (the script's names, while they move)
    PREFIX_STUDY_SHARES, SLO, attained, capacity_choice, capacity_one, capacity_study,
    fewest_replicas, fleet_capacity, fleet_summary, prefix_study, replicas_study, run_routers,
    unit_rate)
from nn40.experiment_c import (  # noqa: F401 (the script's names, while they move)
    catalog, engine_run_study, kv_study, order_latencies, orders_steps, post_table, rate_sweep,
    run_batching_sim, save_requests_csv, schedulers_study, seed_spread, who_waits)
from nn40.calibration import (  # noqa: F401 (the script's names, while they move)
    CALIBRATED, CALIBRATE_FIELDS, CALIBRATE_MAX_ERROR, CALIBRATE_ROUNDS, CALIBRATE_TOLERANCE,
    MeasuredRun, RUN_DEFAULTS, RUN_FORMATS, calibrate, calibration_errors, calibration_loss,
    leave_one_out, read_measured_run, replay_run, run_kind, run_label)


# -----------------------------------------------------------------------------
# model: a decoder-only transformer with a static KV cache (device code)
# The cache is one preallocated tensor (layers, 2, batch, kv_heads, max_len, head_dim); each
# row writes its new K/V at its own positions, so shapes never change between steps. The post's
# model: LayerNorm, learned positions, multi-head attention, a 4x GELU MLP. The open models
# (MODELS): RMSNorm, rotary positions, grouped K/V heads, a gated SiLU MLP.


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # (the config's type names)


class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):  # (computed in fp32, as the open models do)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


def norm_layer(cfg):
    return nn.LayerNorm(cfg.hidden) if cfg.norm == "layer" else RMSNorm(cfg.hidden)


def linear(x, weight, weight_first_rows=0):
    """x W^T for a weight W (out, in). With at most `weight_first_rows` rows on a CPU it runs
    as W x^T, transposed back: the same products, but on some CPUs' matmul libraries (MKL on
    an AMD EPYC, with 2 to 64 rows) F.linear takes 2-4x batch 1's time over the same weights,
    where W x^T streams them at batch 1's rate (probe_layouts measures which, per machine)."""
    rows = x.numel() // x.shape[-1]
    if rows <= weight_first_rows and x.device.type == "cpu":  # (both ends row-major, as timed)
        y = torch.mm(weight, x.reshape(rows, x.shape[-1]).contiguous().T).T.contiguous()
        return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear (no bias) through linear(): weight_first_rows is set by build_model."""
    weight_first_rows = 0

    def __init__(self, inputs, outputs):
        super().__init__(inputs, outputs, bias=False)

    def forward(self, x):
        return linear(x, self.weight, self.weight_first_rows)


def rotate(x, rope):
    """Rotary positions: each pair (x_i, x_{i + D/2}) turned by its position's angle."""
    cos, sin = rope  # (B, 1, T, D/2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MoE(nn.Module):
    """Routed experts: each token's top-k of E gated MLPs, weighted by the softmax of its k
    router logits (Mixtral's), plus shared experts every token uses. Tokens are grouped by
    expert, so an expert computes only its own tokens and an expert no token chose is never
    read. Two formulations of the same sums: a loop over the touched experts (the host reads
    their counts: what a CPU runs), or, where `grouped` (build_model sets it on CUDA where
    grouped_mm_works), two grouped matmuls over the slots sorted by expert, each group's end
    counted on the device: no host value is read, so a CUDA graph can capture the layer, and
    an expert no slot chose is an empty group. tallies(): the experts read summed over the
    calls since reset_tally(), and those calls."""
    weight_first_rows = 0  # (see linear; set by build_model)

    def __init__(self, cfg):
        super().__init__()
        h, f, E = cfg.hidden, cfg.expert_width, cfg.experts
        self.k = cfg.experts_per_token
        self.router = Linear(h, E)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * f, h))  # (each expert's gate; up)
        self.down = nn.Parameter(torch.empty(E, h, f))         # (out, in), as a Linear's
        n = cfg.shared_experts * f  # (the shared experts as one gated MLP of their widths)
        self.shared = nn.ModuleList([Linear(h, 2 * n), Linear(n, h)]) if n else None
        self.touched = self.touched_sum = self.calls = 0
        self.grouped, self.tally = False, None

    def set_grouped(self, grouped):
        """The grouped formulation (True) or the loop; the grouped one tallies on the device."""
        self.grouped = grouped
        self.tally = torch.zeros(2, dtype=torch.long, device=self.down.device) if grouped \
            else None

    def reset_tally(self):
        self.touched_sum = self.calls = 0
        if self.tally is not None:
            self.tally.zero_()

    def tallies(self):
        """(experts read, summed over the calls since reset_tally; those calls)."""
        return tuple(self.tally.tolist()) if self.grouped else (self.touched_sum, self.calls)

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        top, chosen = self.router(x).topk(self.k, dim=-1)          # (N, k) each
        weight, chosen = top.softmax(dim=-1).reshape(-1), chosen.reshape(-1)
        order = chosen.argsort()
        token = order // self.k                                      # each slot's token
        routed = self.grouped_experts if self.grouped else self.looped_experts
        out = routed(x, chosen, order, token, weight)
        if self.shared is not None:
            gate, up = self.shared[0](x).chunk(2, dim=-1)
            out = out + self.shared[1](F.silu(gate) * up)
        return out.reshape(shape)

    def looped_experts(self, x, chosen, order, token, weight):
        counts = torch.bincount(chosen, minlength=len(self.down)).tolist()
        out, start, first = torch.zeros_like(x), 0, self.weight_first_rows
        for e, n in enumerate(counts):
            if n:
                rows, slots = token[start:start + n], order[start:start + n]
                gate, up = linear(x[rows], self.gate_up[e], first).chunk(2, dim=-1)
                y = linear(F.silu(gate) * up, self.down[e], first)
                out.index_add_(0, rows, y * weight[slots, None].to(y.dtype))
            start += n
        self.touched = sum(1 for n in counts if n)
        self.touched_sum, self.calls = self.touched_sum + self.touched, self.calls + 1
        return out

    def grouped_experts(self, x, chosen, order, token, weight):
        counts = torch.zeros(len(self.down), dtype=torch.long, device=x.device).scatter_add_(
            0, chosen, torch.ones_like(chosen))  # (bincount reads its range on the host)
        ends = counts.cumsum(0).to(torch.int32)  # each expert's slots end here, sorted
        gate, up = torch._grouped_mm(x[token], self.gate_up.transpose(1, 2),
                                     offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)
        self.tally += torch.stack((counts.gt(0).sum(), torch.ones_like(counts[0])))
        return torch.zeros_like(x).index_add_(0, token, y * weight[order, None].to(y.dtype))


class Block(nn.Module):
    """Pre-norm block: causal self-attention with grouped K/V heads, then the MLP (or, in a
    mixture of experts, the routed experts)."""

    def __init__(self, cfg, moe=False):
        super().__init__()
        h = cfg.hidden
        self.heads, self.kv_heads, self.kv_dim = cfg.heads, cfg.n_kv_heads, cfg.kv_dim
        self.head_dim, self.q_dim = cfg.head_dim, cfg.q_dim
        self.ln1 = norm_layer(cfg)
        self.qkv = Linear(h, cfg.q_dim + 2 * cfg.kv_dim)
        self.proj = Linear(cfg.q_dim, h)
        self.ln2 = norm_layer(cfg)
        self.gated = cfg.mlp == "gated"
        self.moe = MoE(cfg) if moe else None
        if not moe:
            self.fc = Linear(h, (2 if self.gated else 1) * cfg.ffn)  # (gate; up)
            self.out = Linear(cfg.ffn, h)

    def forward(self, x, cache, at):
        # x (B, T, h); cache (2, B_cache, KVH, S_max, D); at: the StepLayout
        index, positions, spans, mask, rope = at
        B, T, h = x.shape
        H, KVH = self.heads, self.kv_heads
        D, G = self.head_dim, H // KVH  # head width; query heads per K/V head
        q, k, v = self.qkv(self.ln1(x)).split([self.q_dim, self.kv_dim, self.kv_dim], dim=2)
        q = q.view(B, T, H, D).transpose(1, 2)                         # (B, H, T, D)
        k, v = (t.view(B, T, KVH, D).transpose(1, 2) for t in (k, v))  # (B, KVH, T, D)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        # write this step's K/V at each row's own positions: cache[row, :, pos] = (KVH, D)
        cache[0][index[:, None], :, positions] = k.transpose(1, 2)
        cache[1][index[:, None], :, positions] = v.transpose(1, 2)
        if spans is None:  # prefill: attend among the new tokens only (from an empty row), or
            # also to the row's cached prefix (a mask: each token sees the keys up to its own)
            if mask is not None:
                keys = mask.shape[-1]
                k, v = cache[0][index, :, :keys], cache[1][index, :, :keys]  # (B, KVH, keys, D)
            if G > 1:
                k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        else:  # decode (T = 1): each span of rows reads a view of its own cached keys, no mask;
            # the G query heads of a K/V head attend as G rows of one (B, KVH, G, D) query
            q = q.reshape(B, KVH, G, D)
            parts = [F.scaled_dot_product_attention(
                q[i:j], cache[0, row:row + j - i, :, :n], cache[1, row:row + j - i, :, :n],
                attn_mask=None if mask is None else mask[i:j]) for i, j, row, n in spans]
            y = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(B, H, T, D)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, self.q_dim))
        if self.moe is not None:
            return x + self.moe(self.ln2(x))
        if self.gated:
            gate, up = self.fc(self.ln2(x)).chunk(2, dim=-1)
            return x + self.out(F.silu(gate) * up)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class StepLayout(NamedTuple):
    """Where a step's tokens sit, the same for every block: index (B,) the cache row of each
    batch row; positions (B, T); spans: see attention_spans (None for a prefill); mask: None,
    or (B, 1, 1, keys) when one span pads its rows to the longest, or (B, 1, T, keys) for a
    prefill after a cached prefix (spans None); rope: None or (cos, sin)."""
    index: torch.Tensor
    positions: torch.Tensor
    spans: list
    mask: torch.Tensor
    rope: tuple


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # (tables given, not drawn: drawing on the meta device imports torch._dynamo, 2 s)
        self.tok_embed = nn.Embedding(cfg.vocab, cfg.hidden,
                                      _weight=torch.empty(cfg.vocab, cfg.hidden))
        if cfg.positions == "learned":
            self.pos_embed = nn.Embedding(cfg.max_positions, cfg.hidden, _weight=torch.empty(
                cfg.max_positions, cfg.hidden))
        self.blocks = nn.ModuleList(Block(cfg, moe=i >= cfg.layers - cfg.moe_layers)
                                    for i in range(cfg.layers))
        self.ln_f = norm_layer(cfg)
        self.lm_head = Linear(cfg.hidden, cfg.vocab)
        if cfg.tied:
            self.lm_head.weight = self.tok_embed.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def forward(self, tokens, positions, cache, rows=None, spans=None, mask=None):
        """tokens, positions (B, T) -> logits of each row's last token (B, vocab).

        rows: the cache row of each batch row (default: rows 0..B-1); spans: None for a prefill
        into empty rows, else the decode's attention spans (see attention_spans) and their mask.
        """
        index = torch.arange(len(tokens), device=tokens.device) if rows is None else rows
        x, rope = self.tok_embed(tokens), None
        if self.cfg.positions == "learned":
            x = x + self.pos_embed(positions)
        else:
            angles = positions[:, None, :, None].float() * self.inv_freq  # (B, 1, T, D/2)
            rope = angles.cos(), angles.sin()
        at = StepLayout(index, positions, spans, mask, rope)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache[layer], at)
        return self.lm_head(self.ln_f(x[:, -1]))


def rope_frequencies(cfg):
    """theta^(-2i/D) for i < D/2: the rotary angle per position of each pair of dimensions."""
    D = cfg.head_dim
    return cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float32, device="cpu") / D)


class PostProxy(nn.Module):
    """The model the post's A and B figures fit (--arch post): per token, `layers` square
    h x h matmuls in a row, and nothing else: no attention, KV cache, norms, embeddings or LM
    head. Its FLOPs are the post's 2 L h^2 per token; its weights, L h^2."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers))

    def forward(self, x):  # (..., h) -> (..., h)
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(cfg, device, seed=0, weight_first_rows=0):
    """Random weights from a fixed seed, scaled so activations stay O(1) in fp16. The model is
    laid out on the meta device and allocated once, on the device and in its own dtype (an 8B
    model never exists in fp32 on the host). weight_first_rows: see linear."""
    with torch.device("meta"):
        model = PostProxy(cfg) if cfg.arch == "post" else Transformer(cfg)
    for module in model.modules():  # (by hand: Module.to_empty imports sympy, 1-2 s)
        for name, p in module.named_parameters(recurse=False):
            module._parameters[name] = nn.Parameter(torch.empty(
                p.shape, device=device, dtype=DTYPES[cfg.dtype]))
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = torch.empty(b.shape, device=device, dtype=b.dtype)
    if cfg.arch == "transformer" and cfg.tied:  # (each module was given its own copy)
        model.lm_head.weight = model.tok_embed.weight
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (a Linear's (out, in), an expert stack's (experts, out, in))
                p.normal_(0.0, 0.02 if "embed" in name else p.shape[-1] ** -0.5, generator=g)
            else:  # a norm's weight (and LayerNorm's bias)
                p.fill_(0.0 if name.endswith("bias") else 1.0)
        if hasattr(model, "inv_freq"):
            model.inv_freq = rope_frequencies(cfg).to(device)
    grouped = cfg.experts and torch.device(device).type == "cuda" and grouped_mm_works(
        torch.device(device), DTYPES[cfg.dtype])
    for module in model.modules():
        if isinstance(module, (Linear, MoE)):
            module.weight_first_rows = weight_first_rows
        if isinstance(module, MoE):
            module.set_grouped(bool(grouped))
    return model.eval()


def new_kv_cache(cfg, batch, max_len, device, seed=0, tile=256):
    """(layers, 2, batch, kv_heads, max_len, head_dim), filled with random values, never zeros.

    One random (kv_heads, tile, head_dim) block is copied across the cache: a copy runs at
    memory speed where drawing gigabytes of random numbers on a CPU takes many seconds.
    """
    shape = (cfg.layers, 2, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    g = torch.Generator(device="cpu").manual_seed(seed)
    block = torch.randn(cfg.n_kv_heads, min(tile, max_len), cfg.head_dim, generator=g)
    block = block.to(device=device, dtype=DTYPES[cfg.dtype])
    cache = torch.empty(shape, device=device, dtype=block.dtype)
    for start in range(0, max_len, tile):
        part = cache[..., start:start + tile, :]
        part.copy_(block[:, :part.shape[-2]])
    return cache


def prefill(model, cache, tokens, rows=None, start=0):
    """Run prompts (B, T) into cache rows; logits of the last tokens (B, vocab).

    rows: the cache row of each prompt (default: the first B rows). start: the tokens each row
    holds already (a cached prefix): the prompts' rest runs at positions start..start+T-1,
    attending to the prefix too.
    """
    B, T = tokens.shape
    positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
    if not start:
        return model(tokens, positions, cache, rows)
    keys = torch.arange(start + T, device=tokens.device)
    mask = (keys <= positions[:, :, None])[:, None]  # (B, 1, T, keys)
    if rows is None:
        rows = torch.arange(B, device=tokens.device)
    return model(tokens, positions, cache, rows, None, mask)


def attention_spans(rows, positions):
    """Group a decode's batch rows for attention: [(i, j, first cache row, keys), ...].

    A span is a run of batch rows i..j-1 whose cache rows are consecutive and whose positions
    are equal, so it attends to a view of the cache (rows row..row+j-i-1, the first `keys`
    positions) with no mask and no padding: each row reads exactly its own context. One span
    when every row is at the same position (A and B, a static batch).
    """
    spans, i = [], 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or rows[j] != rows[j - 1] + 1 or positions[j] != positions[i]:
            spans.append((i, j, rows[i], positions[i] + 1))
            i = j
    return spans


def decode_step(model, cache, tokens, positions, rows=None, pad=False):
    """One new token per row (B,); logits (B, vocab).

    positions: an int when every row is at the same position (one attention span, no host
    values read: what a CUDA graph captures), or a sequence of each row's own position.
    rows: the cache row of each token (default 0..B-1), a list or a tensor.
    pad: rows at different positions in consecutive cache rows attend in one call, padded to
    the longest row and masked, instead of one call per span: it reads the padding, but on a
    GPU one kernel beats dozens of tiny launches.
    """
    B, device = len(tokens), tokens.device
    if isinstance(positions, int) and rows is None:  # the timed path of A and B: one span
        return model(tokens[:, None], torch.full((B, 1), positions, device=device), cache,
                     None, [(0, B, 0, positions + 1)])
    row_list = list(range(B)) if rows is None else [int(r) for r in rows]
    positions = [positions] * B if isinstance(positions, int) else [int(p) for p in positions]
    position_tensor = torch.tensor(positions, device=device)[:, None]
    index = None if rows is None else torch.as_tensor(row_list, device=device)
    spans, mask = attention_spans(row_list, positions), None
    if pad and len(spans) > 1 and row_list == list(range(row_list[0], row_list[0] + B)):
        keys = max(positions) + 1
        spans = [(0, B, row_list[0], keys)]
        mask = (torch.arange(keys, device=device) <= position_tensor)[:, None, None, :]
    return model(tokens[:, None], position_tensor, cache, index, spans, mask)


def random_tokens(cfg, shape, device, n=8, seed=0):
    """A few fresh random token tensors to cycle through, so no call reuses the last input."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(cfg.vocab, shape, generator=g).to(device) for _ in range(n)]


def random_activations(cfg, shape, device, n=8, seed=0):
    """A few fresh random (shape..., hidden) inputs for the post's proxy, in its dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(*shape, cfg.hidden, generator=g).to(device, DTYPES[cfg.dtype])
            for _ in range(n)]


# -----------------------------------------------------------------------------
# device facts: which device, which dtype, how much memory, which attention backends
# Probes and checks made before anything large is allocated; calls the accounting.


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to PyTorch here")
    return torch.device(name)


# On CPU the matmul speed of each type depends on the chip: with AVX-512 BF16 (recent Xeons)
# bfloat16 is fast and float16 ~1000x slower; with AVX2 alone (most laptops, AMD before Zen 4)
# both 2-byte types fall back to paths 5-60x slower than float32 at a prefill's sizes, though
# not always at a decode's. So unless --dtype is given, the run takes the type a probe measures
# fastest over the shapes the run itself makes, a 2-byte type unless float32 beats it by more
# than DTYPE_PREFERENCE (half the bytes of weights and KV cache, and what GPUs serve in).
# A type's first call at a shape sets up its kernel and is never timed; the types take turns
# round by round (the order rotated), so a burst of other work falls on all of them alike, and
# each is compared with float32 within a round. Types within the rounds' noise of each other
# are tied, and a tie goes to the first of PROBE_DTYPES' 2-byte types: one answer per machine.
PROBE_DTYPES = ("float32", "bfloat16", "float16")

DTYPE_PREFERENCE = 1.1

PROBE_ROUNDS = 5  # timed rounds at each shape (the median taken, p10/p90 kept)

PROBE_EARLY_ROUNDS = 2  # rounds after which a type far behind leaves (both its calls slow)

PROBE_NOISE = 0.1  # scores this close (relative) are tied, and a fixed order decides

PROBE_DROP = 4.0  # a 2-byte type this much slower than the best at a shape is out (float32,
# never on a slow path, is always timed whole): its larger shapes are never run

PROBE_DECODE_WEIGHTS = 4  # a decode product reads four weights of 2^22 elements (64 MB in
# float32, 32 MB in a 2-byte type: past a laptop's cache in both, as a model's weights are)

PROBE_PREFILL_OUT = 1024  # a prefill product: one weight of this many output features


class ProbeShape(NamedTuple):
    rows: int      # tokens through the product (a decode's batch, a prefill's prompt)
    out: int       # output features of each weight
    weights: int   # weights multiplied in turn
    calls: int     # the run's timed shapes this product stands for
    weight: float  # its share of the run's time: calls x the model's weights over the probe's


def probe_shapes(run, width):
    """The products the run makes, smallest first: decode at A's batches (at each context) and
    B's and D's decode batches, prefill at B's lengths and D's prompt. A prefill reads all the
    model's weights at its rows, a decode step all of them at its batch: each shape's time is
    scaled by the model's weights over the probe's, so the totals weigh each where the run
    spends its time."""
    timed, calls = run.measurement, collections.Counter()
    if "A" in timed.experiments:
        calls.update({("decode", b): len(timed.contexts) for b in timed.batch_sizes})
    if "B" in timed.experiments:
        calls.update([("decode", b) for b in timed.decode_batches])
        calls.update([("prefill", t) for t in timed.prefill_lengths])
    if "D" in timed.experiments:
        calls.update([("decode", run.engine.engine_slots),
                      ("prefill", run.engine.engine_prompt_len)])
    shapes = []
    for (phase, rows), n in sorted(calls.items(), key=lambda kv: kv[0][1]):
        out, weights = ((2**22 // width, PROBE_DECODE_WEIGHTS) if phase == "decode" else
                        (PROBE_PREFILL_OUT, 1))
        shapes.append(ProbeShape(rows, out, weights, n, n * 2**24 / (out * weights * width)))
    return shapes


def call_ms(fn):
    """One call of fn() in ms, on the host's clock (the probes run on CPU alone)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved_ms(contenders, rounds=PROBE_ROUNDS, warm=True):
    """{name: fn} -> {name: [ms a round]}: each warmed with one untimed call (its kernel's
    set-up; warm=False: already done), then `rounds` rounds timing each once, the order
    rotated a step a round."""
    names = list(contenders)
    for name in names if warm else ():
        call_ms(contenders[name])
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(call_ms(contenders[name]))
    return times


def probe_dtypes(width, shapes):
    """F.linear in each type at each of shapes (see probe_shapes), smallest first, the types
    interleaved (see interleaved_ms). A 2-byte type whose PROBE_EARLY_ROUNDS calls at a shape
    are each PROBE_DROP times the fastest call there leaves the probe (its shape not counted),
    so a type on a 1000x slower path costs three calls. -> {dtype: [ms a round, per shape
    it finished]}"""
    g = torch.Generator(device="cpu").manual_seed(7)
    rounds = {name: [] for name in PROBE_DTYPES}
    timed = list(PROBE_DTYPES)
    for shape in shapes:
        ws = [torch.randn(shape.out, width, generator=g) * width ** -0.5
              for _ in range(shape.weights)]
        x = torch.randn(shape.rows, width, generator=g)
        cast = {name: ([w.to(DTYPES[name]) for w in ws], x.to(DTYPES[name])) for name in timed}
        fns = {name: functools.partial(lambda ws_, x_: [F.linear(x_, w) for w in ws_],
                                       *cast[name]) for name in timed}
        ms = interleaved_ms(fns, PROBE_EARLY_ROUNDS)
        fastest = min(min(ms[name]) for name in timed)
        timed = [name for name in timed
                 if name == "float32" or min(ms[name]) <= PROBE_DROP * fastest]
        more = interleaved_ms({name: fns[name] for name in timed},
                              PROBE_ROUNDS - PROBE_EARLY_ROUNDS, warm=False)
        for name in timed:
            rounds[name].append(ms[name] + more[name])
    return rounds


def choose_dtype(rounds, shapes):
    """The type the probe's rounds say (see probe_dtypes), with how sure. Each type's score:
    its total a round (its shapes' ms, weighted) over float32's in the same round, the median
    of the rounds (a burst in one round moves no median); float32's score DTYPE_PREFERENCE, so
    a 2-byte type wins unless float32 is that much faster. Scores within PROBE_NOISE of the
    best are tied, and the first tied of PROBE_DTYPES' 2-byte types, then float32, is chosen.
    -> {"chosen", "vs_float32": {dtype: median, p10, p90 or None (left the probe)}, "noise",
    "tied_with": the other tied types, "margin": the best untied score over the chosen's}"""
    weight = np.array([s.weight for s in shapes])
    totals = {d: weight @ np.array(r) for d, r in rounds.items() if len(r) == len(shapes)}
    ratios = {d: totals[d] / totals["float32"] for d in totals}
    score = {d: DTYPE_PREFERENCE if d == "float32" else float(np.median(q))
             for d, q in ratios.items()}
    best = min(score.values())
    tied = [d for d in PROBE_DTYPES[1:] + PROBE_DTYPES[:1]
            if d in score and score[d] <= best * (1 + PROBE_NOISE)]
    chosen = tied[0]
    untied = [score[d] / score[chosen] for d in score if d not in tied]
    return {"chosen": chosen, "noise": PROBE_NOISE, "tied_with": tied[1:],
            "margin": min(untied, default=None),
            "vs_float32": {d: median_spread(ratios[d]) if d in ratios else None
                           for d in PROBE_DTYPES}}


def median_spread(values):
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return {"median": float(p50), "p10": float(p10), "p90": float(p90)}


def with_probed_dtype(run):
    """On CPU with no --dtype, the run with the type probe_dtypes measures fastest here. In
    float32 the CPU preset (where it set the layers) keeps half its layers: a decode step then
    reads the bytes it reads in a 2-byte type, and the run takes the time it takes there."""
    if run.hardware.device != "cpu" or run.hardware.dtype_given:
        return run, None
    width = min(run.hardware.model.hidden, 1024)
    shapes = probe_shapes(run, width)
    rounds = probe_dtypes(width, shapes)
    probe = choose_dtype(rounds, shapes)
    chosen = probe["chosen"]
    model, preset = dataclasses.replace(run.hardware.model, dtype=chosen), run.hardware.preset
    if chosen == "float32" and f"layers={CPU_PRESET.layers}" in preset:
        layers = max(1, CPU_PRESET.layers // 2)
        model = dataclasses.replace(model, layers=layers)
        preset = tuple(f"layers={layers}" if p.startswith("layers=") else p for p in preset)
    return run.replace(model=model, preset=preset), {
        **probe, "preference": DTYPE_PREFERENCE, "rounds": PROBE_ROUNDS,
        "shapes": [s._asdict() for s in shapes],
        "ms": {d: [float(np.median(r)) for r in rounds[d]] for d in PROBE_DTYPES}}


LAYOUT_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the rows probe_layouts times both layouts at


@functools.lru_cache(maxsize=8)
def probe_layouts(width, dtype):
    """F.linear against W x^T (see linear) at each of LAYOUT_ROWS over four weights of the
    model's width, 64 MB in float32 (past a CPU's caches, as a model's are), interleaved as
    the dtype probe's types are (see interleaved_ms). The turn: the row count up to which W x^T
    makes the median round's total least; a turn within PROBE_NOISE of the least total is
    tied, and the smallest tied wins (0: F.linear throughout). -> {"rows", "linear_ms",
    "weight_first_ms" (medians), "weight_first_rows", "margin"}"""
    g = torch.Generator(device="cpu").manual_seed(11)
    weights = [torch.randn(2**22 // width, width, generator=g).to(DTYPES[dtype])
               for _ in range(4)]
    linear_ms, first_ms = [], []
    for rows in LAYOUT_ROWS:
        x = torch.randn(rows, width, generator=g).to(DTYPES[dtype])
        ms = interleaved_ms({"linear": lambda: [F.linear(x, w) for w in weights],
                             "first": lambda: [linear(x, w, rows) for w in weights]})
        linear_ms.append(ms["linear"])
        first_ms.append(ms["first"])
    lin, first = np.array(linear_ms), np.array(first_ms)  # (rows, rounds)
    totals = {0: np.median(lin.sum(0))}
    for i, rows in enumerate(LAYOUT_ROWS):
        totals[rows] = np.median(first[:i + 1].sum(0) + lin[i + 1:].sum(0))
    best = min(totals.values())
    turn = min(r for r, t in totals.items() if t <= best * (1 + PROBE_NOISE))
    return {"rows": list(LAYOUT_ROWS), "linear_ms": np.median(lin, 1).tolist(),
            "weight_first_ms": np.median(first, 1).tolist(), "weight_first_rows": turn,
            "margin": float(min((t for r, t in totals.items() if r != turn),
                                default=totals[turn]) / totals[turn])}


def with_probed_layout(run):
    """On CPU, where a model is built, the run with the matmul layout probe_layouts measures
    fastest here (see linear). -> (run, the probe or None)"""
    if run.hardware.device != "cpu" or not set(run.measurement.experiments) & set("ABD"):
        return run, None
    probe = probe_layouts(min(run.hardware.model.hidden, 1024), run.hardware.model.dtype)
    return run.replace(weight_first_rows=probe["weight_first_rows"]), probe


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()} x {os.cpu_count()})"


def cuda_index(device):
    """The CUDA device's index: torch 2.3 and 2.4 refuse a torch.device("cuda") with none in
    mem_get_info (ValueError; fixed in 2.5), so it is always given."""
    return device.index if device.index is not None else torch.cuda.current_device()


def free_memory_bytes(device):
    """Memory free for new allocations on the device (on CUDA, with what PyTorch's caching
    allocator holds but does not use); math.inf when the host cannot tell."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(cuda_index(device))[0] + cached
    return free_host_memory_bytes()


def check_cuda_arch(device):
    """One line when this PyTorch has no kernels for the device (e.g. an RTX 5080, sm_120,
    under a build for CUDA before 12.8): kernels for its sm, or PTX of an older one to JIT."""
    major, minor = torch.cuda.get_device_capability(device)
    sm, archs = major * 10 + minor, torch.cuda.get_arch_list()
    ptx = [int(a[8:]) for a in archs if a.startswith("compute_") and a[8:].isdigit()]
    if archs and f"sm_{sm}" not in archs and not any(p <= sm for p in ptx):
        raise UsageError(f"this PyTorch ({torch.__version__}, CUDA {torch.version.cuda}) has no "
                         f"kernels for the {torch.cuda.get_device_name(device)} (sm_{sm}; it "
                         f"has {' '.join(archs)}): install a build for a newer CUDA (sm_120, "
                         "the RTX 50 series, needs CUDA 12.8 or later)")


@functools.lru_cache(maxsize=4)
def grouped_mm_works(device, dtype):
    """Whether torch._grouped_mm (the MoE layer's grouped formulation) runs here in this dtype
    and agrees with a matmul per group over uneven groups, one of them empty: one tiny call.
    (On CUDA it needs a recent torch, sm90 or later and bfloat16; some builds run it
    elsewhere.)"""
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(7, 32, generator=g).to(device, dtype)
    w = torch.randn(3, 48, 32, generator=g).to(device, dtype)
    try:
        got = torch._grouped_mm(x, w.transpose(1, 2),
                                offs=torch.tensor([3, 3, 7], dtype=torch.int32, device=device))
    except Exception:  # (no kernel for this device or dtype: the loop runs instead)
        return False
    want = torch.cat((x[:3] @ w[0].T, x[3:] @ w[2].T))
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


# A layer's K (or V) view over a batch: batch x kv_heads x cached tokens x head_dim elements.
# Past 2^31 - 1 some attention kernels' 32-bit offsets overflow (A at batch 256 and 4,096
# tokens of context reaches 2^31 with the post's model), so such a row is skipped, not run.
VIEW_ELEMENTS_MAX = 2**31 - 1


def kv_view_elements(cfg, batch, cache_len):
    return 0 if cfg.arch == "post" else batch * cfg.n_kv_heads * cache_len * cfg.head_dim


def device_memory(device):
    """The DeviceMemory C's KV budget reads: a CUDA card's total bytes and name, or "cpu"."""
    if device.type != "cuda":
        return DeviceMemory("cpu")
    return DeviceMemory("cuda", torch.cuda.mem_get_info(cuda_index(device))[1],
                        device_name(device))


def fits(cfg, device, batch, cache_len, new_tokens, margin=0.9):
    """(fits, needed_bytes, free_bytes) for one step's cache and activations, before allocating."""
    needed = memory_needed_bytes(cfg, batch, cache_len, new_tokens)
    free = free_memory_bytes(device)
    return needed <= margin * free, needed, free


def check_memory(run, device, engine_lengths=None):
    """The model's weights with the least that A and B need (a batch-1 decode step) and, for
    D, its engine's KV cache, before anything is allocated: one line if it cannot fit. (A and B
    rows too large for what is left are marked as not fitting, not refused.)"""
    cfg = run.hardware.model
    weights = weight_bytes(cfg)
    need = weights + memory_needed_bytes(cfg, 1, run.measurement.context + 1, 1)
    what = "its weights"
    if cfg.experts and "A" in run.measurement.experiments:  # (A times its dense twin beside it)
        need += weight_bytes(dense_twin(cfg))
        what = "its weights and its dense twin's"
    if engine_lengths is not None:
        longest = run.engine.engine_prompt_len + int(engine_lengths.max())
        engine = weights + memory_needed_bytes(cfg, run.engine.engine_slots, longest,
                                               run.engine.engine_prompt_len) \
            + run.workload.num_prefixes * run.workload.prefix_len \
            * kv_bytes_per_token(cfg)  # (its prefix cache)
        if engine > need:
            need, what = engine, f"its weights and D's KV cache " \
                                 f"({run.engine.engine_slots} rows x {longest:,} tokens)"
    free = free_memory_bytes(device)
    if need > 0.9 * free:
        raise UsageError(f"the model ({cfg.name}, {param_count(cfg) / 1e9:.2f} B parameters): "
                         f"{what} need {gib(need)} but the device has {gib(free)} free; use a "
                         "smaller model or --slots, or --experiments C (it allocates nothing)")


def out_of_memory(error):
    """Whether an exception is an allocation the device (or host) could not make."""
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


# Every experiment's attention runs on backends that build no plan per shape: D's decode shapes
# change at nearly every step, and cuDNN's attention (PyTorch's first choice on Hopper from
# torch 2.5) plans each new shape, tens of ms to 0.4 s apiece, a cost D's step costs (timed on
# warmed shapes) never see; A, B and C's KV check run under the same policy, so that their
# tables compare the same kernels. Each records the kernels that ran.
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def sdpa_policy():
    """A context in which scaled_dot_product_attention may use SDPA_BACKENDS alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_BACKENDS])


def engine_attention(run, device):
    """Whether D's engine pads its decode attention: --engine-attention, or by default on CUDA,
    where one padded call beats a launch per span of rows."""
    return {"padded": True, "spans": False}.get(run.engine.engine_attention, device.type == "cuda")


# -----------------------------------------------------------------------------
# timing: one primitive for every measured region, and the ops a region ran


def percentile_summary(samples_ms):
    p10, p50, p90 = np.percentile(samples_ms, [10, 50, 90])
    return {"median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
            "mean_ms": float(np.mean(samples_ms)), "n": len(samples_ms)}


SLOW_CALL_SHARE = 0.2  # a call over this share of a shape's time budget is timed fewer times


def time_region(fn, device, warmup, reps, budget_s):
    """Median and p10/p90 of fn() in ms after `warmup` untimed calls.

    CUDA: events around each call. CPU: perf_counter. Repeats `reps` times or until `budget_s`
    of timed calls, whichever comes first, but at least 5 times; 3 times where one call takes
    over SLOW_CALL_SHARE of the budget and once where it takes the whole budget, so that no
    shape takes minutes ("few_reps" says so). Warm-up stops early once it has spent a third of
    the budget (a slow shape needs one call to warm, not three).
    """
    cuda = device.type == "cuda"
    t0, slowest_s = time.perf_counter(), 0.0
    for i in range(warmup):
        t_call = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        slowest_s = max(slowest_s, time.perf_counter() - t_call)
        if time.perf_counter() - t0 > budget_s / 3:
            break
    samples, spent = [], 0.0
    while len(samples) < reps:
        least = 5 if slowest_s <= SLOW_CALL_SHARE * budget_s else 3 if slowest_s <= budget_s \
            else 1
        if spent >= budget_s and len(samples) >= least:
            break
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t_call = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t_call) * 1e3
        samples.append(ms)
        spent += ms / 1e3
        slowest_s = max(slowest_s, ms / 1e3)
    summary = percentile_summary(samples)
    summary["few_reps"] = len(samples) < min(5, reps)
    return summary


def cuda_graph(fn):
    """Capture fn() into a CUDA graph (after warming it on a side stream); return a replay.
    The caller stream is current again afterwards whatever happens: torch.cuda.graph leaves
    its capture stream current where ending the capture raises. (A failed capture can leave
    the caching allocator mid-capture for the rest of the process on torch up to 2.11, so
    Bench.time begins none that capture_blocker refuses.)"""
    caller = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    caller.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        torch.cuda.set_stream(caller)
    return graph.replay  # the bound method keeps the graph (and its memory pool) alive


def capture_blocker(fn):
    """Why a CUDA graph cannot capture fn(), or None: one call under torch.cuda's sync debug
    mode "error" (a host sync raises, as it would break a capture), its ops logged (where a
    stand-in for torch.cuda runs, or none is available, the host syncs are seen there)."""
    debug = torch.cuda.is_available()  # (the sync debug mode needs CUDA; the ops log does not)
    previous = torch.cuda.get_sync_debug_mode() if debug else None
    try:
        with OpLog() as log:
            if debug:
                torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
            finally:
                if debug:
                    torch.cuda.set_sync_debug_mode(previous)
    except RuntimeError as e:
        return one_line(e)
    syncs = sorted(set(log.host_syncs()))
    return f"host syncs: {', '.join(syncs)}" if syncs else None


class OpLog:
    """The aten ops run inside it, by name (PyTorch's profiler, CPU-side events only), and the
    tensor methods that read a value on the host (HostReads): which attention kernel ran
    (PyTorch picks one per shape), and whether a step reads a device value on the host."""

    def __enter__(self):
        self.profile, self.methods = torch.autograd.profiler.profile(), HostReads()
        with quiet_stderr():  # (recent builds print a line to fd 2 as a profile starts)
            self.profile.__enter__()
        self.methods.__enter__()
        return self

    def __exit__(self, *exc):
        self.methods.__exit__(*exc)
        with quiet_stderr():  # (and as it stops)
            self.profile.__exit__(*exc)
        events = self.profile.function_events
        self.ops = [e.name.removeprefix("aten::") for e in events] + self.methods.seen
        self.host_ops = [e.name.removeprefix("aten::") for e in events
                         if not device_side(e)] + self.methods.seen

    def attention(self):
        """The attention kernels that ran (those named *attention*, less the dispatcher)."""
        return sorted({op for op in self.ops if "attention" in op
                       and op != "scaled_dot_product_attention"})

    def host_syncs(self):
        return [op for op in self.host_ops if op in HOST_SYNC_OPS]


def device_side(event):
    """Whether a profiled op runs inside one whose CUDA kernel reads its inputs on the device
    (DEVICE_SIDE_OPS), where a CPU fallback reads them on the host."""
    while event.cpu_parent is not None:
        event = event.cpu_parent
        if event.name.removeprefix("aten::") in DEVICE_SIDE_OPS:
            return True
    return False


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 sent to the null device for the block (C++ code prints there)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class HostReads(torch.overrides.TorchFunctionMode):
    """The tensor methods run inside it that hand a tensor's values to Python (.tolist(),
    .item(), int(), bool(), ...): on a CPU they record no aten op, on CUDA each syncs."""
    METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.METHODS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


# ops that read a device value on the host (a CUDA graph cannot capture them; eagerly they stall
# the stream): .item() and .tolist(), data-dependent shapes (bincount reads its input's range),
# a tensor made from host values
HOST_SYNC_OPS = {"item", "_local_scalar_dense", "nonzero", "masked_select", "unique",
                 "_unique2", "lift_fresh", "lift_fresh_copy", "bincount",
                 *HostReads.METHODS}

DEVICE_SIDE_OPS = {"_grouped_mm"}  # (its CPU fallback reads the group ends with .item())


def attention_kernel(device, dtype, query_shape, keys, causal=False, padded=False):
    """The attention kernel PyTorch runs for a query of query_shape (batch, heads, queries,
    head_dim) over `keys` keys under the backends allowed now: one call on random tensors of
    the shape (at most 8 rows), its ops logged."""
    batch, heads, queries, head_dim = query_shape
    g = torch.Generator(device="cpu").manual_seed(5)
    b = min(batch, 8)
    q = torch.randn(b, heads, queries, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(b, heads, keys, head_dim, generator=g).to(device, dtype)
            for _ in range(2))
    mask = torch.ones(b, 1, 1, keys, dtype=torch.bool, device=device) if padded else None
    with OpLog() as log:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return log.attention()


# -----------------------------------------------------------------------------
# experiments A and B: decode against batch and context, prefill against decode (device code)
# Each row is a timing (time_region) joined to its accounting (step_cost) under the measured
# ceilings: rates, intensity, MBU, MFU and the bound.


class Bench:
    """The model on its device, the measured ceilings, and the timing settings of A and B."""

    def __init__(self, run, device):
        self.run, self.cfg, self.device = run, run.hardware.model, device
        self.model = build_model(self.cfg, device, seed=run.workload.seed,
                                 weight_first_rows=run.hardware.weight_first_rows)
        graphs = run.measurement.graphs
        self.modes = ("eager", "graph") if graphs == "both" else (graphs,)

    def time(self, step, mode="eager", budget_s=None, feed=None):
        """Time feed() + step(), step as it is (eager) or replayed from a CUDA graph captured
        from it. feed, which copies fresh inputs into the buffers step reads, runs eagerly
        before every call, outside any graph: a graph replays the copies it captured, from
        the tensors it captured, so inside one every replay would see the same input."""
        run, failed = step, None
        if mode == "graph":  # (one that cannot be captured is timed eagerly, and says why)
            failed = capture_blocker(step)
            try:
                run = step if failed else cuda_graph(step)
            except RuntimeError as e:
                failed = one_line(e)

        def fn():
            if feed is not None:
                feed()
            run()
        timed = self.run.measurement
        timing = time_region(fn, self.device, timed.warmup, timed.reps,
                             budget_s or timed.time_budget_s)
        if failed:
            timing["graph_failed"] = failed
        timing["ran"] = "eager" if failed or mode == "eager" else "graph"  # (the mode it ran in)
        return timing

    def time_decode(self, batch, context, mode="eager", budget_s=None, low=None, pad=False):
        """One decode step of `batch` rows, each with `context` cached tokens (the post's proxy:
        `batch` tokens through its matmuls). Fresh random tokens are copied into a static input
        buffer before each step (one tiny copy, in both modes). low: the rows' contexts spread
        evenly from low to `context` instead (as in D's continuous engine), attended per span
        of rows at one position, or (pad) in one call padded to the longest row."""
        if self.cfg.arch == "post":
            inputs = random_activations(self.cfg, (batch,), self.device, seed=batch)
            x, next_x = inputs[0].clone(), itertools.cycle(inputs)
            return self.time(lambda: self.model(x), mode, budget_s,
                             feed=lambda: x.copy_(next(next_x)))
        cache = new_kv_cache(self.cfg, batch, context + 1, self.device)
        next_tokens = itertools.cycle(random_tokens(self.cfg, (batch,), self.device, seed=batch))
        tokens = next(next_tokens).clone()
        positions = context if low is None else \
            np.linspace(low, context, batch).round().astype(int).tolist()
        return self.time(lambda: decode_step(self.model, cache, tokens, positions, pad=pad),
                         mode, budget_s,
                         feed=lambda: tokens.copy_(next(next_tokens)))

    def time_prefill(self, tokens, batch=1, budget_s=None, mode="eager"):
        """A prefill of `batch` prompts of `tokens` tokens each into empty cache rows (the
        post's proxy: batch x tokens tokens through its matmuls), fresh prompts copied into a
        static input buffer before each, as for decode (so it can replay from a graph too)."""
        if self.cfg.arch == "post":
            inputs = random_activations(self.cfg, (batch, tokens), self.device, seed=tokens)
            x, next_x = inputs[0].clone(), itertools.cycle(inputs)
            return self.time(lambda: self.model(x), mode, budget_s,
                             feed=lambda: x.copy_(next(next_x)))
        cache = new_kv_cache(self.cfg, batch, tokens, self.device)
        prompts = random_tokens(self.cfg, (batch, tokens), self.device, seed=tokens)
        prompt, next_prompt = prompts[0].clone(), itertools.cycle(prompts)
        return self.time(lambda: prefill(self.model, cache, prompt), mode, budget_s,
                         feed=lambda: prompt.copy_(next(next_prompt)))

    def linear_chain(self, mode):
        """The model's own matmul weights as a bare chain of linear() calls at batch 1.

        The same weight bytes a batch-1 decode step reads, with nothing else around them: the
        rate a decode step could reach if the model added no work of its own.
        """
        linears = [m for m in self.model.modules() if isinstance(m, nn.Linear)]
        g = torch.Generator(device="cpu").manual_seed(1)
        inputs = [torch.randn(1, m.in_features, generator=g).to(self.device, m.weight.dtype)
                  for m in linears]

        def chain():
            for x, m in zip(inputs, linears):
                linear(x, m.weight, m.weight_first_rows)
        timing = self.time(chain, mode)
        weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        s = timing["median_ms"] / 1e3
        return {"mode": mode, "ran": timing["ran"], "step_ms": timing["median_ms"],
                "p10_ms": timing["p10_ms"], "p90_ms": timing["p90_ms"], "reps": timing["n"],
                "bytes": weight_bytes, "gbs": weight_bytes / s / 1e9}

    def skip_reason(self, batch, cache_len, new_tokens, margin=0.9, view=None):
        """None when the step fits the device's memory and its attention's views index in 32
        bits, else why not. view: the (rows, keys) the step's attention views, where fewer
        than the cache holds (default: all `batch` rows at `cache_len`)."""
        ok, needed, free = fits(self.cfg, self.device, batch, cache_len, new_tokens, margin)
        if not ok:
            return {"kind": "does_not_fit", "needed_gib": needed / 2**30,
                    "free_gib": free / 2**30}
        elements = kv_view_elements(self.cfg, *(view or (batch, cache_len)))
        if elements > VIEW_ELEMENTS_MAX:
            return {"kind": "view_too_large", "elements": elements, "limit": VIEW_ELEMENTS_MAX}
        return None


def timed_or_skipped(row, time_it):
    """row updated with time_it() (-> its fields), or marked skipped where the device ran out
    of memory (the caching allocator's spare blocks given back before the next row)."""
    try:
        row.update(time_it())
    except Exception as e:
        if not out_of_memory(e):
            raise
        row["skipped"] = {"kind": "out_of_memory", "error": one_line(e)}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


CEILING_MATMUL_SHARE = 1 / 40  # the ceilings' matmul grows until one product takes this share

# of a shape's time budget: 50 ms by default, 5 ms with --quick
CEILING_MATMUL_N = {"cuda": (1024, 16384), "cpu": (256, 4096)}  # (first, largest) size


def measure_ceilings(run, device, log):
    """The device's limits in the run's dtype: copy bandwidth and square-matmul throughput.

    Bandwidth: dst.copy_(src) over a buffer far past the last-level cache, counting bytes read
    plus written. Matmul: square products of random (never zero) operands, doubled in size
    until one takes CEILING_MATMUL_SHARE of the time budget (or the largest size is reached),
    each timed, the fastest
    rate kept: large enough to be fast, small enough to be timed in seconds on any device, and
    the best of several sizes (a CPU's matmul library is faster at some than at others).
    --peak-bandwidth-gbs / --peak-tflops replace a measurement.
    """
    dtype = DTYPES[run.hardware.model.dtype]
    cuda = device.type == "cuda"
    ceilings = {}
    if run.hardware.peak_bandwidth_gbs:
        ceilings.update(bandwidth_gbs=run.hardware.peak_bandwidth_gbs,
                        bandwidth_source={"kind": "given"})
    else:
        n_bytes = (2 if cuda else 0.25) * 2**30
        # fp32: the copy moves bytes. (On CPU a random 4 MB block is tiled across it: drawing
        # 0.25 GiB of normal numbers there takes 0.6 s, a copy of them 0.03 s.)
        n = int(n_bytes // 4)
        src = torch.randn(n, device=device) if cuda else torch.randn(2**20).repeat(n // 2**20)
        dst = torch.empty_like(src)
        timing = time_region(lambda: dst.copy_(src), device, run.measurement.warmup,
                             run.measurement.reps, run.measurement.time_budget_s)
        ceilings.update(bandwidth_gbs=2 * n_bytes / (timing["median_ms"] / 1e3) / 1e9,
                        bandwidth_source={"kind": "measured_copy", "gib": n_bytes / 2**30})
        del src, dst
    if run.hardware.peak_tflops:
        ceilings.update(matmul_tflops=run.hardware.peak_tflops, matmul_source={"kind": "given"})
    else:
        g = torch.Generator(device=device).manual_seed(2)  # (drawn where they are multiplied)
        n, largest = CEILING_MATMUL_N[device.type]
        best = (0.0, n)
        while True:
            a, b = (torch.randn(n, n, generator=g, device=device).to(dtype) for _ in range(2))
            timing = time_region(lambda: a @ b, device, run.measurement.warmup,
                                 run.measurement.reps, run.measurement.time_budget_s / 2)
            best = max(best, (2 * n**3 / (timing["median_ms"] / 1e3) / 1e12, n))
            del a, b
            if n >= largest or timing["median_ms"] / 1e3 >= CEILING_MATMUL_SHARE * \
                    run.measurement.time_budget_s:
                break
            n *= 2
        ceilings.update(matmul_tflops=best[0], matmul_source={
            "kind": "measured_matmul", "n": best[1], "dtype": run.hardware.model.dtype})
    ceilings["ridge_flop_per_byte"] = ceilings["matmul_tflops"] * 1e3 / ceilings["bandwidth_gbs"]
    log(f"ceilings: {ceilings['bandwidth_gbs']:.1f} GB/s, {ceilings['matmul_tflops']:.3g} "
        f"TFLOP/s")
    return ceilings


# A step that reaches under this share of both ceilings is bound by neither. On a GPU that is
# kernel launches and host work (eager decode on a fast card): "launch". On a CPU, "overhead":
# a matmul library far from its best at the shape (small batches on some chips), and host work.
LAUNCH_BOUND_SHARE = 0.25


def roofline_row(cfg, ceilings, timing, shape, cuda=False):
    """Timing + the accounting of the step it timed, of shape (batch, new tokens a row,
    context): rates, intensity, MBU, MFU and bound.

    MBU = achieved bytes/s (weights + KV cache + activations, the step_cost model) / measured
    bandwidth; MFU = achieved FLOP/s / measured matmul rate. The bound is the side of the
    ridge point (peak FLOP/s / peak bytes/s) the step's intensity falls on.
    """
    batch, new_tokens, context = shape
    cost = step_cost(cfg, batch, new_tokens, context)
    s = timing["median_ms"] / 1e3
    tokens = batch * new_tokens
    intensity = cost["flops"] / cost["bytes"]
    mbu = cost["bytes"] / s / 1e9 / ceilings["bandwidth_gbs"]
    mfu = cost["flops"] / s / 1e12 / ceilings["matmul_tflops"]
    bound = "memory" if intensity < ceilings["ridge_flop_per_byte"] else "compute"
    row = {"step_ms": timing["median_ms"], "p10_ms": timing["p10_ms"],
           "p90_ms": timing["p90_ms"], "reps": timing["n"],
           "few_reps": timing.get("few_reps", False),
           "tokens_per_s": tokens / s, "us_per_token": s * 1e6 / tokens,
           "tflops": cost["flops"] / s / 1e12, "gbs": cost["bytes"] / s / 1e9,
           "mbu": mbu, "mfu": mfu, "intensity": intensity,
           "bound": ("launch" if cuda else "overhead") if max(mbu, mfu) < LAUNCH_BOUND_SHARE
           else bound,
           "flops": cost["flops"], "bytes": cost["bytes"]}
    above = [k for k in ("mbu", "mfu") if row[k] > 1.0]
    if above:  # a ceiling measured too low, or an accounting that counts too much
        row["above_ceiling"] = above
    for key in ("graph_failed", "ran"):
        if key in timing:
            row[key] = timing[key]
    return row


def decode_row(bench, ceilings, batch, context, mode):
    row = {"batch": batch, "context": context, "mode": mode}
    reason = bench.skip_reason(batch, context + 1, 1)
    if reason:
        row["skipped"] = reason
        return row
    moe = [m for m in bench.model.modules() if isinstance(m, MoE)]
    for layer in moe:
        layer.reset_tally()
    row = timed_or_skipped(row, lambda: roofline_row(
        bench.cfg, ceilings, bench.time_decode(batch, context, mode), (batch, 1, context),
        bench.device.type == "cuda"))
    if moe and "skipped" not in row:  # (every timed step's mean, and the bytes it read)
        read, calls = np.sum([m.tallies() for m in moe], axis=0)
        touched = float(read / calls)
        row.update(experts_touched=touched, experts_expected=experts_touched(bench.cfg, batch),
                   bytes_read=moe_step_bytes(bench.cfg, batch, context, touched))
    return row


def prefill_row(bench, ceilings, tokens, mode):
    row = {"phase": "prefill", "tokens": tokens, "batch": 1, "context": 0, "mode": mode}
    reason = bench.skip_reason(1, tokens, tokens)
    if reason:
        row["skipped"] = reason
        return row
    return timed_or_skipped(row, lambda: roofline_row(
        bench.cfg, ceilings, bench.time_prefill(tokens, mode=mode), (1, tokens, 0),
        bench.device.type == "cuda"))


def run_decode_sweep(bench, ceilings, log):
    """A: decode step time and throughput against batch size, at each context, each mode."""
    run = bench.run
    rows = []
    for context in run.measurement.contexts:
        for mode in bench.modes:
            for batch in run.measurement.batch_sizes:
                rows.append(decode_row(bench, ceilings, batch, context, mode))
                log(f"A context {context} {mode} batch {batch}: " + row_progress(rows[-1]))
            group = [r for r in rows if r["context"] == context and r["mode"] == mode]
            base = next((r for r in group if r["batch"] == 1 and "skipped" not in r), None)
            for r in measured(group):
                if base:
                    r["throughput_vs_1"] = r["tokens_per_s"] / base["tokens_per_s"]
                    r["wait_vs_1"] = r["step_ms"] / base["step_ms"]
                if base and "bytes_read" in r:  # (a mixture of experts: the bytes it read)
                    r["bytes_vs_1"] = r["bytes_read"] / base["bytes_read"]
    crossover = {str(c): kv_crossover_batch(bench.cfg, c) for c in run.measurement.contexts}
    largest = max(measured(rows), key=lambda r: r["batch"] * r["context"], default=None)
    twin = dense_twin_sweep(bench, ceilings, rows, log) if bench.cfg.experts else {}
    return {"context": run.measurement.context, "contexts": list(run.measurement.contexts),
            "modes": list(bench.modes),
            "kv_crossover_batch": crossover, "rows": rows, **twin, **attention_policy(
                largest and decode_kernel(bench, largest["batch"], largest["context"] + 1))}


def dense_twin_sweep(bench, ceilings, rows, log):
    """A for a mixture of experts: its dense twin (see dense_twin) timed at the same batches,
    at A's context in A's last mode, each in the mode the MoE row really ran in (eager where
    the MoE step could not be captured), its time beside the MoE row's (dense_twin_ms) only
    where both ran in one mode."""
    run, mode = bench.run, bench.modes[-1]
    twin = Bench(run.replace(model=dense_twin(bench.cfg)), bench.device)
    moe_rows = {r["batch"]: r for r in rows
                if r["context"] == run.measurement.context and r["mode"] == mode}
    by_batch = {}
    for batch in run.measurement.batch_sizes:
        ran = moe_rows.get(batch, {}).get("ran", mode)
        row = by_batch[batch] = decode_row(twin, ceilings, batch, run.measurement.context, ran)
        log(f"A dense twin {ran} batch {batch}: " + row_progress(row))
    for r in moe_rows.values():
        twin_row = by_batch.get(r["batch"], {})
        if "step_ms" in twin_row and twin_row.get("ran") == r.get("ran"):
            r["dense_twin_ms"] = twin_row["step_ms"]
    return {"dense_twin": {"model": twin.cfg.name, "ffn": twin.cfg.ffn,
                           "params": param_count(twin.cfg), "rows": list(by_batch.values())}}


def decode_kernel(bench, batch, keys, pad=False):
    """The attention kernel of a decode step over `keys` cached tokens (None: no attention)."""
    cfg = bench.cfg
    if cfg.arch == "post":
        return None
    return attention_kernel(bench.device, DTYPES[cfg.dtype], (
        batch, cfg.n_kv_heads, cfg.heads // cfg.n_kv_heads, cfg.head_dim), keys, padded=pad)


def prefill_kernel(bench, tokens):
    cfg = bench.cfg
    if cfg.arch == "post":
        return None
    return attention_kernel(bench.device, DTYPES[cfg.dtype],
                            (1, cfg.heads, tokens, cfg.head_dim), tokens, causal=True)


def attention_policy(*kernels):
    """What results.json says of an experiment's attention: the backends allowed and the
    kernels that ran at its largest shapes."""
    return {"sdpa_backends": list(SDPA_BACKENDS),
            "kernels": sorted({k for ks in kernels if ks for k in ks})}


def run_prefill_decode(bench, ceilings, log):
    """B: prefill of whole prompts against decode of one token alone and in a batch."""
    run = bench.run
    rows = []
    for mode in bench.modes:  # (C prices prefill and decode from one mode: both are timed in each)
        for tokens in run.measurement.prefill_lengths:
            rows.append(prefill_row(bench, ceilings, tokens, mode))
            log(f"B prefill {mode} {tokens}: " + row_progress(rows[-1]))
    chain = []
    for mode in bench.modes:
        # the bare chain right before the decodes, so both see the machine in the same state
        chain.append(bench.linear_chain(mode))
        log(f"B linear chain {mode}: {chain[-1]['step_ms']:.3f} ms, {chain[-1]['gbs']:.1f} GB/s")
        for batch in run.measurement.decode_batches:
            rows.append({"phase": "decode", "tokens": 1,
                         **decode_row(bench, ceilings, batch, run.measurement.context, mode)})
            log(f"B decode {mode} x{batch}: " + row_progress(rows[-1]))
    longest = max((r["tokens"] for r in measured(rows) if r["phase"] == "prefill"), default=None)
    return {"rows": rows, "linear_chain": chain, **attention_policy(
        longest and prefill_kernel(bench, longest),
        decode_kernel(bench, max(run.measurement.decode_batches), run.measurement.context + 1))}


def row_progress(row):
    if "skipped" in row:
        return describe(TEXT["en"], row["skipped"])
    return f"{row['step_ms']:.3f} ms (p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f}, " \
           f"{row['reps']} reps)"


def kv_device_check(bench, kv):
    """Allocate the KV cache C's budget holds, as rows of the longest sequence that fits (at
    least one row per request running at the peak of the continuous schedule), and time one
    decode step over the first rows, each at the context its request had at the peak."""
    cfg, contexts = bench.cfg, kv["peak"]["contexts"]
    batch = len(contexts)
    row_tokens = min(kv["budget_tokens"] // batch, cfg.max_positions)
    n_rows = max(batch, kv["budget_tokens"] // row_tokens)
    positions = [min(c, row_tokens) - 1 for c in contexts]  # the token each row decodes next
    clamped = sum(c > row_tokens for c in contexts)
    check = {"device": device_name(bench.device), "rows": n_rows, "batch": batch,
             "row_tokens": row_tokens, "bytes": n_rows * row_tokens * kv_bytes_per_token(cfg),
             "clamped_rows": clamped, "max_context": max(contexts)}
    # the whole cache must fit (the budget has its margin); the step's views span its first
    # `batch` rows (each view's strides run over a whole row of row_tokens)
    reason = bench.skip_reason(n_rows, row_tokens, 1, margin=1.0, view=(batch, row_tokens))
    if reason:
        check["skipped"] = reason
        return check
    pad = engine_attention(bench.run, bench.device)  # (attending as D's engine does)
    check.update(attention="padded" if pad else "spans",
                 kernel=decode_kernel(bench, batch, max(positions) + 1, pad))

    def time_it():
        cache = new_kv_cache(cfg, n_rows, row_tokens, bench.device)
        next_tokens = itertools.cycle(random_tokens(cfg, (batch,), bench.device, seed=batch))
        timing = time_region(lambda: decode_step(bench.model, cache, next(next_tokens),
                                                 positions, pad=pad),
                             bench.device, bench.run.measurement.warmup,
                             min(bench.run.measurement.reps, 10),
                             bench.run.measurement.time_budget_s)
        return {"step_ms": timing["median_ms"], "p10_ms": timing["p10_ms"],
                "p90_ms": timing["p90_ms"]}
    return timed_or_skipped(check, time_it)


# -----------------------------------------------------------------------------
# experiment D: a real serving engine on the model, against C's simulation (device code)
# A queue of requests, `slots` rows of one static KV cache, and a scheduler that picks who runs
# each step. The running requests always occupy rows 0..B-1 (a finished request's row is
# refilled by moving the last row into it), so a decode step reads views of the cache, and
# rows admitted together share a position and one attention span.


class EngineRequests(NamedTuple):
    """What D's engine serves. prompts: (n, P) tokens on the model's device; output_lens:
    tokens each request generates (exactly that many: end-of-sequence is ignored, as serving
    benchmarks do); arrival_s: each one's arrival on the wall clock, seconds after the start
    (None: all at once); prefix: an EnginePrefix, whose system prompts' K/V the engine keeps
    once computed (None: every prompt prefilled whole)."""
    prompts: torch.Tensor
    output_lens: list
    arrival_s: object = None
    prefix: object = None


def run_engine(model, cache, requests, policy, pad=False, order=None):
    """Serve every request (EngineRequests) under `policy` ("static" or "continuous"),
    greedily. Requests wait in the simulation's own queue (order: an Order; None: first come,
    first served), each from its arrival on the wall clock. Each step admits waiting requests
    into free rows (continuous: every step; static: only once the batch has emptied), prefills
    them (the prefill emits their first token), then decodes every other running request one
    token. pad: a decode whose rows sit at several positions attends in one call padded to the
    longest row (see decode_step).
    -> generated tokens per request, and a log: every pass timed, every step's time and
    occupancy, and log["times"], a RequestTimes: per request the seconds (from the run's start)
    of its admission, first token and last, and the steps of those two tokens.
    """
    return Engine(model, cache, requests, policy, pad, order).serve()


class EnginePrefix:
    """D's prefix cache: request r opens with system prompt system[r] (its first `tokens`
    prompt tokens; -1: none). The K/V of a system prompt is kept from the first row that
    computed it, as the step that prefilled it ends (so requests prefilled in one step do not
    share, as in vLLM and in C's PrefixCache); a later newcomer opening with it has that K/V
    copied into its row and prefills only the rest of its prompt."""

    def __init__(self, system, tokens):
        self.system, self.tokens, self.kv = [int(s) for s in system], tokens, {}

    def hit(self, r):
        """Prompt tokens of request r found cached now."""
        return self.tokens if self.system[r] in self.kv else 0

    def load(self, cache, r, row):
        cache[:, :, row, :, :self.tokens].copy_(self.kv[self.system[r]])

    def keep(self, cache, r, row):
        """Row `row` has just computed request r's prompt: keep its system prompt's K/V."""
        s = self.system[r]
        if s >= 0 and s not in self.kv:
            self.kv[s] = cache[:, :, row, :, :self.tokens].clone()


class Engine:
    """D's engine (see run_engine). Each step is admit, forward, retire, as the simulation's is
    plan and commit: admission from the simulation's own queue, then the passes on the device,
    then the tokens recorded and the finished requests' rows refilled."""

    def __init__(self, model, cache, requests, policy, pad, order):
        prompts, output_lens, arrival_s, self.prefix = requests
        self.model, self.cache, self.prompts, self.policy, self.pad = model, cache, prompts, \
            policy, pad
        self.device, self.prompt_len = prompts.device, prompts.shape[1]
        self.slots, n = cache.shape[2], len(output_lens)
        self.output_lens = list(output_lens)
        arrival = np.zeros(n) if arrival_s is None else np.asarray(arrival_s, dtype=np.float64)
        self.ledger = Ledger(Requests(arrival, np.full(n, self.prompt_len),
                                      np.asarray(output_lens)))
        self.waiting = waiting_queue(self.ledger, range(n), order)
        self.generated = [[] for _ in output_lens]
        self.running, self.position = [], []  # the request and next position of each row
        self.next_token = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.elog = {"t_s": [], "running": [], "prefill_s": 0.0, "decode_s": 0.0,
                    "attention_calls": 0, "decode_steps": 0, "padded_decode_steps": 0,
                    "passes": [],  # (tokens, cached tokens, seconds)
                    "prefill_passes": [],  # their indices in passes
                    "hit_tokens": [0] * n, "idle_s": 0.0}

    def serve(self):
        self.sync()
        self.t0 = time.perf_counter()
        while self.waiting or self.running:
            new = self.admit()
            if new is None:  # (nothing ran: it waited for the next arrival)
                continue
            self.retire(self.forward(new))
        self.sync()
        self.elog["wall_s"] = time.perf_counter() - self.t0
        self.elog["times"] = self.ledger.times()  # (its times on the wall clock from t0)
        return self.generated, self.elog

    def admit(self):
        """Waiting requests into free rows (continuous: at every step; static: once the batch
        has emptied). -> the newcomers, or None after idling to the next arrival."""
        new = []
        if self.policy == "continuous" or not self.running:
            now = time.perf_counter() - self.t0
            while len(self.running) + len(new) < self.slots:
                r = self.waiting.head(now)
                if r is None:
                    break
                self.waiting.pop()
                new.append(r)
                self.ledger.start[r] = now
            if not self.running and not new:  # nothing runs: wait for the next arrival
                pause = max(self.waiting.next_arrival() - now, 0.0)
                time.sleep(pause)
                self.elog["idle_s"] += pause
                return None
        return new

    def forward(self, new):
        """Prefill the newcomers into rows old..old+k-1 (the prefill emits their first tokens):
        those with nothing cached first, then those whose system prompt is; then one decode
        step for everyone else, each row at its own position; each pass timed. -> the
        newcomers in the order of their rows."""
        old, elog, P, prefix = len(self.running), self.elog, self.prompt_len, self.prefix
        cached = [prefix.hit(r) if prefix else 0 for r in new]
        groups = [[r for r, c in zip(new, cached) if c == hit] for hit in sorted(set(cached))]
        for hit, group in zip(sorted(set(cached)), groups):
            self.prefill_rows(group, hit)
        if prefix:  # (as the step ends: its newcomers did not share)
            for row, r in enumerate(self.running[old:], old):
                prefix.keep(self.cache, r, row)
        if old:
            t_pass = time.perf_counter()
            positions = self.position[:old]
            logits = decode_step(self.model, self.cache, self.next_token[:old], positions,
                                 pad=self.pad)
            spans = len(attention_spans(range(old), positions))
            padded = self.pad and spans > 1
            elog["attention_calls"] += 1 if padded else spans
            elog["padded_decode_steps"] += padded
            elog["decode_steps"] += 1
            self.next_token[:old] = logits.argmax(-1)
            self.position[:old] = [p + 1 for p in positions]
            self.sync()
            elog["passes"].append((old, sum(positions), time.perf_counter() - t_pass))
            elog["decode_s"] += elog["passes"][-1][2]
        return self.running[old:]

    def prefill_rows(self, group, hit):
        """Prefill requests `group` into the next free rows, each with `hit` prompt tokens
        cached (copied into its row first, with the copy timed as part of the pass)."""
        old, elog, P = len(self.running), self.elog, self.prompt_len
        t_pass = time.perf_counter()
        rows = torch.arange(old, old + len(group), device=self.device)
        for row, r in enumerate(group, old):
            if hit:
                self.prefix.load(self.cache, r, row)
            elog["hit_tokens"][r] = hit
        logits = prefill(self.model, self.cache, self.prompts[group][:, hit:], rows, hit)
        self.next_token[old:old + len(group)] = logits.argmax(-1)
        self.running += group
        self.position += [P] * len(group)
        self.sync()
        elog["prefill_passes"].append(len(elog["passes"]))
        elog["passes"].append((len(group) * (P - hit), len(group) * hit,
                               time.perf_counter() - t_pass))
        elog["prefill_s"] += elog["passes"][-1][2]

    def retire(self, new):
        """Record the step's tokens and times, and move the last row into each finished one."""
        running, position, elog, ledger = self.running, self.position, self.elog, self.ledger
        for r, token in zip(running, self.next_token[:len(running)].tolist()):
            self.generated[r].append(token)
        now, step = time.perf_counter() - self.t0, len(elog["t_s"]) + 1
        elog["t_s"].append(now)
        elog["running"].append(len(running))
        for r in new:
            ledger.first_step[r], ledger.first_token[r] = step, now
        finished = [i for i, r in enumerate(running)
                    if len(self.generated[r]) == self.output_lens[r]]
        for row in reversed(finished):
            ledger.finish_step[running[row]], ledger.finish[running[row]] = step, now
            last = len(running) - 1
            if row != last:
                m = position[last]
                self.cache[:, :, row, :, :m].copy_(self.cache[:, :, last, :, :m])
                self.next_token[row] = self.next_token[last]
                running[row], position[row] = running[last], position[last]
            running.pop()
            position.pop()


# -----------------------------------------------------------------------------
# D against C: its requests, its step costs timed, its runs beside C's simulation of them
# (device code)
# What D serves, the prices it is predicted with, and the verdict: steps, seconds, speedup
# and, with system prompts, what its prefix cache saved.


def engine_requests(run):
    """D's requests: output lengths of C's law (divided by --engine-shrink, at least 1), and
    their arrivals (--rate: Poisson, on the wall clock; else all at once)."""
    n, P = run.engine.engine_requests, run.engine.engine_prompt_len
    need, free = n * (P + 32) * 8, free_host_memory_bytes()
    if need > 0.5 * free:  # its prompts, and a list of tokens for each
        raise UsageError(f"D: {n:,} requests of {P:,} prompt tokens would need about "
                         f"{gib(need)} of memory, and {gib(free)} is free")
    lengths = np.maximum(lognormal_lengths(n, run.workload.seed) // run.engine.engine_shrink, 1)
    rng = random_stream(run, "engine_arrivals")
    arrival = arrival_times(n, run.workload.rate, run.workload.burstiness, rng) \
        if isinstance(run.workload.rate, float) else None
    return lengths, arrival


def check_engine(run, lengths):
    """D's requests must fit the model's positions; its system prompts (which open its
    prompts, --prompt-len tokens of their own following) must be whole blocks."""
    if run.workload.prefix_len % run.scheduler.block_tokens:
        raise UsageError(f"D: --prefix-len {run.workload.prefix_len} must be whole blocks of "
                         f"--block-tokens {run.scheduler.block_tokens}, as the engine keeps them")
    longest = run.engine.engine_prompt_len + int(lengths.max())
    if longest > run.hardware.model.max_positions:
        raise UsageError(f"D: a request of {longest:,} tokens (prompt "
                         f"{run.engine.engine_prompt_len} + output {lengths.max():,}) exceeds "
                         "--max-positions "
                         f"{run.hardware.model.max_positions:,}")


def engine_costs(bench, prompt_len, pad):
    """D's step costs, measured here with the engine's own passes: decode steps by batch, each
    also at a longer context (the cost of a cached token), and batched prefills of whole
    prompts, half the usual time per shape. They are fitted on each shape's mean, not its
    median: the engine's wall time is a sum of steps, and a sum grows with the mean.

    A continuous batch holds rows at many positions, so it is also priced as it runs: each
    batch's rows spread evenly over the contexts from the prompt to the longer one, attended
    per span (each row its own: a call per row, an upper bound on the engine's) or, with pad,
    in one padded call (its cost per cached token then carries the padding read).
    -> (costs of one-span decodes, costs of spread decodes, the timed rows)"""
    run, budget_s = bench.run, bench.run.measurement.time_budget_s / 2
    long_context = min(prompt_len + 512, bench.cfg.max_positions - 1)
    batches = sorted({1, max(1, run.engine.engine_slots // 4), run.engine.engine_slots})

    def row(t, **shape):
        return {**shape, "step_ms": t["mean_ms"], "median_ms": t["median_ms"],
                "p10_ms": t["p10_ms"], "p90_ms": t["p90_ms"]}
    decode = [row(bench.time_decode(batch, context, budget_s=budget_s), batch=batch,
                  context=context, spread=False, padded=False)
              for batch in batches for context in (prompt_len, long_context)]
    decode += [row(bench.time_decode(b, long_context, budget_s=budget_s, low=prompt_len,
                                     pad=pad), batch=b, context=(prompt_len + long_context) / 2,
                   spread=True, padded=pad)
               for b in batches if b > 1]  # (a single row has nothing to spread)
    prefills = [row(bench.time_prefill(prompt_len, batch, budget_s=budget_s), batch=batch,
                    tokens=batch * prompt_len, spread=False, padded=False)
                for batch in sorted({1, run.engine.engine_slots})]
    source = {"kind": "pricing_engine", "device": device_name(bench.device)}
    one_span = fit_step_costs([r for r in decode if not r["spread"]], prefills, prompt_len,
                              0.0, source)
    # the spread rows, the same batches at the prompt's context, and the single row
    spread = fit_step_costs([r for r in decode if r["spread"] or r["batch"] == 1
                             or r["context"] == prompt_len], prefills, prompt_len, 0.0, source)
    return one_span, spread, decode + prefills


def latencies(times):
    """A run's makespan and its requests' TTFT and E2E, p50 and p90 (RequestTimes.summary's)."""
    summary = times.summary()
    ttft, e2e = summary["ttft_s"], summary["e2e_s"]
    return {"makespan_s": summary["makespan_s"], "ttft_p50_s": ttft["p50"],
            "ttft_p90_s": ttft["p90"], "e2e_p50_s": e2e["p50"], "e2e_p90_s": e2e["p90"]}


def steps_check(engine_times, sim_times):
    """Every request's first-token step and finish step, the engine's against the
    simulation's; the first request where they differ."""
    engine = np.array([engine_times.first_step, engine_times.finish_step])
    simulated = np.array([sim_times.first_step, sim_times.finish_step])
    differ = np.flatnonzero((engine != simulated).any(axis=0))
    check = {"requests": engine.shape[1], "agree": int(engine.shape[1] - len(differ))}
    if len(differ):
        r = int(differ[0])
        check["first_mismatch"] = {"request": r, "engine": engine[:, r].tolist(),
                                   "simulated": simulated[:, r].tolist()}
    return check


def run_serving_engine(bench, lengths, arrival, log):
    """D: serve the requests under each policy for real and set C's simulation of the same
    requests beside the run: the step at which each request emits its first token and its last
    (equal when all wait at t=0: both are deterministic), and its latencies in seconds,
    predicted twice: priced with step costs timed just before (the cost model's test: does
    timing passes predict a run?) and priced with the run's own passes (the scheduling
    model's test, free of the machine's drift between timing and running)."""
    run, cfg, device = bench.run, bench.cfg, bench.device
    n, P, slots = len(lengths), run.engine.engine_prompt_len, run.engine.engine_slots
    pad = engine_attention(run, device)
    one_span, spread, cost_rows = engine_costs(bench, P, pad)
    for name, costs in (("one span", one_span), ("spread", spread)):
        log_step_costs(log, name, costs)
    lengths, divisor, priced_s = bounded_lengths(run, lengths, arrival, one_span, spread)
    if divisor > 1:
        log(f"D: priced at {priced_s[0]:.0f} s for both runs, past D's bound of "
            f"{ENGINE_BOUND_S:.0f} s: outputs divided by {divisor} more ({priced_s[1]:.0f} s)")
    system = engine_system_prompts(run, arrival, lengths)
    prompts = engine_prompts(run, cfg.vocab, n, system).to(device)
    cache = new_kv_cache(cfg, slots, P + max(int(lengths.max()), 2), device)
    warm = min(2, n, slots)  # warm the engine: a prefill and a decode step
    run_engine(bench.model, cache, EngineRequests(prompts[:warm], [2] * warm), "continuous", pad)
    at_zero = arrival is None
    req = Requests(np.zeros(n) if at_zero else arrival, np.full(n, P), lengths)
    replica = Replica(slots, one_span, order=run_order(run, lengths))
    result = {"requests": n, "slots": slots, "prompt_tokens": P,
              "shrink": run.engine.engine_shrink * divisor,
              "bound": {"bound_s": ENGINE_BOUND_S, "priced_s": priced_s[0],
                        "shrunk_by": divisor, "priced_shrunk_s": priced_s[1]},
              "lengths": {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
                          "max": int(lengths.max()), "total": int(lengths.sum())},
              "order": order_info(replica.order, lengths, run.workload.seed),
              "arrivals": arrivals(run) if not at_zero else {"kind": "arrivals_zero"},
              "attention": "padded" if pad else "spans",
              **attention_policy(decode_kernel(bench, slots, P + int(lengths.max()), pad)),
              "cost_model": {**one_span.as_dict(), "rows": cost_rows},
              "cost_model_spread": spread.as_dict()}
    runs = [("static", None), ("continuous", None)]
    if system is not None:  # the continuous run again, with its prefix cache
        runs.append(("prefix", EnginePrefix(system, run.workload.prefix_len)))
    for name, prefix in runs:
        policy = "continuous" if prefix else name
        generated, elog = run_engine(bench.model, cache, EngineRequests(
            prompts, lengths.tolist(), arrival, prefix), policy, pad, replica.order)
        served = req if not prefix else dataclasses.replace(req, identity=SharedPrompts(
            system, np.full(run.workload.num_prefixes, run.workload.prefix_len), np.full(n, -1)))
        kv = KVBudget("prefix", math.inf, run.scheduler.block_tokens) if prefix else None
        result[name] = d = engine_against_simulation(
            served, elog, dataclasses.replace(replica, scheduler=policy, kv=kv), spread, at_zero)
        log(f"D {name}: {d['wall_s']:.2f} s measured, {d['predicted']['wall_s']:.2f} s "
            f"predicted ({np.max(d['per_request']['passes_finish_s']):.2f} s with its own "
            f"passes), {d['steps']} steps")
        if prefix:
            result["prefix_check"] = prefix_check(result, elog, generated, plain, run)
        plain = generated
    result["speedup_measured"] = result["static"]["wall_s"] / result["continuous"]["wall_s"]
    result["speedup_predicted"] = (result["static"]["predicted"]["wall_s"]
                                   / result["continuous"]["predicted"]["wall_s"])
    result["verdict"] = engine_verdict(result)
    return result


def log_step_costs(log, name, costs):
    knots = ", ".join(f"{k}: {1e3 * v:.1f}" for k, v in zip(costs.tokens, costs.seconds))
    per_token = ", ".join(f"{b}: {1e6 * v:.2f}" for b, v in costs.kv_by_batch)
    log(f"D step costs ({name}), ms by tokens per pass: {knots}; µs per cached token by "
        f"batch: {per_token}")


def engine_prompts(run, vocab, n, system):
    """D's prompts, random tokens on the CPU; each system prompt's tokens open every prompt
    it opens (system: see engine_system_prompts)."""
    g = torch.Generator(device="cpu").manual_seed(seed_for(run, "prompts"))
    prompts = torch.randint(vocab, (n, run.engine.engine_prompt_len), generator=g)
    if system is not None:
        texts = torch.randint(vocab, (run.workload.num_prefixes, run.workload.prefix_len),
                              generator=g)
        prompts[system >= 0, :run.workload.prefix_len] = texts[system[system >= 0]]
    return prompts


def engine_system_prompts(run, arrival, lengths):
    """D's system prompts (--prefix-len): the one opening each request (-1: none), drawn as C
    draws them (shared_prompts), or None where D's prompts share nothing."""
    if not run.workload.prefix_len:
        return None
    n = len(lengths)
    work = run.workload
    prefix = PrefixWorkload(work.prefix_len, work.num_prefixes, work.prefix_share,
                            work.prefix_zipf)
    opened = shared_prompts(Requests(np.zeros(n) if arrival is None else arrival, np.zeros(n),
                                     lengths), prefix,
                            random_stream(run, "prefixes"))
    return np.asarray(opened.identity.system)


def prefix_check(result, elog, generated, plain, run):
    """D with its prefix cache against the plain continuous run of the same prompts: tokens
    identical, prompt tokens found cached (engine and C), and the seconds caching saved,
    measured and as C's simulation predicted them (each run priced beforehand)."""
    cached, plain_run = result["prefix"], result["continuous"]
    saved = plain_run["wall_s"] - cached["wall_s"]
    predicted = plain_run["predicted"]["wall_s"] - cached["predicted"]["wall_s"]
    return {"tokens_identical": generated == plain, "prefix_tokens": run.workload.prefix_len,
            "prompt_tokens": result["requests"] * result["prompt_tokens"],
            "hit_tokens": int(sum(elog["hit_tokens"])),
            "hit_tokens_simulated": cached.get("hit_tokens_simulated"),
            "saved_s": saved, "saved_predicted_s": predicted,
            "off": saved / predicted - 1 if predicted > 0 else None,
            "within": predicted > 0 and abs(saved / predicted - 1) <= 0.15}


# D's two runs together, priced beforehand with the step costs just timed, may take this long:
# past it the outputs shrink (a mixture of experts run eagerly on CUDA: 0.4-0.6 s a step at
# 48 layers, over an hour for the post's requests as they are)
ENGINE_BOUND_S = 120.0


def bounded_lengths(run, lengths, arrival, one_span, spread):
    """D's output lengths within ENGINE_BOUND_S: both policies' runs priced by C's simulation
    with the costs just timed (static one-span, continuous spread), the outputs divided until
    they fit. -> (lengths, divisor, (priced s as given, priced s as run)); a one-line error
    where outputs of a token each would still take longer."""
    n, P = len(lengths), run.engine.engine_prompt_len
    arrival = np.zeros(n) if arrival is None else arrival

    def priced(out):
        req = Requests(arrival, np.full(n, P), out)
        replica = Replica(run.engine.engine_slots, one_span, order=run_order(run, out))
        return sum(float(simulate_serving(req, dataclasses.replace(
            replica, scheduler=policy, costs=costs))["times"].finish.max())
            for policy, costs in (("static", one_span), ("continuous", spread)))
    first = seconds = priced(lengths)
    divisor, shrunk = 1, lengths
    while seconds > ENGINE_BOUND_S:
        if shrunk.max() == 1:
            raise RuntimeError(f"D would take {seconds:.0f} s priced with its step costs even "
                               f"with one-token outputs, past its bound of "
                               f"{ENGINE_BOUND_S:.0f} s: give fewer --engine-requests")
        divisor = max(2 * divisor, math.ceil(divisor * seconds / ENGINE_BOUND_S))
        shrunk = np.maximum(lengths // divisor, 1)
        seconds = priced(shrunk)
    return shrunk, divisor, (first, seconds)


def engine_against_simulation(req, elog, replica, spread, at_zero):
    """One policy's engine run (elog) beside the simulation of the same requests on a replica
    priced with the one-span costs, or with the spread ones where the run's rows sat at
    several positions, and on one priced with the run's own passes."""
    several = elog["attention_calls"] > elog["decode_steps"] or elog["padded_decode_steps"]
    if several:
        replica = dataclasses.replace(replica, costs=spread)
    sim = simulate_serving(req, replica)
    replay = simulate_serving(req, dataclasses.replace(
        replica, costs=fit_passes(elog["passes"], {"kind": "pricing_passes"})))
    passes = np.array(elog["passes"], dtype=np.float64)
    is_prefill = np.zeros(len(passes), bool)
    is_prefill[elog["prefill_passes"]] = True
    decode, prefill = passes[~is_prefill], passes[is_prefill]
    steps, wall, slots = len(elog["t_s"]), elog["wall_s"], replica.slots
    measured = elog["times"]
    t, running = zip(*thin(list(zip(elog["t_s"], elog["running"])), 1000))
    return {
        "wall_s": wall, "output_tokens_per_s": float(req.output.sum()) / wall, "steps": steps,
        "occupancy": sum(elog["running"]) / (steps * slots),
        "prefill_s": elog["prefill_s"], "decode_s": elog["decode_s"],
        "other_s": wall - elog["prefill_s"] - elog["decode_s"] - elog["idle_s"],
        "idle_s": elog["idle_s"], "decode_steps": elog["decode_steps"],
        "padded_decode_steps": elog["padded_decode_steps"],
        "attention_calls_per_decode": elog["attention_calls"] / max(elog["decode_steps"], 1),
        "predicted": {"wall_s": float(sim["times"].finish.max()), "steps": sim["steps"],
                      "prefill_s": sim["prefill_s"], "decode_s": sim["decode_s"],
                      "cost_model": "spread" if several else "one_span"},
        "steps_check": steps_check(measured, sim["times"]) if at_zero else None,
        "latency": {"measured": latencies(measured), "passes": latencies(replay["times"]),
                    "priced": latencies(sim["times"])},
        # the step costs timed beforehand against the run's own passes (sums by kind)
        "passes_priced": {kind: {"passes": len(p), "measured_s": float(p[:, 2].sum()),
                                 "priced_s": float(sum(replica.costs.pass_s(int(k), v)
                                                       for k, v, _ in p))}
                          for kind, p in (("decode", decode), ("prefill", prefill))},
        "per_request": {"engine_first_step": measured.first_step.tolist(),
                        "engine_finish_step": measured.finish_step.tolist(),
                        "simulated_first_step": sim["times"].first_step,
                        "simulated_finish_step": sim["times"].finish_step,
                        "measured_first_s": measured.first_token.tolist(),
                        "measured_finish_s": measured.finish.tolist(),
                        "passes_first_s": replay["times"].first_token,
                        "passes_finish_s": replay["times"].finish},
        "timeline": {"t_s": t, "running": running},
        **({"hit_tokens_simulated": sim[PREFIX_REPORT]["hit_tokens"]} if PREFIX_REPORT in sim
           else {})}


def engine_verdict(D, tolerance=0.15):
    """What D checked, and whether it held. Steps: every request's first-token and finish
    step equal in the engine and the simulation (when all wait at t=0). Seconds: each policy's
    makespan and TTFT/E2E p50/p90 within `tolerance` of the simulation priced with the run's
    own passes, and of the one priced beforehand. The speedup against the predicted one; when
    it misses, the cost C priced worst: prefill passes, decode passes, or the host work between
    them (not priced at all)."""
    policies = ("static", "continuous")
    checks = [D[p]["steps_check"] for p in policies]
    verdict = {"tolerance": tolerance, "steps_exact": None if None in checks else
               all(c["agree"] == c["requests"] for c in checks)}
    for pricing in ("passes", "priced"):
        offs = [(p, m, D[p]["latency"]["measured"][m] / max(D[p]["latency"][pricing][m], 1e-12)
                 - 1) for p in policies for m in LATENCIES]
        mode, metric, off = max(offs, key=lambda o: abs(o[2]))
        verdict[pricing] = {"checked": len(offs), "within": sum(abs(o[2]) <= tolerance
                                                                for o in offs),
                            "worst": {"mode": mode, "metric": metric, "off": off}}
    measured, predicted = D["speedup_measured"], D["speedup_predicted"]
    off = measured / predicted - 1
    verdict.update(measured=measured, predicted=predicted, off=off,
                   within=abs(off) <= tolerance)
    if not verdict["within"]:
        gaps = []
        for mode in policies:
            d, p = D[mode], D[mode]["predicted"]
            gaps += [(d["decode_s"], p["decode_s"], mode, "decode"),
                     (d["prefill_s"], p["prefill_s"], mode, "prefill"),
                     (d["other_s"], 0.0, mode, "host")]
        got, priced, mode, part = max(gaps, key=lambda g: abs(g[0] - g[1]))
        verdict.update(mode=mode, part=part, measured_s=got, priced_s=priced)
    return verdict


# -----------------------------------------------------------------------------
# tables: the renderer, and A's and B's (from the results dictionary alone)
# Every line printed comes from TEXT (the appendix), one table of strings per language; a
# description stored in results.json as a dict with a "kind" names its template there.


def describe(T, what):
    """A description from results.json (a dict naming its template in "kind") in T's
    language; a plain string as it is."""
    if not isinstance(what, dict):
        return str(what)
    return T[what["kind"]].format(**{k: T[v] if k == "mode" else describe(T, v) if isinstance(
        v, dict) and "kind" in v else v for k, v in what.items()})


def cell(T, row, key, fmt):
    if key == "step_ms" and "skipped" in row:
        return describe(T, row["skipped"])
    if key == "mode" and "graph_failed" in row:
        return T["graph_failed"]
    if key in ("mode", "bound") and key in row:
        return T[row[key]]
    if key in row.get("above_ceiling", ()):
        return T["above_ceiling"]
    text = format(row[key], fmt) if key in row else ""
    return text + "*" if key == "step_ms" and row.get("few_reps") else text


def roofline_notes(T, results, rows):
    """The lines under A's or B's table that say what its marks and labels mean."""
    lines = []
    if any(r.get("few_reps") for r in rows):
        lines.append(T["few_reps"].format(budget=results["config"]["time_budget_s"]))
    if any("above_ceiling" in r for r in rows):
        lines.append(T["above_ceiling_note"])
    for bound in ("launch", "overhead"):
        if any(r.get("bound") == bound for r in rows):
            lines.append(T[bound + "_note"].format(share=LAUNCH_BOUND_SHARE))
    return lines


ROOFLINE_COLUMNS = [("gbs", ",.1f"), ("mbu", ".0%"), ("mfu", ".1%"), ("bound", "s")]


def table(T, rows, headers, **fields):
    """Rows under the headers named (TEXT keys, formatted with `fields`, or a metric's
    (metric, statistic, unit)), right-aligned; wider than OUTPUT_WIDTH, split into tables of
    the columns that fit, each led by the row's labels (its leading columns of words)."""
    from tabulate import tabulate
    heads = [header_text(T, h).format(**fields) for h in headers]
    rows = [list(map(str, r)) for r in rows]
    labels = next((i for i in range(len(heads)) if not all(any(c.isalpha() for c in r[i])
                                                           for r in rows)), len(heads))
    labels = min(max(labels, 1), len(heads) - 1)

    def render(start, end):
        cols = list(range(labels)) + list(range(start, end))
        return tabulate([[r[i] for i in cols] for r in rows], [heads[i] for i in cols],
                        stralign="right", disable_numparse=True)

    def fits(start, end):  # (as rendered: tabulate pads each header by two)
        return max(map(columns, render(start, end).split("\n"))) <= OUTPUT_WIDTH
    parts, start = [], labels
    while start < len(heads) or not parts:
        end = start + 1
        while end < len(heads) and fits(start, end + 1):
            end += 1
        parts.append(render(start, end))
        start = end
    return "\n\n".join(parts)


def header_text(T, header):
    if isinstance(header, tuple):  # a metric at a statistic, in a unit: "TTFT p99 ms"
        return " ".join(T[f"{kind}_{name}"] for kind, name in zip(("metric", "stat", "unit"),
                                                                  header))
    return T[header]


# A table column: (its header's TEXT key, a dotted path into the row, a format). A format is
# a format() spec or a unit below, the one place where units are converted for the tables.
UNITS = {
    "ms": lambda v: f"{1e3 * v:,.1f}",           # seconds shown in milliseconds
    "pct": lambda v: f"{100 * v:.1f}%",          # a share in per cent
    "spct": lambda v: f"{100 * v:+.1f}%",        # a signed error in per cent
    "s": lambda v: f"{v:,.2f}" if v >= 1 else f"{v:.3f}",  # seconds, to 3 figures below 1
    "text": str,                                 # a cell already written
}


def fetch(row, path):
    for key in path.split("."):
        row = row[key]
    return row


def render(value, fmt):
    """One cell: "-" where there is no value."""
    if value is None:
        return "-"
    return UNITS[fmt](value) if fmt in UNITS else format(value, fmt)


def spec_table(T, rows, columns, **fields):
    """Rows (dicts) under column specs [(header key, path, format)]."""
    return table(T, [[render(fetch(r, path), fmt) for _, path, fmt in columns] for r in rows],
                 [header for header, _, _ in columns], **fields)


def latency_columns(*stats, keys=("ttft", "tpot", "e2e"), unit="ms"):
    """TTFT, TPOT and E2E at each statistic, in ms (or seconds: unit "s")."""
    return [((k, p, unit), f"{k}_s.{p}", unit) for k in keys for p in stats]


def kernels_text(T, experiment):
    """The attention backends allowed and the kernels that ran (none for the post's proxy)."""
    if not experiment.get("kernels"):
        return []
    return [T["kernels"].format(backends=", ".join(experiment["sdpa_backends"]),
                                kernels=", ".join(experiment["kernels"]))]


def context_table(T, A):
    """Decode step ms by batch (rows) and context (columns), in the fastest mode measured."""
    from tabulate import tabulate
    mode = A["modes"][-1]
    by_key = {(r["batch"], r["context"]): r for r in A["rows"] if r["mode"] == mode}
    batches = sorted({r["batch"] for r in A["rows"]})
    rows = [[b] + [cell(T, by_key[b, c], "step_ms", ".3f") for c in A["contexts"]]
            for b in batches]
    crossover = ", ".join(T["crossover_at"].format(batch=b, context=c)
                          for c, b in A["kv_crossover_batch"].items())
    return (tabulate(rows, [T["batch"]] + [T["ctx_ms"].format(context=c) for c in A["contexts"]],
                     stralign="right")
            + "\n" + T["crossover"].format(batches=crossover))


def chain_text(T, B):
    """How close decode at batch 1 comes to a bare chain of its own matmuls."""
    lines = []
    for chain in B["linear_chain"]:
        decode = next((r for r in measured(B["rows"]) if r["phase"] == "decode"
                       and r["batch"] == 1 and r["mode"] == chain["mode"]), None)
        text = T["chain"].format(mb=chain["bytes"] / 1e6, mode=T[chain["mode"]],
                                 ms=chain["step_ms"], gbs=chain["gbs"])
        if decode:
            text += T["chain_decode"].format(gbs=decode["gbs"], share=decode["gbs"] / chain["gbs"])
        lines.append(text)
    return "\n".join(lines)


# Ceilings measured again that moved: a busy machine slows copies and matmuls alike, so both
# moving the same way by more than CEILINGS_MOVED (a CPU load that halves the machine's speed
# moves them 70-80%), or one alone by more than CEILING_MOVED_ALONE. One alone within that is
# the measurement's own spread: on a quiet 2-core VM one ceiling moved 31% while the other
# moved 12% between a run's start and its end.
CEILINGS_MOVED = 0.25
CEILING_MOVED_ALONE = 0.5

RIDGE_MIN = 1.0  # FLOP/byte: a matmul slower than a copy of its bytes, which no quiet chip is


def moved(before, after):
    """How far each ceiling moved between two measurements, as a signed share."""
    return {k: after[k] / before[k] - 1 for k in ("bandwidth_gbs", "matmul_tflops")
            if before[k] > 0}


def speed_moved(before, after):
    """Whether the machine's speed moved between two measurements of its ceilings."""
    change = list(moved(before, after).values())
    together = len(change) == 2 and (change[0] > 0) == (change[1] > 0) and \
        min(map(abs, change)) > CEILINGS_MOVED
    return together or any(abs(v) > CEILING_MOVED_ALONE for v in change)


def machine_warnings(results):
    """When the machine lied: the ceilings moved over the run (or around D) by more than
    CEILINGS_MOVED, a ridge under RIDGE_MIN, MBU or MFU over 100% in A's or B's rows.
    -> [a description dict each (see describe)], what to re-run named in its template"""
    env, out = results.get("environment", {}), []
    start, end = env.get("ceilings"), env.get("ceilings_end")
    if start and end and speed_moved(start, end):
        out.append({"kind": "warn_moved", **ceilings_moved(start, end)})
    if start and start["ridge_flop_per_byte"] < RIDGE_MIN:
        out.append({"kind": "warn_ridge", "ridge": start["ridge_flop_per_byte"],
                    "least": RIDGE_MIN})
    above = sorted({k.upper() for e in "AB" for r in results.get(e, {}).get("rows", [])
                    for k in r.get("above_ceiling", ())})
    if above:
        rows = sum("above_ceiling" in r for e in "AB" for r in results.get(e, {}).get("rows", []))
        out.append({"kind": "warn_above", "shares": " and ".join(above), "rows": rows})
    out += load_warnings(env.get("load", {}))
    machine = results.get("D", {}).get("machine")
    if machine and speed_moved(machine["before"], machine["after"]):
        out.append({"kind": "warn_engine", **ceilings_moved(machine["before"], machine["after"])})
    return out


def load_warnings(loads):
    """The stages other processes slowed (see busy), or where the load was not measured."""
    disturbed = {k: v for k, v in loads.items() if busy(v)}
    unknown = [k for k, v in loads.items() if v.get("others_share") is None]
    out = []
    if disturbed:
        worst = max(disturbed.values(), key=lambda v: v["others_share"] + v["steal_share"])
        out.append({"kind": "warn_busy", "stages": ", ".join(disturbed), "cpus": worst["cpus"],
                    "others": worst["others_share"], "steal": {
                        "kind": "busy_steal", "steal": worst["steal_share"]}
                    if worst["steal_share"] >= 0.01 else ""})
    if unknown:
        out.append({"kind": "note_load", "stages": ", ".join(unknown)})
    return out


def ceilings_moved(before, after):
    change = moved(before, after)
    return {"bandwidth": before["bandwidth_gbs"], "bandwidth_end": after["bandwidth_gbs"],
            "tflops": before["matmul_tflops"], "tflops_end": after["matmul_tflops"],
            "bandwidth_moved": change.get("bandwidth_gbs", 0.0),
            "tflops_moved": change.get("matmul_tflops", 0.0), "share": CEILINGS_MOVED}


def summary_text(T, results):
    """The post's three claims as this run measured them, one line each (those it ran), each
    in the words its numbers allow: where they contradict the post, the line says so."""
    lines = [line for line in (decode_claim(T, results), prefill_claim(T, results),
                               batching_claim(T, results)) if line]
    return "\n".join([T["summary"]] + lines) if lines else ""


def decode_claim(T, results):
    """Claim 1: batching is nearly free (batch 8, or the least batch past 1, gains at least
    2x batch 1's tokens/s; the line says what bound batch 1)."""
    if "A" not in results:
        return None
    A = results["A"]
    rows = [r for r in measured(A["rows"]) if r["context"] == A["context"]
            and r["mode"] == A["modes"][-1]]
    by_bytes = [r for r in rows if r["batch"] > 1 and r.get("bound") == "memory"] or \
        [r for r in rows if r["batch"] > 1]
    first = next((r for r in rows if r["batch"] == 1), None)
    if not (by_bytes and first):
        return None
    small = next((r for r in rows if r["batch"] == 8), min(by_bytes, key=lambda r: r["batch"]))
    holds = small["throughput_vs_1"] >= 2
    r = by_bytes[-1] if holds else small
    turn = next((s["batch"] for s in rows if s.get("bound") == "compute"), None)
    return T["summary_decode" if holds else "summary_decode_not"].format(
        batch=r["batch"], throughput=r["throughput_vs_1"], wait=r["wait_vs_1"],
        bound=T[first.get("bound", "memory")], turn=T["summary_turn"].format(
            batch=turn) if turn and turn > 1 else "")


def prefill_claim(T, results):
    """Claim 2: prefill is bound by arithmetic (the longest prompt past the ridge)."""
    if "B" not in results:
        return None
    rows = measured(results["B"]["rows"])
    prefill = [r for r in rows if r["phase"] == "prefill"]
    decode = next((r for r in rows if r["phase"] == "decode" and r["batch"] == 1), None)
    if not (prefill and decode):
        return None
    p = max(prefill, key=lambda r: r["tokens"])
    bound = p.get("bound", "compute")
    ridge = results["environment"].get("ceilings", {}).get("ridge_flop_per_byte", 0.0)
    return T["summary_prefill" if bound == "compute" else "summary_prefill_not"].format(
        tokens=p["tokens"], intensity=p["intensity"], bound=T[bound], ridge=ridge_text(ridge),
        ratio=p["tflops"] / max(decode["tflops"], 1e-30), decode=decode["intensity"])


def batching_claim(T, results):
    """Claim 3: continuous batching takes fewer steps than static (and in D, less time)."""
    C = results.get("C", {})
    if "static" not in C:
        return None
    D = results.get("D", {}).get("verdict")
    holds = C["speedup"] > 1 and (not D or D["measured"] > 1)
    return T["summary_batching" if holds else "summary_batching_not"].format(
        static=C["static"]["occupancy"], continuous=C["continuous"]["occupancy"],
        speedup=C["speedup"], engine=T["summary_engine"].format(**D) if D else "")


def dtype_probe_line(T, probe):
    """The dtype probe's choice, each type's weighted time over float32's (median, p10-p90 of
    the rounds) and the margin, as the banner prints it."""
    rows = "/".join(str(s["rows"]) for s in probe["shapes"])
    ratios = ", ".join(
        T["probe_ratio"].format(dtype=d, **q) if q else T["probe_dropped"].format(dtype=d)
        for d, q in probe["vs_float32"].items() if d != "float32")
    margin = ", ".join(
        ([T["probe_tied"].format(types=", ".join(probe["tied_with"]), noise=probe["noise"])]
         if probe.get("tied_with") else []) +
        [T["probe_margin"].format(margin=probe["margin"]) if probe["margin"] else
         T["probe_alone"]])
    return T["dtype_probe"].format(chosen=probe["chosen"], rows=rows, ratios=ratios,
                                   rounds=probe["rounds"], margin=margin,
                                   preference=probe["preference"])


def ceilings_line(T, ceilings, device_type):
    return fit_lines(T["ceilings"].format(
        bandwidth=ceilings["bandwidth_gbs"], tflops=ceilings["matmul_tflops"],
        bandwidth_source=describe(T, ceilings["bandwidth_source"]),
        matmul_source=describe(T, ceilings["matmul_source"]),
        ridge=ridge_text(ceilings["ridge_flop_per_byte"])) +
        ("" if device_type == "cuda" else T["cpu_graphs"]))


def ridge_text(ridge):
    """A ridge as the ceilings line prints it: whole from 1 up, two figures below (a ridge
    under 1, a busy machine's, must not read as 0)."""
    return f"{ridge:.0f}" if ridge >= 1 else f"{ridge:.2g}"


# -----------------------------------------------------------------------------
# tables of C and D: the post's table, the schedulers, the KV cache, who waits, fleets,
# capacity, the engine against the simulation, and --catalog


def post_table_text(T, C):
    """The post's table: static vs continuous in steps, and how much one draw says."""
    rows = [[T[p], f"{C[p]['steps']:,}", f"{100 * C[p]['occupancy']:.1f}%"]
            for p in ("static", "continuous")]
    lines = [T["C"].format(**C), "", table(T, rows, ["policy", "steps", "occupancy"]), "",
             T["lengths"].format(speedup=T["speedup"], value=C["speedup"], **C["lengths"])]
    if "seed_spread" in C:
        s = C["seed_spread"]
        lines += ["", T["spread"].format(
            seeds=s["seeds"], static=spread_text(T, s["static_occupancy"], pct=True),
            continuous=spread_text(T, s["continuous_occupancy"], pct=True),
            speedup=spread_text(T, s["speedup"]))]
    return "\n".join(lines)


def spread_text(T, s, pct=False):
    if pct:
        return f"{100 * s['p50']:.1f}% ({100 * s['p10']:.1f}-{100 * s['p90']:.1f}%)"
    return f"{s['p50']:.2f}{T['times']} ({s['p10']:.2f}-{s['p90']:.2f}{T['times']})"


def orders_steps_table(T, C):
    """The post's table in each order of the queue."""
    columns = [("order", "label", "text")] + [
        (f"{p}_{h}", f"{p}.{key}", fmt) for p in ("static", "continuous")
        for h, key, fmt in (("steps", "steps", ","), ("occ", "occupancy", "pct"),
                            ("finish", "mean_finish_step", ",.0f"))] + [
        ("continuous_p99", "continuous.p99_finish_step", ",.0f")]
    rows = [{"label": T["order_" + name], **s} for name, s in C["orders_steps"].items()]
    return "\n".join([T["orders_steps"].format(requests=C["requests"]),
                      spec_table(T, rows, columns)])


def order_text(T, info):
    """--order as a phrase: its name, how good its predictions are, its guard."""
    text = T["order_" + info["name"]]
    if "kendall_tau" in info:
        text += T["queue_predicted"].format(**info)
    if info.get("max_wait_s") is not None:
        text += T["queue_guard"].format(**info)
    return text


SERVING_COLUMNS = [("policy", "label", "text"), ("steps", "steps", ","),
                   ("seconds", "makespan_s", ",.2f"), ("req_s", "throughput_rps", ",.2f"),
                   ("tokens_per_s", "output_tokens_per_s", ",.0f"),
                   ("occupancy", "occupancy", "pct")] + latency_columns("p50", "p99")


def serving_table(T, C):
    """C in seconds: each scheduler's throughput and latency percentiles."""
    rows = [{"label": T[name], **m} for name, m in C["schedulers"].items()]
    goodput = [("goodput", "goodput_rps", ",.2f")] if "goodput_rps" in rows[-1] else []
    lines = [T["C_seconds"].format(requests=C["requests"], source=describe(T, C["source"]),
                                   slots=C["slots"], arrivals=describe(T, C["arrivals"])),
             T["step_costs"].format(pricing=describe(T, C["cost_model"]["source"])),
             T["queue"].format(order=order_text(T, C["order"]))]
    if C.get("share_of", 1) > 1:
        lines.append(T["one_share"].format(replicas=C["share_of"]))
    lines.append(spec_table(T, rows, SERVING_COLUMNS + goodput))
    work = C.get("simulation")
    if work:
        lines.append(T["simulations"].format(
            runs=work["runs"], iterations=work["iterations"], seconds=work["simulation_s"],
            rate=work["iterations"] / max(work["simulation_s"], 1e-9), wall=work["wall_s"],
            jobs=work["jobs"]))
    return "\n".join(lines)


KV_COLUMNS = [("allocation", "allocation", "text"), ("policy", "label", "text"),
              ("req_s", "throughput_rps", ",.2f"), ("concurrency", "concurrency", "text"),
              ("kv_used", "utilization", ".1%"), ("never_used", "fragmentation", ".1%"),
              ("max_allocated", "max_allocated_tokens", ","), ("preempted", "preemptions", ","),
              ("recomputed", "recomputed_tokens", ","),
              (("ttft", "p99", "ms"), "ttft_s.p99", "ms"),
              (("e2e", "p99", "ms"), "e2e_s.p99", "ms")]


def kv_table(T, kv):
    """C's KV-cache study: memory use, concurrency and latency of each policy and scheduler."""
    rows = [{"allocation": T.get(policy, policy), "label": T[name], **m, "concurrency":
             f"{m['peak_concurrency']} / {m['mean_concurrency']:.1f}"}
            for policy in KV_MANAGERS for name, m in kv.get(policy, {}).items()]
    admission = (T["admit_watermark"].format(share=kv["watermark"]) if kv.get("watermark")
                 else T["admit_naive"])
    lines = [T["kv"].format(gb=max(kv["memory_bytes"], 0) / 1e9,
                            memory_source=describe(T, kv["memory_source"]),
                            tokens=kv["budget_tokens"], bytes=kv["bytes_per_token"],
                            max_output=kv["max_output"], block=kv["block_tokens"],
                            admission=admission)] + ([spec_table(T, rows, KV_COLUMNS)]
                                                     if rows else [])
    lines += [T["kv_unfit_row"].format(policy=T.get(policy, policy), why=describe(T, why))
              for policy, why in kv.get("unfit", {}).items()]
    lines += prefix_tables(T, [row for row in rows if PREFIX_REPORT in row], kv)
    if kv.get("device_check"):
        lines.append(device_check_text(T, kv["device_check"]))
    return "\n".join(lines)


def device_check_text(T, check):
    shape = T["check_shape"].format(rows=check["rows"], tokens=check["row_tokens"],
                                    gb=check["bytes"] / 1e9)
    if "skipped" in check:
        return T["check_skipped"].format(device=check["device"], shape=shape,
                                         reason=describe(T, check["skipped"]))
    clamped = T["check_clamped"].format(n=check["clamped_rows"]) if check["clamped_rows"] else ""
    return T["check"].format(device=check["device"], shape=shape, batch=check["batch"],
                             max_context=check["max_context"], clamped=clamped,
                             ms=check["step_ms"])


WHO_WAITS_COLUMNS = [("order", "label", "text"), ("seconds", "makespan_s", "s"),
                     ("req_s", "throughput_rps", ",.2f")] + \
    latency_columns("mean", "p99", keys=("ttft", "e2e")) + [
                     ("per_token_ms", "normalized_s_per_token", "ms"),
                     ("longest_wait", "max_wait_s", "s")]
BY_LENGTH_COLUMNS = [("order", "label", "text"), ("output_tokens", "bucket", "text"),
                     ("count", "count", ",")] + \
    latency_columns("p50", "p99", keys=("ttft", "e2e")) + [
                     ("per_token_ms", "normalized_s_per_token", "ms"),
                     ("longest_wait", "max_wait_s", "s")]


def who_waits_tables(T, C):
    """Who waits: each order's makespan and latencies, then by output length."""
    w, orders = C["who_waits"], C["orders"]
    kv = T[w["kv_policy"]] if w["kv_policy"] else T["who_waits_kv_none"]
    header = [T["who_waits"].format(requests=w["requests"], slots=w["slots"], kv=kv,
                                    arrivals=describe(T, w["arrivals"])),
              T["who_waits_setup"].format(sigma=w["sigma"], tau=w["kendall_tau"],
                                          guard=w["guard_s"], source=T[w["guard_source"]])]
    rows = [{"label": T["order_" + name], **m} for name, m in orders.items()]
    by_length = [{"label": T["order_" + name], **b, "bucket": T["bucket"].format(
                  name=T["bucket_" + b["bucket"]], **b)}
                 for name, m in orders.items() for b in m["by_length"]]
    return ["\n".join(header + [spec_table(T, rows, WHO_WAITS_COLUMNS)]),
            "\n".join([T["who_waits_by_length"], spec_table(T, by_length, BY_LENGTH_COLUMNS)])]


def fleet_table(T, fleet):
    """C with --replicas: each router's latencies, SLO and balance over the whole load."""
    rows = [{"label": router, **m, "spread": f"{m['balance']['requests_min']:,}-"
             f"{m['balance']['requests_max']:,}"} for router, m in fleet["routers"].items()]
    slo = [("slo_met", "slo_attained", ".1%"), ("goodput", "goodput_rps", ",.2f")] \
        if "slo_attained" in rows[-1] else []
    hits = [("hit_card", "prefix_cache.hit_ratio", ".1%"),
            ("wait_p99", "wait_s.p99", "s")] if PREFIX_REPORT in rows[-1] else []
    columns = [("router", "label", "text"), ("req_s", "throughput_rps", ",.2f")] + \
        latency_columns("p50", "p99") + slo + hits + [
            ("per_replica", "spread", "text"), ("busiest", "balance.busiest_occupancy", ".1%")]
    kv = T[fleet["kv_policy"]] if fleet["kv_policy"] else T["who_waits_kv_none"]
    return "\n".join([T["fleet"].format(replicas=fleet["replicas"], slots=fleet["slots"],
                                        requests=fleet["requests"], kv=kv,
                                        arrivals=describe(T, fleet["arrivals"])),
                      spec_table(T, rows, columns)])


def capacity_text(T, cap):
    """The capacity of one replica at the SLO and, for a target rate, the replicas needed."""
    def rate(value):
        if value == 0:
            return T["capacity_none"]
        return f"{value:,.3g}" if math.isfinite(value) else T["capacity_all"].format(
            rate=max(rate for rate, _ in cap["one_replica"]["tried"]))
    slo = ", ".join(T[key].format(ms=1e3 * cap[f"{key}_s"]) for key in ("slo_ttft", "slo_tpot")
                    if cap[f"{key}_s"])
    one = cap["one_replica"]
    lines = [T["capacity"].format(slo=slo, attainment=cap["attainment"], rate=rate(one["rate_rps"]),
                                  tokens=one["output_tokens_per_s"] if math.isfinite(
                                      one["rate_rps"]) else 0.0, seeds=cap["seeds"],
                                  requests=cap["requests"], low=rate(one["rates_rps"][0]),
                                  high=rate(one["rates_rps"][-1]))]
    if "routers" not in cap:
        return "\n".join(lines)
    rows = [{"label": T["router_plain"].format(router=router) if group == "without_caching"
             else router, **r, "needed": f"{r['replicas']:,}" if r["replicas"] else
             T["too_many"].format(n=REPLICAS_MAX)}
            for group in ("routers", "without_caching")
            for router, r in cap.get(group, {}).items()]
    lines += ["", T["replicas_needed"].format(rate=cap["target_rate"],
                                              requests=cap["fleet_requests"]),
              spec_table(T, rows, [("router", "label", "text"), ("replicas_col", "needed", "text"),
                                   ("attained_col", "attainment", ".1%"),
                                   ("below_col", "below", ".1%")])]
    answer = cap["answer"] if "answer" in cap else capacity_choice(cap)
    if not answer:
        lines.append(T["answer_none"].format(n=REPLICAS_MAX))
    else:
        lines.append(T["answer"].format(
            replicas=counted(T, answer["replicas"], "replica"), router=answer["router"],
            tie=T["answer_tie"] if answer["tie"] else "",
            gpus=counted(T, answer["gpus"], "gpu")))
    return "\n".join(lines)


def serving_text(T, serving):
    """The seats and step budget an answer used, and where they came from."""
    source = serving["source"].split("+")
    return T["serving_limits"].format(slots=serving["slots"], chunk=serving["chunk_tokens"],
                                      source=T["limits_" + source[0]] + (
                                          T["limits_flag_too"] if len(source) > 1 else ""))


def counted(T, n, noun):
    """"1 replica", "2 replicas": a count and its noun in T's language."""
    one, many = T["noun_" + noun].split("|")
    return (one if n == 1 else many).format(n=n)


def capacity_answer(T, results):
    """The capacity question answered first, in words, with the workload and limits the
    answer assumes (what a reader changes to ask it of their own deployment)."""
    C, cfg = results["C"], results["config"]
    cap, price = C["capacity"], C["cost_model"]["source"]
    slo = ", ".join(T[key].format(ms=1e3 * cap[f"{key}_s"]) for key in ("slo_ttft", "slo_tpot")
                    if cap[f"{key}_s"])
    one = cap["one_replica"]["rate_rps"]
    name = cfg["model"]["name"]
    fields = {"slo": slo, "attainment": cap["attainment"],
              "model": T["answer_post"] if name == "post" else name,
              "one": f"{one:,.3g}" if math.isfinite(one) else T["capacity_all"].format(
                  rate=max(rate for rate, _ in cap["one_replica"]["tried"]))}
    fields["card"] = price["card"] if price["kind"] == "pricing_card" else describe(T, price)
    answer = (cap["answer"] if "answer" in cap else capacity_choice(cap)) \
        if "routers" in cap else None
    if "routers" not in cap:
        lines = [T["answer_one"].format(**fields)]
    elif not answer:
        lines = [T["answer_fleet_none"].format(rate=cap["target_rate"], n=REPLICAS_MAX, **fields)]
    else:
        lines = [T["answer_fleet"].format(
            rate=cap["target_rate"], router=answer["router"], **fields,
            replicas=counted(T, answer["replicas"], "replica"),
            gpus=counted(T, answer["gpus"], "gpu"))]
    arrivals = {"kind": "arrivals_poisson" if cfg["burstiness"] == 1 else "arrivals_gamma",
                "rate": 1.0, "burstiness": cfg["burstiness"]}
    lines.append(T["answer_assumes"].format(
        arrivals=T["answer_arrivals_" + arrivals["kind"][9:]].format(**arrivals),
        prompt=C["prompt_tokens"]["p50"], output=C["output_tokens"]["p50"],
        longest=cap.get("longest_output") or C["lengths"]["max"],
        source=describe(T, C["source"]), kv=T[cap["kv_policy"]] if cap["kv_policy"] else "-",
        limits=serving_text(T, cap.get("serving") or {
            "slots": C["slots"], "chunk_tokens": cfg["chunk_tokens"], "source": "post"})))
    return "\n".join(lines)


ENGINE_COLUMNS = [("policy", "label", "text"), ("wall_s", "wall_s", ",.2f"),
                  ("predicted_s", "predicted.wall_s", ",.2f"),
                  ("tokens_per_s", "output_tokens_per_s", ",.0f"), ("steps", "steps", ","),
                  ("occupancy", "occupancy", "pct"), ("prefill_s", "prefill", "text"),
                  ("decode_s", "decode", "text"), ("between_s", "other_s", ",.2f")]


def engine_table(T, D):
    """D: the engine's measured wall time and its parts beside what C's simulation priced."""
    rows = [{"label": T[label], **d, **{part: f"{d[part + '_s']:,.2f} / "
                                            f"{d['predicted'][part + '_s']:,.2f}"
                                        for part in ("prefill", "decode")}}
            for run, label in (("static", "static"), ("continuous", "continuous"),
                               ("prefix", "D_prefix_label")) if run in D
            for d in (D[run],)]
    shrink = D.get("shrink", 1)
    source = T["D_source_shrunk"].format(shrink=shrink) if shrink > 1 else T["D_source"]
    return "\n".join([
        T["D"].format(requests=D["requests"], prompt=D["prompt_tokens"], slots=D["slots"],
                      source=source, order=order_text(T, D["order"]),
                      arrivals=describe(T, D["arrivals"]), **D["lengths"])]
        + ([T["D_cpu"]] if shrink > D.get("bound", {}).get("shrunk_by", 1) else [])
        + ([T["D_bound"].format(**D["bound"])] if D.get("bound", {}).get("shrunk_by", 1) > 1
           else []) + [
        T["D_predicted"].format(pricing=describe(T, D["cost_model"]["source"])),
        spec_table(T, rows, ENGINE_COLUMNS),
        T["attention_calls"].format(static=D["static"]["attention_calls_per_decode"],
                                    continuous=D["continuous"]["attention_calls_per_decode"])
        + (T["attention_padded"].format(padded=D["continuous"]["padded_decode_steps"],
                                        steps=D["continuous"]["decode_steps"])
           if D["continuous"]["padded_decode_steps"] else T["attention_spans"]),
        *kernels_text(T, D),
        "", request_table(T, D), verdict_text(T, D["verdict"])] + prefix_check_text(T, D)
        + engine_machine_text(T, D))


def prefix_check_text(T, D):
    """D's prefix cache against the plain continuous run and against C's PrefixCache."""
    if "prefix_check" not in D:
        return []
    c, steps = D["prefix_check"], D["prefix"]["steps_check"]
    text = T["D_prefix"].format(
        **c, identical=T["yes" if c["tokens_identical"] else "no"],
        steps=T["D_steps_count"].format(**steps) if steps else T["not_checked"],
        hit_simulated=c["hit_tokens_simulated"] or 0)
    if c["off"] is None:
        return [text]
    return [text + T["D_prefix_within" if c["within"] else "D_prefix_outside"].format(**c)]


def engine_machine_text(T, D):
    """Whether the machine's speed held between D's pricing and its run (its ceilings
    measured on either side of D)."""
    if "machine" not in D:
        return []
    change = ceilings_moved(D["machine"]["before"], D["machine"]["after"])
    held = not speed_moved(D["machine"]["before"], D["machine"]["after"])
    return [T["verdict_machine_held" if held else "verdict_machine_moved"].format(**change)]


REQUEST_COLUMNS = [("policy", "label", "text"), ("latency", "latency", "text"),
                   ("measured_col", "measured", "text"), ("passes_col", "passes.s", "text"),
                   ("off_col", "passes.off", "+.0%"), ("priced_col", "priced.s", "text"),
                   ("off_col", "priced.off", "+.0%")]


def request_table(T, D):
    """D request by request: steps, then latencies measured against the two predictions."""
    rows, lines = [], [T["D_requests"]]
    for policy in ("static", "continuous"):
        lat = D[policy]["latency"]
        for metric in LATENCIES:
            m, unit = lat["measured"][metric], "s" if metric == "makespan_s" else "ms"
            rows.append({"label": T[policy], "latency": f"{T['lat_' + metric]} {T['unit_' + unit]}",
                         "measured": render(m, unit), **{
                pricing: {"s": render(lat[pricing][metric], unit),
                          "off": m / max(lat[pricing][metric], 1e-12) - 1}
                for pricing in ("passes", "priced")}})
    lines.append(spec_table(T, rows, REQUEST_COLUMNS))
    checks = {p: D[p]["steps_check"] for p in ("static", "continuous")}
    if None in checks.values():
        lines.append(T["D_steps_arrivals"])
    else:
        text = T["D_steps"].format(**{p: T["D_steps_count"].format(**c)
                                      for p, c in checks.items()})
        wrong = [(p, c["first_mismatch"]) for p, c in checks.items() if "first_mismatch" in c]
        if wrong:
            policy, first = wrong[0]
            text += T["D_steps_mismatch"].format(policy=T[policy], **first)
        lines.append(text)
    for policy in ("static", "continuous"):
        p = D[policy]["passes_priced"]
        lines.append(T["D_passes"].format(
            policy=T[policy], n_decode=p["decode"]["passes"], n_prefill=p["prefill"]["passes"],
            **{kind: p[kind]["priced_s"] / max(p[kind]["measured_s"], 1e-12) - 1
               for kind in ("decode", "prefill")}))
    return "\n".join(lines)


def verdict_text(T, v):
    """The verdict: steps exact, seconds within the tolerance, the speedup."""
    answer = {True: "yes", False: "no", None: "not_checked"}[v["steps_exact"]]
    worst = v["priced"]["worst"]
    text = T["verdict_steps"].format(answer=T[answer]) + T["verdict_seconds"].format(
        tolerance=v["tolerance"], checked=v["passes"]["checked"], passes=v["passes"]["within"],
        priced=v["priced"]["within"], mode=T[worst["mode"]], metric=T["lat_" + worst["metric"]],
        off=worst["off"])
    speedup = T["verdict"].format(speedup=T["speedup"], **v)
    if v["within"]:
        return text + "\n" + speedup + T["verdict_within"].format(**v)
    return text + "\n" + speedup + T["verdict_outside"].format(
        tolerance=v["tolerance"], mode=T[v["mode"]], part=T["part_" + v["part"]],
        measured_s=v["measured_s"], priced_s=v["priced_s"])


def catalog_table(T, cat):
    """--catalog: every named model on every named card."""
    b = cat["batch"]
    rows = [{**r, "card": GPUS[r["gpu"]].name, **{key: T["no_fit"] if r[key] is None else
                                                  f"{r[key]:,.2f}"
                                                  for key in ("decode_b1_ms", f"decode_b{b}_ms")}}
            for r in cat["rows"]]
    p = cat["profile"]
    header = T["catalog"].format(**cat, **p, step_us=p["step_s"] * 1e6,
                                 layer_us=p["layer_s"] * 1e6)
    return "\n".join([header, spec_table(T, rows, [
        ("model_col", "model", "text"), ("card_col", "card", "text"),
        ("weights_gb", "weights_gb", ",.2f"), ("kv_per_token", "kv_bytes_per_token", ","),
        ("kv_fit", "kv_tokens", ","), ("crossover_col", "crossover_batch", ","),
        ("decode_b1", "decode_b1_ms", "text"), ("decode_bn", f"decode_b{b}_ms", "text")],
        batch=b)])


def engine_run_table(T, E):
    """C beside a real engine's measured run: latencies at p50/p90/p99, and C's errors,
    under each scheduler."""
    columns = latency_columns("p50", "p90", "p99")
    rows = [[T["engine_measured"]] + [render(fetch(E["measured"], path), fmt)
                                       for _, path, fmt in columns]]
    for label, sim in E["simulated"].items():
        rows.append([T["engine_simulated"].format(label=label)] + [
            render(fetch(sim, path), fmt) for _, path, fmt in columns])
        rows.append([T["engine_error"]] + [render(fetch(sim["error"], path), "spct")
                                           for _, path, _ in columns])
    settings = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
                         for k, v in E["settings"].items()) or "-"
    return "\n".join([T["engine_run"].format(settings=settings, **{
        k: "-" if v is None else f"{v:,}" if isinstance(v, int) else v
        for k, v in E["run"].items()}),
        table(T, rows, ["run_col"] + [h for h, _, _ in columns])])


VALIDATION_COLUMNS = [("role_col", "role", "text"), ("source_col", "source", "text"),
                      ("rows_col", "rows", ","), ("median_abs_col", "median_abs", "pct"),
                      ("median_col", "median", "spct"), ("max_abs_col", "max_abs", "pct"),
                      ("within_col", "within_15", "pct")]
WORST_COLUMNS = [("role_col", "role", "text"), ("model_col", "model", "text"),
                 ("card_col", "gpu", "text"), ("tp_col", "tp", ","),
                 ("weights_col", "weights", "text"), ("lengths_col", "lengths", "text"),
                 ("metric_col", "metric", "text"), ("published_col", "value", ",.1f"),
                 ("predicted_col", "predicted", ",.1f"), ("error_col", "error", "spct")]


def validation_tables(T, V, worst=12):
    """--validate: errors by source (calibration and validation apart), the worst rows, and
    what C could not express."""
    rows = [{**r, "lengths": f"{r['batch']} x {r['isl']}/{r['osl']}"} for r in V["rows"]
            if r["error"] is not None]
    rows.sort(key=lambda r: -abs(r["error"]))
    profiles = "; ".join(f"{k}: {p['fitted_on']}" for k, p in V["profiles"].items())
    left = ", ".join(f"{n} ({why})" for why, n in V["left_out"].items()) or "-"
    return "\n".join([T["validation"].format(profiles=profiles, **V["files"]),
                      spec_table(T, V["summary"], VALIDATION_COLUMNS),
                      T["validation_worst"].format(n=worst),
                      spec_table(T, rows[:worst], WORST_COLUMNS),
                      T["validation_left"].format(left=left)])


def format_tables(results, lang="en"):
    """The tables of every finished experiment, as one string."""
    T = TEXT[lang]
    out = []
    if "capacity" in results.get("C", {}):  # (the question asked: its answer first)
        out.append(capacity_answer(T, results))
    if "A" in results:
        A = results["A"]
        cols = [("mode", "s"), ("batch", "d"), ("step_ms", ".3f"), ("tokens_per_s", ",.0f"),
                ("throughput_vs_1", ".1f"), ("wait_vs_1", ".2f")] + ROOFLINE_COLUMNS
        if results["config"]["model"].get("experts"):  # (measured, and the routing's law)
            cols += [("experts_touched", ".1f"), ("experts_expected", ".1f"),
                     ("bytes_vs_1", ".2f"), ("dense_twin_ms", ".3f")]
        rows = [[cell(T, r, k, f) for k, f in cols] for r in A["rows"]
                if r["context"] == A["context"]]
        post = results["config"]["model"].get("arch") == "post"
        out += [T["A_post" if post else "A"].format(**A), "\n".join(
            [table(T, rows, [k for k, _ in cols])] + roofline_notes(T, results, A["rows"])
            + kernels_text(T, A))]
        if len(A["contexts"]) > 1:
            out += [T["A_contexts"].format(mode=T[A["modes"][-1]]), context_table(T, A)]
    if "B" in results:
        cols = [("mode", "s"), ("step_ms", ".3f"), ("us_per_token", ".1f"), ("tflops", ".2f"),
                ("intensity", ".1f")] + ROOFLINE_COLUMNS
        rows = [[T[r["phase"]].format(**r)] + [cell(T, r, k, f) for k, f in cols]
                for r in results["B"]["rows"]]
        out += [T["B"], "\n".join([table(T, rows, ["row"] + [k for k, _ in cols])]
                                   + roofline_notes(T, results, results["B"]["rows"])
                                   + kernels_text(T, results["B"])), chain_text(T, results["B"])]
    if "C" in results and "static" in results["C"]:
        out += [post_table_text(T, results["C"])]
        if "orders_steps" in results["C"]:
            out += [orders_steps_table(T, results["C"])]
    if "C" in results:
        out += [serving_table(T, results["C"])]
        if "kv" in results["C"]:
            out += [kv_table(T, results["C"]["kv"])]
        if "engine_run" in results["C"]:
            out += [engine_run_table(T, results["C"]["engine_run"])]
        if "orders" in results["C"]:
            out += who_waits_tables(T, results["C"])
        if "replicas" in results["C"]:
            out += [fleet_table(T, results["C"]["replicas"])]
        if "capacity" in results["C"]:
            out += [capacity_text(T, results["C"]["capacity"])]
        if "prefix_study" in results["C"]:
            out += [prefix_study_text(T, results["C"]["prefix_study"],
                                      results["C"].get("capacity"))]
    if "D" in results:
        out += [engine_table(T, results["D"])]
    out += [text for text in (summary_text(T, results),) if text]
    warnings = machine_warnings(results)
    if warnings:
        out.append("\n".join(describe(T, w) for w in warnings))
    return fit_lines("\n\n".join(out))


# -----------------------------------------------------------------------------
# tables of prefix caching and disaggregated serving: the hits per tier, TTFT by hit, hits
# against the cache's capacity; DistServe's runs replayed, and the placements ranked


PREFIX_COLUMNS = [("policy", "label", "text"), ("queried", "prefix_cache.queried_tokens", ","),
                  ("hit_card", "prefix_cache.card_hit_ratio", ".1%"),
                  ("hit_host", "prefix_cache.host_hit_ratio", ".1%"),
                  ("prefill_computed", "prefix_cache.prefill_tokens_computed", ","),
                  ("prefill_saved", "prefix_cache.prefill_tokens_saved", ","),
                  ("evicted", "prefix_cache.evicted_blocks", ",")]
HIT_COLUMNS = [("policy", "label", "text"), ("found_cached", "bucket", "text"),
               ("count", "requests", ",")] + latency_columns("p50", "p99", keys=("ttft",))


def prefix_tables(T, rows, kv):
    """The prefix cache's hits per tier and the prefill they saved, then TTFT by how much of
    its prompt a request found cached (none, up to half, over half)."""
    if not rows:
        return []
    host = T["prefix_host"].format(gb=kv["host_bytes"] / 1e9, tokens=kv["host_tokens"],
                                   gbs=kv["host_link_gbs"], link=kv["host_link"]) \
        if kv.get("host_tokens") else T["prefix_no_host"]
    by_hit = [{"label": row["label"], **b, "bucket": T[b["bucket"]]}
              for row in rows for b in row[PREFIX_REPORT]["ttft_by_hit"] if b["requests"]]
    return ["", T["prefix_cache"].format(host=host), spec_table(T, rows, PREFIX_COLUMNS),
            T["prefix_by_hit"], spec_table(T, by_hit, HIT_COLUMNS)]


PREFIX_STUDY_COLUMNS = [("tier", "label", "text"), ("capacity_col", "capacity", "text"),
                        ("hit_card", "card_hit_ratio", ".1%"),
                        ("hit_host", "host_hit_ratio", ".1%")] + \
    latency_columns("p50", "p99", keys=("ttft",))


def prefix_study_text(T, study, capacity):
    """--prefix-study: hits and TTFT against the cache's capacity, per tier; with an SLO, one
    replica's capacity with and without caching."""
    rows = [{"label": T["tier_" + tier], **row, "capacity": T["unlimited"] if row["share"] is None
             else f"{row['capacity_tokens']:,}"} for tier in ("card", "card_host", "unlimited")
            for row in study[tier]]
    lines = [T["prefix_study"].format(tokens=study["budget_tokens"], host=study["host_tokens"],
                                      link=study["host_link"], gbs=study["host_link_gbs"]),
             spec_table(T, rows, PREFIX_STUDY_COLUMNS)]
    if capacity and "capacity_without_caching_rps" in study:
        lines.append(T["prefix_capacity"].format(
            cached=capacity["one_replica"]["rate_rps"],
            plain=study["capacity_without_caching_rps"]))
    return "\n".join(lines)


DISTSERVE_COLUMNS = [("file_col", "file", "text"), ("placement_col", "placement", "text"),
                     ("who_col", "who", "text"), ("slo_col", "slo_attained", "pct")] + \
    latency_columns("p50", "p90", keys=("ttft", "tpot"))


def distserve_table(T, R):
    """--replay-distserve: each log's measured row, then C's."""
    rows = [{**r[side], "file": r["file"], "placement": r["placement"], "who": T[side]}
            for r in R["rows"] for side in ("measured", "simulated")]
    return "\n".join([T["distserve_replay"].format(profiles=R["profiles"]),
                      spec_table(T, rows, DISTSERVE_COLUMNS)])


PLACEMENT_COLUMNS = [("placement_col", "placement", "text"), ("gpus_col", "gpus", "d"),
                     ("goodput_col", "goodput_rps", ",.2f"),
                     ("per_gpu_col", "goodput_per_gpu", ",.3f"),
                     ("simulations_col", "simulations", "d"), ("search_col", "search_s", ".2f")]


def placement_table(T, R):
    """--placement-search: every placement, best first, and the best of each kind."""
    best = ", ".join(f"{kind}: {r['placement']}" for kind, r in R["best"].items())
    where = T["on_dask" if R["cluster"] else "on_workers"].format(**R)
    timing = T["placement_timing"].format(where=where, **R, **{
        f"{k}_ms": v * 1e3 for k, v in R["simulation_s"].items()})
    return "\n".join([T["placement_search"].format(**R), timing,
                      spec_table(T, R["rows"], PLACEMENT_COLUMNS),
                      T["placement_best"].format(best=best)])


# -----------------------------------------------------------------------------
# figures: A's and B's, and what every figure shares (drawn from the results dictionary alone)


# one palette for every figure: static red and continuous blue (as in the post), chunked green;
# prefill (compute) orange and decode (memory) purple; throughput dark grey
RED, BLUE, GREY = "#d62728", "#1f77b4", "#7f7f7f"

PREFILL, DECODE, DARK = "#ff7f0e", "#9467bd", "#333333"


def figure_note(results):
    env, cfg = results["environment"], results["config"]["model"]
    if "device" not in env:
        return f"simulation, {env['date'][:10]}"
    return (f"{env['device']}, {cfg['dtype']}, {cfg['layers']} layers x {cfg['hidden']} "
            f"({cfg['params'] / 1e6:,.0f} M params), {env['date'][:10]}")


NO_ROWS = "no measured rows to draw"  # what a plot returns that has nothing to draw


def save_figure(fig, results, path):
    """Note the device, dtype and model on the figure, then write it atomically."""
    import io
    import matplotlib.pyplot as plt
    fig.text(0.99, 0.005, figure_note(results), ha="right", va="bottom", fontsize=7, color=GREY)
    buf = io.BytesIO()
    fig.savefig(buf)  # (in the dpi and format draw_one sets for this figure)
    plt.close(fig)
    write_atomic(path, buf.getvalue(), mode="wb")


def plot_slot_panels(results, path, slots, panels, xlabel, title):
    """Occupied slots over time, static (red) over continuous (blue), the post's figure.

    panels: [(x, occupied, step, panel title)] for static, then continuous; step is
    matplotlib's: "post" when each value holds from its x on, "pre" when it holds up to it.
    """
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True, sharey=True)
    for ax, (x, occupied, step, panel_title), color in zip(axes, panels, (RED, BLUE)):
        ax.fill_between(x, occupied, step=step, color=color, alpha=0.8, linewidth=0)
        ax.set_ylim(0, slots * 1.05)
        ax.set_ylabel("occupied slots")
        ax.set_title(panel_title, fontsize=9, loc="left")
    axes[1].set_xlabel(xlabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_decode_batch(results, path):
    import matplotlib.pyplot as plt
    A = results["A"]
    if not any(r["context"] == A["context"] for r in measured(A["rows"])):
        return NO_ROWS
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax2 = ax.twinx()
    for mode, style in zip(A["modes"], ("--", "-") if len(A["modes"]) == 2 else ("-",)):
        rows = [r for r in measured(A["rows"]) if r["context"] == A["context"]
                and r["mode"] == mode]
        batch = [r["batch"] for r in rows]
        ax.plot(batch, [r["step_ms"] for r in rows], "o" + style, color=DECODE,
                label=f"step time = each user's wait ({mode})")
        ax.fill_between(batch, [r["p10_ms"] for r in rows], [r["p90_ms"] for r in rows],
                        color=DECODE, alpha=0.15, linewidth=0)
        ax2.plot(batch, [r["tokens_per_s"] for r in rows], "s" + style, color=DARK,
                 label=f"tokens/s ({mode})")
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in measured(A["rows"])})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("step time (ms; band: p10-p90)", color=DECODE)
    ax2.set_ylabel("throughput (tokens/s)", color=DARK)
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax.set_title(f"A: one decode step for the whole batch (context {A['context']} tokens per "
                 "row)", fontsize=10)
    fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.88), fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_moe_batching(results, path):
    """A for a mixture of experts: its decode step against batch beside its dense twin's, and
    the experts a step read beside what the routing's expectation says."""
    import matplotlib.pyplot as plt
    A = results["A"]
    if "dense_twin" not in A:
        return "needs A on a mixture of experts (--experts)"
    mode = A["modes"][-1]
    moe = [r for r in measured(A["rows"]) if r["context"] == A["context"] and r["mode"] == mode]
    twin = measured(A["dense_twin"]["rows"])
    if not moe or not twin:
        return NO_ROWS
    cfg = results["config"]["model"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for rows, color, label in ((moe, DECODE, f"{cfg['experts']} experts, "
                                f"{cfg['experts_per_token']} a token"),
                               (twin, DARK, f"dense twin (MLP {A['dense_twin']['ffn']:,} wide)")):
        batch = [r["batch"] for r in rows]
        ran = sorted({r.get("ran", r["mode"]) for r in rows})  # (the mode each row ran in)
        ax.plot(batch, [r["step_ms"] for r in rows], "o-", color=color,
                label=f"{label}, {'/'.join(ran)}")
        ax.fill_between(batch, [r["p10_ms"] for r in rows], [r["p90_ms"] for r in rows],
                        color=color, alpha=0.15, linewidth=0)
    batch = [r["batch"] for r in moe]
    ax2.plot(batch, [r["experts_touched"] for r in moe], "o-", color=DECODE, label="measured")
    ax2.plot(batch, [r["experts_expected"] for r in moe], "--", color=DARK,
             label="expected under the routing assumed")
    ax2.axhline(cfg["experts"], color="grey", linewidth=0.8)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(batch, [str(b) for b in batch])
        a.set_xlabel("decode batch size")
        a.set_ylim(bottom=0)
        a.legend(fontsize=8)
    ax.set_ylabel("step time (ms; band: p10-p90)")
    ax2.set_ylabel("distinct experts a layer reads")
    ax.set_title("A: the same active parameters, dense and routed", fontsize=10)
    ax2.set_title(f"experts read grow with the batch, up to all {cfg['experts']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, results, path)


def plot_phases(results, path, decode_steps=24):
    """One request to scale: a prefill block, then a train of decode steps; beneath, the same
    steps shared by a batch. Widths, rates and bounds are this run's measured B rows."""
    import matplotlib.pyplot as plt
    rows = measured(results["B"]["rows"])
    prefills = [r for r in rows if r["phase"] == "prefill"]
    decodes = [r for r in rows if r["phase"] == "decode"]
    mode = decodes[-1]["mode"] if decodes else None
    alone = next((r for r in decodes if r["batch"] == 1 and r["mode"] == mode), None)
    shared = max((r for r in decodes if r["mode"] == mode), key=lambda r: r["batch"],
                 default=None)
    if not prefills or not alone:
        return NO_ROWS
    pre = prefills[-1]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    lanes = [(1.0, alone, "one user")]
    if shared and shared["batch"] > 1:
        lanes.append((0.0, shared, f"batch of {shared['batch']}"))
    for y, dec, label in lanes:
        ax.broken_barh([(0, pre["step_ms"])], (y + 0.1, 0.8), color=PREFILL)
        ax.broken_barh([(pre["step_ms"] + i * dec["step_ms"], dec["step_ms"] * 0.85)
                        for i in range(decode_steps)], (y + 0.1, 0.8), color=DECODE)
        ax.text(pre["step_ms"] + decode_steps * dec["step_ms"], y + 0.5,
                f"  {label}: {dec['us_per_token']:,.0f} µs/token, {dec['tflops']:.3g} TFLOP/s, "
                f"{dec['bound']}-bound", va="center", fontsize=8)
    ax.text(pre["step_ms"] / 2, 1.5, f"prefill {pre['tokens']} tokens\n{pre['tflops']:.3g} "
            f"TFLOP/s\n{pre['bound']}-bound", ha="center", va="center", fontsize=8,
            color="white")
    ax.set_yticks([y + 0.5 for y, _, _ in lanes], [label for _, _, label in lanes])
    longest = pre["step_ms"] + decode_steps * max(d["step_ms"] for _, d, _ in lanes)
    ax.set_xlim(0, longest * 1.9)
    ax.set_xlabel(f"time (ms): prefill, then {decode_steps} decode steps of one token each")
    ax.set_title("two phases of one request, to scale (this run's B rows)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save_figure(fig, results, path)


def plot_prefill_decode(results, path):
    import matplotlib.pyplot as plt
    rows = measured(results["B"]["rows"])
    if not rows:
        return NO_ROWS
    labels = [f"prefill\n{r['tokens']} tokens" if r["phase"] == "prefill"
              else f"decode\nbatch {r['batch']}\n{r['mode']}" for r in rows]
    colors = [PREFILL if r["phase"] == "prefill" else DECODE for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars = ax.bar(labels, [r["tflops"] for r in rows], color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("achieved TFLOP/s (log)")
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['tflops']:.3g} TFLOP/s\n{r['intensity']:.0f} FLOP/byte",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_ylim(top=ax.get_ylim()[1] * 3)
    ax.set_title("B: achieved TFLOP/s of prefill and decode on the same device", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_roofline(results, path):
    """Achieved TFLOP/s against arithmetic intensity, under the two measured ceilings."""
    import matplotlib.pyplot as plt
    ceil = results["environment"]["ceilings"]
    points = []
    if "A" in results:
        points += [(r, f"b{r['batch']}", DECODE) for r in measured(results["A"]["rows"])
                   if r["context"] == results["A"]["context"]]
    if "B" in results:
        points += [(r, f"prefill {r['tokens']}" if r["phase"] == "prefill" else
                    f"B b{r['batch']}", PREFILL if r["phase"] == "prefill" else DARK)
                   for r in measured(results["B"]["rows"])]
    if not points:
        return NO_ROWS
    fig, ax = plt.subplots(figsize=(8, 4.8))
    xs = [r["intensity"] for r, _, _ in points] + [ceil["ridge_flop_per_byte"]]
    x = np.geomspace(min(xs) / 2, max(xs) * 2, 200)
    ax.plot(x, np.minimum(ceil["matmul_tflops"], ceil["bandwidth_gbs"] * x / 1e3), color=GREY,
            label=f"roofline: {ceil['bandwidth_gbs']:,.0f} GB/s, "
                  f"{ceil['matmul_tflops']:.3g} TFLOP/s")
    for i, (r, label, color) in enumerate(points):
        marker = "o" if r["mode"] == "eager" else "^"
        ax.scatter(r["intensity"], r["tflops"], color=color, marker=marker, zorder=3,
                   facecolors="none" if color == DECODE else color)
        # alternate labels above and below so neighbouring batches do not overprint
        ax.annotate(label, (r["intensity"], r["tflops"]), fontsize=7, xytext=(
            4, 5 if i % 2 else -9), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte, log)")
    ax.set_ylabel("achieved TFLOP/s (log)")
    ax.set_title("roofline: A (open, decode sweep) and B (filled) against the measured "
                 "ceilings; o eager, ^ CUDA graph", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_decode_context(results, path):
    """Decode step time and tokens/s against batch at each context: where the KV cache rules."""
    import matplotlib.pyplot as plt
    A = results["A"]
    mode = A["modes"][-1]
    if not measured(A["rows"]) or results["config"]["model"].get("arch") == "post":
        return NO_ROWS  # (the post's proxy has no KV cache: its context changes nothing)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(A["contexts"])))
    for context, color in zip(A["contexts"], colors):
        rows = [r for r in measured(A["rows"]) if r["context"] == context and r["mode"] == mode]
        batch = [r["batch"] for r in rows]
        ax1.plot(batch, [r["step_ms"] for r in rows], "o-", color=color, label=f"context "
                                                                             f"{context}")
        ax2.plot(batch, [r["tokens_per_s"] for r in rows], "o-", color=color)
        cross = A["kv_crossover_batch"][str(context)]
        if cross and batch and cross <= max(batch):
            ax1.axvline(cross, color=color, linestyle=":", linewidth=1)
    batches = sorted({r["batch"] for r in measured(A["rows"])})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("decode batch size")
    ax1.set_ylabel("step time (ms)")
    ax2.set_ylabel("tokens/s")
    ax1.legend(fontsize=8)
    ax1.set_title("step time (dotted: KV reads = weight reads)", fontsize=9)
    ax2.set_title("throughput", fontsize=9)
    fig.suptitle(f"A: decode at several contexts ({mode})", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


# -----------------------------------------------------------------------------
# figures of C and D: and the drawing of every figure (from the results dictionary alone)


def plot_occupancy(results, path):
    C = results["C"]
    if "static" not in C:  # a trace run has no step-count table
        return NO_ROWS
    panels = [(np.arange(len(C[p]["occupied"])) * C[p].get("occupied_bin_steps", 1),
               C[p]["occupied"], "post", f"{p} batching: {C[p]['steps']:,} steps, "
               f"{100 * C[p]['occupancy']:.1f}% occupancy") for p in ("static", "continuous")]
    plot_slot_panels(results, path, C["slots"], panels, "decode step",
                     f"{C['requests']} requests, {C['slots']} slots: continuous batching is "
                     f"{C['speedup']:.2f}x faster")


SCHEDULER_COLORS = {"static": RED, "continuous": BLUE, "chunked": "#2ca02c"}


def plot_latency_cdf(results, path):
    import matplotlib.pyplot as plt
    C = results["C"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for ax, key, label in zip(axes, ("ttft_s", "e2e_s"), ("time to first token", "end-to-end "
                                                                                  "latency")):
        for name, dist in C["distributions"].items():
            values = np.asarray(dist[key])
            ax.plot(values, np.linspace(0, 1, len(values)), color=SCHEDULER_COLORS[name],
                    label=name, linestyle="--" if name == "chunked" else "-")
        ax.set_xlabel(f"{label} (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"C: latency CDFs, {C['requests']:,} requests, {C['slots']} slots, arrivals "
                 f"{describe(TEXT['en'], C['arrivals'])}", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_rate_sweep(results, path):
    import matplotlib.pyplot as plt
    sweep = results["C"].get("rate_sweep") or []
    if not sweep:
        return NO_ROWS
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name in SCHEDULERS:
        ax.plot([p[name]["throughput_rps"] for p in sweep], [p[name]["e2e_p99_s"] for p in sweep],
                "o--" if name == "chunked" else "o-", color=SCHEDULER_COLORS[name], label=name,
                linewidth=3 if name == "continuous" else 1.5)  # visible under chunked
    ax.set_yscale("log")
    ax.set_xlabel("achieved throughput (requests/s)")
    ax.set_ylabel("p99 end-to-end latency (s, log)")
    ax.set_title("C: the serving curve: offered rate rising from "
                 f"{sweep[0]['rate_rps']:.3g} to {sweep[-1]['rate_rps']:.3g} requests/s",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


ORDER_STYLES = {"fcfs": (BLUE, "-"), "sjf": ("#2ca02c", "-"), "predicted": (PREFILL, "-"),
                "longest": (DECODE, "-"), "sjf_guarded": ("#2ca02c", "--"),
                "predicted_guarded": (PREFILL, "--")}


def plot_who_waits(results, path):
    """Latency against output length under each order of the queue: who waits for whom."""
    import matplotlib.pyplot as plt
    C = results["C"]
    if "orders" not in C:
        return NO_ROWS
    w = C["who_waits"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, label in zip(axes, ("ttft_mean_s", "per_token_mean_s"), (
            "time to first token (s, mean)", "end-to-end latency per output token (s, mean)")):
        for name, m in C["orders"].items():
            color, style = ORDER_STYLES[name]
            ax.plot(m["curve"]["length"], m["curve"][key], style, color=color, marker=".",
                    label=name.replace("_guarded", " + guard"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("output tokens (log)")
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"C: who waits: {w['requests']:,} requests, continuous batching, {w['slots']} "
                 f"slots, arrivals {describe(TEXT['en'], w['arrivals'])}; guard "
                 f"{w['guard_s']:.3g} s", fontsize=9)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


ROUTER_STYLES = {"round-robin": (GREY, "o"), "least-requests": (BLUE, "s"),
                 "power-of-two": ("#2ca02c", "^"), "least-kv": (PREFILL, "D"),
                 "cache-aware": ("#9467bd", "v")}


def plot_capacity(results, path):
    """The SLO met against the offered rate on one replica, and against the replicas behind
    each router at the target rate."""
    import matplotlib.pyplot as plt
    cap = results["C"].get("capacity")
    if not cap:
        return "needs an SLO (--slo-ttft-ms or --slo-tpot-ms)"
    fleet = "routers" in cap
    fig, axes = plt.subplots(1, 2 if fleet else 1, figsize=(9 if fleet else 6, 3.8),
                             squeeze=False)
    ax = axes[0][0]
    rate, met = zip(*sorted(cap["one_replica"]["tried"]))
    ax.plot(rate, met, "o-", color=BLUE, label="one replica (one arrival draw)")
    one = cap["one_replica"]["rate_rps"]
    if 0 < one < math.inf:
        ax.axvline(one, color=DARK, linestyle=":", linewidth=1)
        ax.annotate(f" capacity {one:.3g}/s", (one, 0.05), fontsize=8)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("share of requests within the SLO")
    ax.set_title("one replica", fontsize=9)
    if fleet:
        ax2 = axes[0][1]
        for group, line in (("routers", "-"), ("without_caching", "--")):
            for router, r in cap.get(group, {}).items():
                color, marker = ROUTER_STYLES[router]
                n, met2 = zip(*r["tried"])
                ax2.plot(n, met2, marker + line, color=color, alpha=0.8, label=router if
                         group == "routers" else f"{router}, no prefix caching")
        ax2.set_xlabel("replicas")
        ax2.xaxis.get_major_locator().set_params(integer=True)
        ax2.set_title(f"at {cap['target_rate']:g} requests/s", fontsize=9)
        ax2.legend(fontsize=7)
    for a in axes[0]:
        a.axhline(cap["attainment"], color=RED, linewidth=1, linestyle="--")
        a.set_ylim(-0.02, 1.02)
        a.grid(alpha=0.3)
    slo = ", ".join(f"{name} <= {1e3 * cap[key]:g} ms" for name, key in (
        ("TTFT", "slo_ttft_s"), ("TPOT", "slo_tpot_s")) if cap[key])
    fig.suptitle(f"C: capacity at the SLO ({slo}; dashed: {cap['attainment']:.0%} of "
                 "requests)", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


KV_STYLES = {"reserve": ("#8c564b", 3), "paged": ("#17becf", 1.5)}  # (color, held line's
# width: reserve's stays visible under paged's; a policy not named here takes the cycle's color)


def plot_kv_memory(results, path):
    """KV tokens held against tokens reserved or allocated, and requests running, over time
    (the continuous scheduler under each allocation policy)."""
    import matplotlib.pyplot as plt
    kv = results["C"].get("kv")
    if not kv or not kv["series"]:
        return NO_ROWS
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.4), sharex=True)
    for i, (policy, series) in enumerate(kv["series"].items()):
        (color, width), m = KV_STYLES.get(policy, (f"C{i}", 1.5)), kv[policy]["continuous"]
        ax1.plot(series["t_s"], series["allocated_tokens"], color=color, linestyle="--",
                 label=f"{policy}: allocated")
        ax1.plot(series["t_s"], series["held_tokens"], color=color,
                 linewidth=width,
                 label=f"{policy}: held ({m['utilization']:.0%} of allocated)")
        ax2.plot(series["t_s"], series["running"], color=color, drawstyle="steps-post",
                 label=f"{policy}: peak {m['peak_concurrency']}, mean "
                       f"{m['mean_concurrency']:.1f}, {m['preemptions']:,} preemptions")
    ax1.axhline(kv["budget_tokens"], color=GREY, linewidth=1)
    ax1.annotate(f"budget {kv['budget_tokens']:,} tokens", (0, kv["budget_tokens"]),
                 xytext=(2, -10), textcoords="offset points", fontsize=8, color=GREY)
    ax1.set_ylabel("KV tokens")
    ax1.set_ylim(0, kv["budget_tokens"] * 1.08)
    ax1.legend(fontsize=7, loc="center right")
    ax2.set_ylabel("requests running")
    ax2.set_xlabel("time (s)")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=7, loc="lower center")
    fig.suptitle(f"C: KV memory under continuous batching: {results['C']['slots']} slots, "
                 f"{kv['memory_bytes'] / 1e9:.2f} GB of KV cache", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_engine(results, path):
    """D's measured occupancy over wall time, in the form of occupancy.png."""
    D = results["D"]
    panels = []
    for policy in ("static", "continuous"):
        d = D[policy]
        t, running = d["timeline"]["t_s"], d["timeline"]["running"]
        # each step's slots fill the interval that ends with it, the first from t = 0
        panels.append(([0.0, *t], [running[0], *running], "pre",
                       f"{policy}: {d['wall_s']:,.1f} s measured ({d['predicted']['wall_s']:,.1f} "
                       f"s predicted), {d['steps']:,} steps, {100 * d['occupancy']:.1f}% "
                       "occupancy"))
    plot_slot_panels(results, path, D["slots"], panels, "wall time (s)",
                     f"D: a real engine, {D['requests']} requests, {D['slots']} slots: continuous "
                     f"is {D['speedup_measured']:.2f}x faster (C predicts "
                     f"{D['speedup_predicted']:.2f}x)")


def plot_prefix_cache(results, path):
    """--prefix-study: the share of prompt tokens found cached against the cache's capacity
    (the card alone, with a host tier, unlimited), and TTFT beside it."""
    import matplotlib.pyplot as plt
    study = results["C"].get("prefix_study")
    if not study:
        return "needs --prefix-study"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for tier, color, marker in (("card", BLUE, "o"), ("card_host", RED, "s")):
        rows = study[tier]
        if not rows:
            continue
        x = [r["capacity_tokens"] for r in rows]
        label = "card" if tier == "card" else f"card + host ({study['host_tokens']:,} tokens)"
        ax1.plot(x, [r["hit_ratio"] for r in rows], marker + "-", color=color, label=label)
        if tier == "card_host":
            ax1.plot(x, [r["card_hit_ratio"] for r in rows], marker + ":", color=color,
                     label="of which on the card", alpha=0.6)
        for stat, style in (("p50", "-"), ("p99", "--")):
            ax2.plot(x, [r["ttft_s"][stat] for r in rows], marker + style, color=color,
                     label=f"{label}: TTFT {stat}")
    unlimited = study["unlimited"][0]
    ax1.axhline(unlimited["hit_ratio"], color=DARK, linestyle=":", linewidth=1,
                label=f"unlimited: {unlimited['hit_ratio']:.1%}")
    for stat, style in (("p50", "-"), ("p99", "--")):
        ax2.axhline(unlimited["ttft_s"][stat], color=DARK, linestyle=style, linewidth=0.8,
                    alpha=0.6, label=f"unlimited: TTFT {stat}")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("KV cache on the card (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("prompt tokens found cached")
    ax1.set_ylim(0, 1)
    ax2.set_ylabel("TTFT (s)")
    ax2.set_yscale("log")
    fig.suptitle("C: prefix caching against the cache's capacity (continuous batching)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_placements(results, path, shown=4):
    """--placement-search: SLO attainment against the rate a card (DistServe's figure) at the
    rates the search tried, for the `shown` best placements of each kind; and every
    placement's goodput a card."""
    import matplotlib.pyplot as plt
    R = results["placement_search"]
    rows = R["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.9 + 0.22 * len(rows) + 1.8),
                                   gridspec_kw={"width_ratios": (1, 1.2)})
    colors = {"colocated": BLUE, "disaggregated": PREFILL}
    for kind, color in colors.items():
        best = [r for r in rows if (r["kind"] == "disaggregated") == (kind != "colocated")]
        for rank, r in enumerate(best[:shown]):
            tried = sorted(r["tried"])
            ax1.plot([rate / r["gpus"] for rate, _, _ in tried], [met for _, met, _ in tried],
                     "o-" if kind == "colocated" else "s--", color=color, markersize=3,
                     alpha=1.0 - 0.2 * rank, label=r["placement"])
    ax1.axhline(SEARCH_ATTAINMENT, color=DARK, linewidth=0.8, linestyle=":")
    ax1.set_xlabel("requests/s a card")
    ax1.set_ylabel("requests within TTFT 0.2 s and TPOT 0.1 s")
    ax1.set_ylim(0, 1.02)
    ax1.legend(fontsize=6)
    ax1.grid(alpha=0.3)
    y = range(len(rows))[::-1]
    ax2.barh(y, [r["goodput_per_gpu"] for r in rows],
             color=[colors["disaggregated" if r["kind"] == "disaggregated" else "colocated"]
                    for r in rows])
    ax2.set_yticks(list(y), [f"{r['placement']} ({r['gpus']})" for r in rows], fontsize=6)
    ax2.set_xlabel(f"goodput a card (requests/s at {SEARCH_ATTAINMENT:.0%} within the SLO)")
    ax2.grid(alpha=0.3, axis="x")
    fig.suptitle(f"C: OPT-13B's placements on up to {R['budget']} A100-80GB, DistServe's "
                 "profile: colocated (blue) and disaggregated (orange)", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


FIGURES = {"phases.png": ("B", plot_phases),
           "occupancy.png": ("C", plot_occupancy),
           "latency_cdf.png": ("C", plot_latency_cdf),
           "rate_sweep.png": ("C", plot_rate_sweep),
           "kv_memory.png": ("C", plot_kv_memory),
           "who_waits.png": ("C", plot_who_waits),
           "capacity.png": ("C", plot_capacity),
           "prefix_cache.png": ("C", plot_prefix_cache),
           "engine.png": ("D", plot_engine),
           "decode_batch.png": ("A", plot_decode_batch),
           "moe_batching.png": ("A", plot_moe_batching),
           "prefill_decode.png": ("B", plot_prefill_decode),
           "roofline.png": ("AB", plot_roofline),
           "decode_context.png": ("A", plot_decode_context),
           "placements.png": (("placement_search",), plot_placements)}


FORMATS = ("png", "svg")


def draw_figures(results, out_dir, dpi=100, fmt="png", jobs=1):
    """Every figure the results support -> (written, missing: {name: why not}), drawn in up to
    `jobs` worker processes. A plot returns None, or why it could not draw."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (once, before the workers are forked)
    written, missing, calls = [], {}, []
    for name, (experiment, plot) in FIGURES.items():
        name = name.replace(".png", "." + fmt)
        if not any(e in results for e in experiment):
            missing[name] = f"needs experiment {' or '.join(experiment)}"
        else:
            calls.append((draw_one, (plot, results, os.path.join(out_dir, name), dpi, fmt)))
    calls.sort(key=lambda c: os.path.basename(c[1][2]).split(".")[0] not in SLOWEST_FIGURES)
    for (_, (_, _, path, _, _)), why in zip(calls, run_parallel(calls, jobs)):
        name = os.path.basename(path)
        if why is None:
            written.append(name)
        else:
            missing[name] = why
    names = [n.replace(".png", "." + fmt) for n in FIGURES]  # (written in FIGURES' order)
    return sorted(written, key=names.index), missing


# the figures slowest to draw (0.5-1 s each on a 2-core CPU), sent to the workers first
SLOWEST_FIGURES = ("who_waits", "rate_sweep", "roofline", "kv_memory")


def draw_one(plot, results, path, dpi, fmt):
    """One figure in its dpi and format: matplotlib's savefig settings, for this call alone."""
    import matplotlib
    with matplotlib.rc_context({"savefig.dpi": dpi, "savefig.format": fmt}):
        return plot(results, path)


# -----------------------------------------------------------------------------
# flag types: the parser's form: one-line errors, the help's layout, vLLM's --goodput


class Goodput(argparse.Action):
    """vLLM's --goodput KEY:MS ...: ttft and tpot onto --slo-ttft-ms and --slo-tpot-ms."""
    def __call__(self, parser, namespace, values, option_string=None):
        in_s = milliseconds(1e-6, 1e12)
        for value in values:
            key, _, ms = value.partition(":")
            if key not in ("ttft", "tpot"):
                parser.error(f"--goodput {value}: C's SLOs are ttft:MS and tpot:MS")
            try:
                setattr(namespace, f"slo_{key}_s", in_s(ms))
            except argparse.ArgumentTypeError as e:
                parser.error(f"--goodput {value}: {e}")
class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UsageError(message)
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help at a fixed width (the same in every terminal), a flag's spellings before its
    one metavar: "--slots, --max-num-seqs N"."""
    def __init__(self, prog):
        super().__init__(prog, width=HELP_WIDTH, max_help_position=30)

    def _format_action_invocation(self, action):
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        return ", ".join(action.option_strings) + " " + self._format_args(
            action, self._get_default_metavar_for_optional(action))
# -----------------------------------------------------------------------------
# flags: argv to a RunConfig, in groups by task

HELP_WIDTH = 100

METAVARS = {integer: "N", integers: "N,..", number: "X", numbers: "X,..",
            milliseconds: "MS", attainment: "P", fraction: "X", rate_value: "RATE"}


def field_default(name):
    """A RunConfig field's default as a flag's help writes it (a tuple comma-separated)."""
    value = RUN_FIELDS[name].default
    return ",".join(map(str, value)) if isinstance(value, tuple) else f"{value}"


def add_flag(group, *flags, shown=None, **kw):
    """A flag (and its vLLM spellings) whose destination is the RunConfig field of its name
    (or `dest`), its default that field's unless given, its help ending in "(default: ...)":
    `shown`, else the default itself. Each flag and its default declared once."""
    dest = kw.setdefault("dest", flags[0][2:].replace("-", "_"))
    if dest in RUN_FIELDS and "default" not in kw:
        kw["default"] = RUN_FIELDS[dest].default
    if kw.get("action") not in ("store_true", "store_false", "help"):
        shown = kw.get("default") if shown is None else shown
        if isinstance(shown, tuple):
            shown = ",".join(map(str, shown))
        assert shown is not None, f"{flags[0]}: its help must say its default"
        kw["help"] = f"{kw['help']} (default: {shown})"
        maker = getattr(kw.get("type"), "maker", kw.get("type"))
        if maker in METAVARS and "metavar" not in kw:
            kw["metavar"] = METAVARS[maker]
    return group.add_argument(*flags, **kw)


def build_parser():
    p = ArgumentParser(prog="NN_40_serving.py", usage=USAGE, description=DESCRIPTION,
                       epilog=EPILOG, formatter_class=HelpFormatter, add_help=False)
    for flags in (workload_flags, prefix_flags, model_flags, scheduler_flags, slo_flags,
                  measurement_flags, d_flags, output_flags):
        flags(p)
    return p


def workload_flags(p):
    w = p.add_argument_group("workload: the requests C (and D) serve")
    add_flag(w, "--requests", "--num-prompts", type=integer(), help="requests generated")
    add_flag(w, "--seed", type=integer(0, 2**32 - 1),
             help="lengths' draw, weights, D's prompts; 3: the post's")
    add_flag(w, "--prompt-len", type=integer(), default=None, help="prompt tokens a request",
             shown=f"{field_default('prompt_len')}; D on CPU: {ENGINE_CPU['prompt_len']}")
    add_flag(w, "--lengths-file", metavar="PATH", shown="the post's law",
             help="output lengths, one a line ('#' comments)")
    add_flag(w, "--trace", metavar="FILE", shown="none", help="CSV or JSONL of [arrival_s,]"
             "prompt_tokens,output_tokens, Azure's, BurstGPT's, Mooncake's; vLLM bench JSON")
    add_flag(w, "--trace-limit", type=integer(), shown="all", help="the trace's first N rows")
    add_flag(w, "--rate", "--request-rate", type=rate_value, shown="all at t=0",
             help="Poisson arrivals a second, or 'trace': its times")
    add_flag(w, "--burstiness", type=number(1e-3, 1e3),
             help="the gaps' gamma shape: 1 Poisson, below 1 burstier")
    add_flag(w, "--rates", type=numbers(*RATES), shown="0.2-1.2x capacity",
             help="the rate sweep, requests/s")


def prefix_flags(p):
    """Two RunConfig groups' flags in one: the workload's prompts that repeat (--prefix-len
    to --think-time-s) and the scheduler's cache that keeps them (the other three)."""
    w = p.add_argument_group("shared prefixes: prompts that repeat, and the cache that keeps them")
    add_flag(w, "--enable-prefix-caching", action="store_true",
             help="paged blocks keep computed prefixes (the policy 'prefix'; vLLM's flag)")
    add_flag(w, "--host-kv-gb", type=number(1e-3, 1e6), shown="none",
             help="prefix cache: a host-memory tier, GB")
    add_flag(w, "--prefix-len", type=integer(0, 10**6), help="system prompts' tokens (generated)")
    add_flag(w, "--num-prefixes", type=integer(1, 10**5), help="how many system prompts")
    add_flag(w, "--prefix-share", type=number(1e-3, 1.0),
             help="share of conversations one opens")
    add_flag(w, "--prefix-zipf", type=number(0.0, 10.0),
             help="popularity: the i-th drawn as 1/i^zipf")
    add_flag(w, "--turns", "--num-turns", type=integer(1, 1000),
             help="turns a conversation (prompt: the one before, its answer, a message)")
    add_flag(w, "--think-time-s", type=number(0.0, 1e6), help="mean gap between turns, s")
    add_flag(w, "--prefix-study", action="store_true",
             help="hits and TTFT against the cache's capacity (prefix_cache.png)")


def model_flags(p):
    """The model's shape (each flag a ModelConfig field, unset unless given: the preset's),
    and the hardware it runs on or is planned for."""
    m = p.add_argument_group(
        f"model and hardware (on CPU the post's model is a preset: {CPU_PRESET.layers} layers, "
        f"hidden {CPU_PRESET.hidden}, dtype by a probe)")
    add_flag(m, "--model", metavar="NAME", default="post",
             type=usage_type(functools.partial(named, kind="model")),
             help="a named shape, random weights (list: --catalog)")
    add_flag(m, "--model-config", metavar="JSON", shown="none",
             help="a Hugging Face config.json's shape")
    add_flag(m, "--arch", choices=["transformer", "post"], default="transformer",
             help="A and B: a transformer, or the post's bare matmuls")
    for field in ("layers", "hidden", "heads", "vocab", "max_positions"):
        add_flag(m, "--" + field.replace("_", "-"), type=integer(), default=None,
                 help=field.replace("_", " "), shown=getattr(ModelConfig, field))
    add_flag(m, "--head-dim", dest="head_width", type=integer(), shown="hidden / heads",
             help="a head's width")
    add_flag(m, "--kv-heads", type=integer(), shown="--heads", help="K/V heads (GQA; 1: MQA)")
    add_flag(m, "--mlp", choices=["gelu", "gated"], shown="the preset's",
             help="gelu (the post's) or gated (Llama's)")
    add_flag(m, "--ffn-hidden", type=integer(), shown="4h gelu, 8h/3 gated", help="MLP width")
    add_flag(m, "--experts", type=integer(), shown="none", help="routed experts a layer (MoE)")
    add_flag(m, "--experts-per-token", type=integer(), shown="none", help="experts a token")
    add_flag(m, "--expert-ffn", type=integer(), shown="--ffn-hidden", help="an expert's width")
    add_flag(m, "--expert-skew", type=number(0.0, 10.0), shown="0",
             help="routing skew: expert i drawn as i^-S")
    add_flag(m, "--dtype", choices=list(DTYPES), shown=f"{ModelConfig.dtype}; CPU: a probe's",
             help="A, B, D's type")
    add_flag(m, "--weights", choices=[w for w in WEIGHT_FORMATS if w != "fp32"],
             shown="--dtype's", help="C's weight format (fp8 W8A8; int: weight-only)")
    add_flag(m, "--kv-dtype", "--kv-cache-dtype", choices=KV_DTYPES, default=None,
             shown="auto: --dtype's", help="C's KV-cache type")
    add_flag(m, "--device", choices=["auto", "cuda", "cpu"], default="auto",
             help="A, B and D's device")
    add_flag(m, "--gpu", metavar="CARD", shown="measured, or RTX 5080",
             type=usage_type(functools.partial(named, kind="card")),
             help="C's card (list: --catalog)")
    add_flag(m, "--tp", "--tensor-parallel-size", type=integer(1, 64),
             help="--gpu cards a replica spans")
    add_flag(m, "--ep", type=integer(1, 64), help="expert parallel: --gpu cards a group")
    add_flag(m, "--engine-profile", metavar="NAME|JSON", type=usage_type(profile_named),
             default=None, shown=DEFAULT_PROFILE, help="how near the engine gets to --gpu's "
             "peaks: roofline, tensorrt-llm, gpt-fast, vllm, sglang, or --calibrate's file")
    add_flag(m, "--cost", choices=["measured", "analytic"], shown="measured when A runs",
             help="C's prices: A/B's rows or a roofline")
    add_flag(m, "--peak-bandwidth-gbs", type=number(1e-3, 1e7), shown="measured",
             help="bandwidth ceiling, GB/s, to use instead")
    add_flag(m, "--peak-tflops", type=number(1e-6, 1e7), shown="measured",
             help="matmul TFLOP/s ceiling to use instead")


def scheduler_flags(p):
    s = p.add_argument_group("scheduler and KV cache (C; D takes --order)")
    add_flag(s, "--slots", "--max-num-seqs", type=integer(), default=None,
             shown="the engine's on --gpu, else 32", help="requests run at once")
    add_flag(s, "--chunk-tokens", "--max-num-batched-tokens", type=integer(), default=None,
             shown="the engine's on --gpu, else 512", help="tokens a step")
    add_flag(s, "--order", choices=ORDERS, help="who takes a free seat first")
    add_flag(s, "--predict-sigma", type=number(0.0, 10.0),
             help="predicted order: lengths x e^N(0, s^2)")
    add_flag(s, "--max-wait-s", type=number(1e-6, 1e12), shown="off",
             help="waited this long: goes first")
    add_flag(s, "--replicas", type=integer(1, REPLICAS_MAX), help="replicas behind a router")
    add_flag(s, "--router", choices=("all",) + tuple(ROUTERS), help="routers compared")
    add_flag(s, "--kv-policy", choices=[*KV_MANAGERS, "both"],
             help="prompt + max output reserved, or paged blocks")
    add_flag(s, "--kv-memory-gb", type=number(1e-6, 1e6), help="KV cache, GB",
             shown=f"{KV_MEMORY_FRACTION:g} x memory - weights; CPU {CPU_KV_MEMORY_GB:g}")
    add_flag(s, "--kv-tokens", type=integer(), shown="from GB", help="KV cache, tokens")
    add_flag(s, "--kv-fraction", "--gpu-memory-utilization", "--mem-fraction-static",
             type=number(0.01, 1.0), shown="the engine's", help="memory share (vLLM: of the card; "
             "SGLang: for weights + KV; else: of what is free)")
    add_flag(s, "--block-tokens", "--block-size", type=integer(), help="paged: tokens a block")
    add_flag(s, "--watermark", type=fraction, help="paged: share of blocks kept free")
    add_flag(s, "--max-output", type=integer(), shown=f"longest; law: {LENGTH_MAX}",
             help="reserve: output tokens held")


def slo_flags(p):
    s = p.add_argument_group("SLOs and capacity (these run C alone unless --experiments)")
    add_flag(s, "--slo-ttft-ms", dest="slo_ttft_s", type=milliseconds(1e-6, 1e12),
             shown="none", help="TTFT bound: goodput and capacity")
    add_flag(s, "--slo-tpot-ms", dest="slo_tpot_s", type=milliseconds(1e-6, 1e12),
             shown="none", help="TPOT bound")
    s.add_argument("--goodput", nargs="+", action=Goodput, metavar="KEY:MS",
                   help="vLLM's form: ttft:1000 tpot:50 (default: none)")
    add_flag(s, "--slo-attainment", type=attainment,
             help="requests meeting the SLOs: 0.99, p99 or 99%%")
    add_flag(s, "--target-rate", type=number(*RATES), shown="none",
             help="requests/s: fewest replicas for it")


def measurement_flags(p):
    m = p.add_argument_group("measurement: what runs and how it is timed")
    add_flag(m, "--experiments", type=experiment_letters, metavar="ABCD", default=None,
             shown="ABCD; C with an SLO", help="which of A, B, C, D run")
    add_flag(m, "--quick", action="store_true", help="shrink every experiment (a smoke run)")
    add_flag(m, "--batch-sizes", type=integers, help="A's decode batches")
    add_flag(m, "--context", type=integer(), help="KV tokens at a decode")
    add_flag(m, "--contexts", type=integers, default=None, shown="--context,1024[,4096 CUDA]",
             help="A's contexts")
    add_flag(m, "--graphs", choices=["on", "off", "both"], default=None,
             shown="both on CUDA", help="CUDA graphs for decode")
    add_flag(m, "--prefill-lengths", type=integers, help="B's prompt lengths")
    add_flag(m, "--decode-batches", type=integers, help="B's decode batches")
    add_flag(m, "--warmup", type=integer(0), help="untimed calls a shape")
    add_flag(m, "--reps", type=integer(), help="timed calls a shape, at most")
    add_flag(m, "--jobs", type=integer(1, 1024), default=os.cpu_count() or 1,
             shown=f"the cores: {os.cpu_count()}", help="C's worker processes")
    add_flag(m, "--cluster", metavar="ADDRESS", default=None, shown="none",
             help="Dask scheduler for the placements (local: start one)")


def d_flags(p):
    d = p.add_argument_group("engine check (D; on CUDA its defaults are C's flags)")
    add_flag(d, "--engine-requests", type=integer(), default=None,
             shown=f"CPU {ENGINE_CPU['requests']}, CUDA --requests", help="requests served")
    add_flag(d, "--engine-slots", type=integer(), default=None,
             shown=f"CPU {ENGINE_CPU['slots']}, CUDA --slots", help="the engine's slots")
    add_flag(d, "--engine-shrink", type=integer(), default=None,
             shown=f"CPU {ENGINE_CPU['shrink']}, CUDA 1", help="output lengths divided by")
    add_flag(d, "--engine-attention", choices=["auto", "spans", "padded"],
             shown="CUDA padded, else spans", help="rows at mixed positions")


def output_flags(p):
    o = p.add_argument_group("output")
    add_flag(o, "-h", "--help", action="help", help="show this and exit")
    add_flag(o, "--out", metavar="DIR", help="results.json and the figures")
    add_flag(o, "--no-figures", dest="figures", action="store_false", help="draw none")
    add_flag(o, "--format", choices=FORMATS, help="the figures' format")
    add_flag(o, "--dpi", type=integer(20, 1000), help="figures: 100 is 800 px wide")
    add_flag(o, "--lang", choices=list(TEXT), help="what is printed: en, or ko")
    add_flag(o, "--save-requests", metavar="CSV", shown="none", help="every request's times")
    add_flag(o, "--catalog", action="store_true", help="every named model on every named card")
    add_flag(o, "--validate", nargs="?", const=PUBLISHED_CSV, metavar="CSV", default=None,
             shown="off", help="predict published measurements, exit")
    add_flag(o, "--calibrate", metavar="RUN", nargs="+", default=None, shown="off",
             help="fit --engine-profile to measured runs, exit")
    add_flag(o, "--calibration", metavar="CSV", default=CALIBRATION_CSV,
             shown="../shared/published", help="rows profiles were fitted on")
    add_flag(o, "--replot", metavar="JSON", default=None, shown="off",
             help="redraw a results.json's figures")
    add_flag(o, "--replay-distserve", metavar="DIR", default=None, shown="off",
             help="DistServe's logged runs on their placements, exit")
    add_flag(o, "--kv-link-gbs", type=number(1e-6, 1e6), default=None,
             shown="the card's link", help="the KV hand-off's GB/s")
    add_flag(o, "--kv-link-latency-us", type=number(0, 1e9), default=None, shown="0",
             help="a KV hand-off's latency")
    add_flag(o, "--kv-layerwise", action="store_true",
             help="the hand-off sends each layer's KV as the prefill makes it")
    add_flag(o, "--pp-micro-batches", type=integer(), default=None, shown="one a stage",
             help="decode batches in flight on PP stages")
    add_flag(o, "--placement-search", metavar="DIR", default=None, shown="off",
             help="OPT-13B's placements on A100s by goodput per card, exit")
    add_flag(o, "--gpu-budget", type=integer(1, 64), default=4,
             help="the placement search's cards")


def parse_args(argv):
    """argv -> RunConfig (see run_config)."""
    return run_config(build_parser().parse_args(argv))


def run_config(args):
    """Parsed flags -> RunConfig: every field its flag's, then what depends on the device
    (resolved when A, B or D runs), the CPU preset, --quick and D's engine."""
    check_flags(args)
    experiments = chosen_experiments(args)
    if args.cost == "measured" and "A" not in experiments:
        raise UsageError("--cost measured needs experiment A in the same run")
    device = resolve_device(args.device) if set("ABD") & set(experiments) else None
    cuda, on_cpu = (device is not None and device.type == t for t in ("cuda", "cpu"))
    if args.graphs in ("on", "both") and device is not None and not cuda:
        raise UsageError(f"--graphs {args.graphs}: CUDA graphs need a CUDA device")
    model, preset = model_config(args, on_cpu)
    if model.mla and set(experiments) - {"C"}:
        raise UsageError(f"{model.name}: latent attention is priced by C only for now (A, B "
                         "and D run standard attention): add --experiments C")
    contexts = args.contexts or ((args.context, 1024, 4096) if cuda else (args.context, 1024))
    if args.arch == "post":  # no KV cache: the context changes nothing
        contexts = (args.context,)
    graphs = {"on": "graph", "off": "eager", "both": "both", None: "both" if cuda else "eager"}
    run = RunConfig.of(**{**{k: v for k, v in vars(args).items() if k in RUN_FIELDS},
                       "model": model, "experiments": experiments,
                       "device": device and device.type, "graphs": graphs[args.graphs],
                       "contexts": tuple(sorted(set(contexts) | {args.context})),
                       "prompt_len": args.prompt_len or RUN_FIELDS["prompt_len"].default,
                       "preset": preset, "dtype_given": args.dtype is not None,
                       "engine_profile": args.engine_profile or DEFAULT_PROFILE,
                       "slots": args.slots or SchedulerConfig.slots,
                       "chunk_tokens": args.chunk_tokens or SchedulerConfig.chunk_tokens,
                       **engine_fields(args, on_cpu)})
    run = run.replace(**serving_limits(run, args))
    longest = max(max(run.measurement.contexts) + 1, max(run.measurement.prefill_lengths))
    if device is not None and model.arch == "transformer" and longest > model.max_positions:
        raise UsageError(f"a sequence of {longest} tokens exceeds --max-positions "
                         f"{model.max_positions}")
    if run.hardware.gpu:
        check_card_fits(run)
    return quick_run(run) if run.measurement.quick else run


def serving_limits(run, args):
    """The seats and step budget C serves with where it answers for an engine (capacity,
    fleets, the rate sweep, a trace's replay): the flags where given, else with --gpu the
    engine profile's defaults on that card (see EngineRules.defaults), else the post's. The
    post's own table keeps --slots or the post's 32 seats."""
    slots, chunk, source = run.scheduler.slots, run.scheduler.chunk_tokens, "post"
    if run.hardware.gpu:
        profile = run_profile(run)
        slots, chunk, source = ENGINE_RULES[profile.rules].defaults(
            profile, run.hardware.model, GPUS[run.hardware.gpu], run.hardware.tp, run.hardware.ep)
    if args.slots or args.chunk_tokens:
        source = "flag" if args.slots and args.chunk_tokens else source + "+flag"
    return {"serve_slots": args.slots or slots, "serve_chunk_tokens": args.chunk_tokens or chunk,
            "serve_source": source}


def engine_fields(args, on_cpu):
    """D's engine as the flags give it, else ENGINE_QUICK with --quick, ENGINE_CPU on CPU, else
    the run's own requests, slots and prompt tokens; the system prompt (--prefix-len) first."""
    engine = ENGINE_QUICK if args.quick else ENGINE_CPU if on_cpu else {
        "requests": args.requests, "slots": args.slots or SchedulerConfig.slots,
        "prompt_len": args.prompt_len or RUN_FIELDS["prompt_len"].default, "shrink": 1}
    return {"engine_requests": args.engine_requests or engine["requests"],
            "engine_slots": args.engine_slots or engine["slots"],
            "engine_prompt_len": args.prefix_len + (args.prompt_len or engine["prompt_len"]),
            "engine_shrink": args.engine_shrink or engine["shrink"]}


def chosen_experiments(args):
    """--experiments, else AB for the post's proxy, C alone for a capacity question (an SLO
    or a target rate: the simulation answers it in seconds), else all four."""
    if args.experiments:
        return args.experiments
    if args.arch == "post":
        return "AB"
    return "C" if args.target_rate or args.slo_ttft_s or args.slo_tpot_s else EXPERIMENTS


def check_flags(args):
    """Flags that contradict each other: one line each."""
    if args.arch == "post" and set(args.experiments or "") - set("AB"):
        raise UsageError("--arch post: the post's proxy has no attention and no KV cache, so "
                         "only A and B run on it; run C and D without --arch post")
    if args.arch == "post" and args.model != "post":
        raise UsageError(f"--arch post times the post's proxy; --model {args.model} names a "
                         "transformer: give one or the other")
    if args.target_rate and not (args.slo_ttft_s or args.slo_tpot_s):
        raise UsageError("--target-rate: give the SLO it must be served at (--slo-ttft-ms, "
                         "--slo-tpot-ms)")
    if args.kv_fraction is not None and (args.kv_memory_gb or args.kv_tokens):
        raise UsageError("--kv-fraction sizes the engine's KV cache by its rule; --kv-memory-gb "
                         "and --kv-tokens give its size: give one or the other")
    if args.rate == "trace" and not args.trace:
        raise UsageError("--rate trace: the trace has no timestamps (give --trace FILE.csv)")
    for flag, given in (("--tp", args.tp > 1), ("--ep", args.ep > 1),
                        ("--engine-profile", args.engine_profile),
                        ("--kv-fraction", args.kv_fraction)):
        if given and not args.gpu:
            raise UsageError(f"{flag} prices a named card: give --gpu")
    if args.ep > 1 and args.tp > 1:
        raise UsageError("--ep prices data-parallel attention beside expert parallelism: give "
                         "--tp 1")
    manager = KV_MANAGERS.get(args.kv_policy)  # (None: both)
    if args.enable_prefix_caching and manager and not (manager.caching or
                                                       manager.tracks_prefixes):
        raise UsageError(f"--enable-prefix-caching: --kv-policy {args.kv_policy} keeps no "
                         "prefixes; give --kv-policy paged (or both)")
    caching = args.enable_prefix_caching or (manager and manager.tracks_prefixes)
    for flag, given in (("--host-kv-gb", args.host_kv_gb), ("--router cache-aware",
                                                          args.router == "cache-aware")):
        if given and not caching:
            raise UsageError(f"{flag} works with a prefix cache: add --enable-prefix-caching "
                             "(with --kv-policy paged or both) or give --kv-policy prefix")
    if (args.weights or args.kv_dtype) and set(chosen_experiments(args)) - {"C"}:
        raise UsageError("--weights and --kv-dtype price C only (A, B and D time --dtype for "
                         "real): add --experiments C")


MODEL_FLAGS = ("layers", "hidden", "heads", "kv_heads", "mlp", "ffn_hidden", "vocab",
               "max_positions", "dtype", "weights", "kv_dtype", "head_width", "experts",
               "experts_per_token", "expert_ffn", "expert_skew")


def model_config(args, on_cpu):
    """The model: the --model preset (the post's on CPU: CPU_PRESET) with the fields given.
    -> (ModelConfig, the fields the CPU preset set)"""
    fields = {f: getattr(args, f) for f in MODEL_FLAGS}
    if args.quick and on_cpu:  # (a smoke run: a model that reads a fraction of the preset's)
        fields["layers"] = fields["layers"] or 2
        if args.model == "post":
            fields["hidden"] = fields["hidden"] or 512
    given = {f: v for f, v in fields.items() if v is not None}
    cpu_preset = on_cpu and args.model == "post" and not args.model_config
    base = read_model_config(args.model_config) if args.model_config else \
        CPU_PRESET if cpu_preset else MODELS[args.model]
    model = dataclasses.replace(base, arch=args.arch, **given)
    if (args.model != "post" or args.model_config) and given:  # (the banner says what ran)
        model = dataclasses.replace(model, name=base.name + " (" + ", ".join(
            f"{f.replace('_', '-')}={v}" for f, v in given.items()) + ")")
    preset = tuple(f"{f}={getattr(CPU_PRESET, f)}" for f in ("layers", "hidden", "heads",
                                                             "vocab", "max_positions")
                   if fields[f] is None and cpu_preset)
    if model.hidden % model.heads and not model.head_width:
        raise UsageError(f"--hidden {model.hidden} is not divisible by --heads {model.heads} "
                         "(give --head-dim)")
    if model.n_kv_heads > model.heads or model.heads % model.n_kv_heads:
        raise UsageError(f"--kv-heads {model.n_kv_heads} must divide --heads {model.heads}")
    if bool(model.experts) != bool(model.experts_per_token) or \
            model.experts_per_token > model.experts:
        raise UsageError(f"--experts {model.experts} and --experts-per-token "
                         f"{model.experts_per_token}: give both, at most as many per token as "
                         "there are experts")
    if model.expert_skew and not model.experts:
        raise UsageError("--expert-skew skews the routing of experts: give a mixture of experts")
    if model.positions == "rope" and model.head_dim % 2:
        raise UsageError(f"rotary positions need an even head width, not {model.head_dim}")
    return model, preset


def quick_run(run):
    """--quick: every experiment small enough for a smoke run."""
    timed = run.measurement
    context = min(timed.context, 64)
    return run.replace(
        batch_sizes=tuple(b for b in timed.batch_sizes if b <= 32) or (1,), context=context,
        contexts=(context,), prefill_lengths=tuple(max(1, t // 8) for t in timed.prefill_lengths),
        warmup=min(timed.warmup, 1), reps=min(timed.reps, 5),
        prompt_len=min(run.workload.prompt_len, 32), time_budget_s=0.2)


# -----------------------------------------------------------------------------
# the run: main, the banner, the experiments in order, results.json and the figures


def prepare_out_dir(path):
    """Create OUT and prove it is writable before any experiment runs."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"cannot write to output directory {path}: {e.strerror}")


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


def environment(run, device, argv):
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": " ".join(["NN_40_serving.py"] + list(argv)),
           "python": platform.python_version(), "torch": torch.__version__,
           "numpy": np.__version__}
    if device is not None:
        env.update({"device": device_name(device), "device_type": device.type,
                    "cuda": torch.version.cuda if device.type == "cuda" else None,
                    "threads": torch.get_num_threads()})
    return env


def banner(results, T):
    env, cfg = results["environment"], results["config"]["model"]
    lines = [f"NN_40_serving  {env['date']}", T["command"].format(**env),
             f"python {env['python']}, torch {env['torch']}, numpy {env['numpy']}"]
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


def replot(args):
    """--replot: redraw from a saved results.json; no experiment runs, no device is touched."""
    try:
        with open(args.replot, encoding="utf-8") as f:
            results = json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read {args.replot}: {e.strerror}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{args.replot}: not a JSON file")
    if not (isinstance(results, dict) and isinstance(results.get("environment"), dict)
            and isinstance(results.get("config"), dict)):
        raise UsageError(f"{args.replot}: not a results.json written by NN_40_serving.py")
    prepare_out_dir(args.out)
    try:
        written, missing = draw_figures(results, args.out, args.dpi, args.format, args.jobs)
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise UsageError(f"{args.replot}: lacks a field the figures need ({e!r}); it may come "
                         "from another version of the script")
    print(fit_lines(f"redrew {', '.join(written) or 'nothing'} into {args.out}"))
    for name, why in missing.items():
        print(f"could not draw {name}: {why}")
    return {"written": written, "missing": missing}


def run_validation(args):
    """--validate: C's prices against the published rows; prints them, writes
    validation.json."""
    try:
        V = validate(args.validate, args.calibration)
    except OSError as e:
        raise UsageError(f"cannot read {e.filename}: {e.strerror}")
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"{args.validate}: not a file of published rows ({one_line(e)}); its "
                         "columns: " + ", ".join(Published._fields[:-1]))
    if not V["rows"]:
        raise UsageError(f"{args.validate}: no row C can express")
    return print_and_save(args, validation_tables(TEXT[args.lang], V), {"validation": V})


CALIBRATION_COLUMNS = [("run_col", "run", "text"), ("metric_col", "metric", "text"),
                       ("cal_measured_col", "measured_ms", ",.1f"),
                       ("cal_start_col", "start_error", "spct"),
                       ("cal_fitted_col", "calibrated_ms", ",.1f"),
                       ("cal_error_col", "error", "spct"), ("cal_loo_col", "loo_error", "spct")]
CALIBRATION_FLAGS = {"model": ("--model",), "gpu": ("--gpu",),
                     "tp": ("--tp", "--tensor-parallel-size"), "ep": ("--ep",),
                     "replicas": ("--replicas",), "slots": ("--slots", "--max-num-seqs"),
                     "chunk_tokens": ("--chunk-tokens", "--max-num-batched-tokens"),
                     "kv_tokens": ("--kv-tokens",)}


def given_settings(args, argv):
    """The settings the command line gives a run that does not state them (flags left at
    their defaults give nothing)."""
    said = {a.split("=")[0] for a in argv}
    return {field: getattr(args, field) for field, flags in CALIBRATION_FLAGS.items()
            if said & set(flags)}


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
            "runs": [{"path": r.path, "kind": r.kind, "model": r.model, "gpu": r.gpu,
                      "tp": r.tp, "ep": r.ep, "replicas": r.replicas, "slots": r.slots,
                      "chunk_tokens": r.chunk_tokens, "kv_tokens": r.kv_tokens,
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
                      T["calibration_wrote"].format(path=path)])


def run_calibration(args, argv):
    """--calibrate RUN...: fit the engine profile on the runs, print the fit, write the
    profile (engine_profile.json, for --engine-profile) and calibration.json into --out."""
    given = given_settings(args, argv)
    runs = [read_measured_run(path, given) for path in args.calibrate]
    cards = sorted({r.gpu for r in runs})
    if len(cards) > 1:
        raise UsageError(f"a profile is one engine's on one card: the runs are on "
                         f"{', '.join(cards)}; calibrate each apart")
    start = engine_profile(args.engine_profile or "vllm")
    C = calibration_result(runs, start)
    prepare_out_dir(args.out)
    path = os.path.join(args.out, "engine_profile.json")
    write_atomic(path, to_json({"profile": C["profile"], "card": cards[0],
                                "rms_log_error": C["rms_log_error"], "runs": C["runs"]}))
    write_atomic(os.path.join(args.out, "calibration.json"), to_json({"calibration": C}))
    print(fit_lines(calibration_text(TEXT[args.lang], C, path)))
    return {"calibration": C, "profile_path": path}


def print_and_save(args, table, results):
    """A mode that exits after its table (--validate, --replay-distserve, ...): the table
    printed, its results written into --out under the mode's own name (its one results key:
    validation.json, distserve_replay.json, placement_search.json), so that no mode overwrites
    a main run's results.json in the same folder. -> results"""
    print(table)
    prepare_out_dir(args.out)
    mode = next(key for key in ("validation", "distserve_replay", "placement_search")
                if key in results)
    path = os.path.join(args.out, f"{mode}.json")
    write_atomic(path, to_json(results))
    print(TEXT[args.lang]["wrote_json"].format(json=path))
    return results


def link_flags(args):
    """The KV hand-off's link flags given (each read by --replay-distserve alone)."""
    return [flag for flag, given in (
        ("--kv-link-gbs", args.kv_link_gbs is not None),
        ("--kv-link-latency-us", args.kv_link_latency_us is not None),
        ("--kv-layerwise", args.kv_layerwise)) if given]


def run_distserve_replay(args):
    """--replay-distserve: DistServe's logs replayed; prints the table, writes
    distserve_replay.json."""
    if args.cluster:
        dask_distributed()
    link = None
    if link_flags(args):
        link = kv_link(MODELS["opt-13b"], GPUS["a100-80gb"], args.kv_link_gbs,
                       args.kv_link_latency_us, layerwise=args.kv_layerwise)
    R = replay_distserve_runs(args.replay_distserve, link, args.pp_micro_batches, args.jobs,
                              args.cluster)
    return print_and_save(args, distserve_table(TEXT[args.lang], R), {"distserve_replay": R})


def run_placement_search(args):
    """--placement-search: the placements ranked; prints them, writes placement_search.json."""
    if args.cluster:
        dask_distributed()  # (refused before anything runs when Dask is not installed)
    if link_flags(args):
        raise UsageError("--placement-search prices each placement on the card's own link: "
                         f"{', '.join(link_flags(args))} apply to --replay-distserve")
    paths, profiles = distserve_runs(args.placement_search)
    lengths = [read_engine_run(p) for p in paths]
    lengths = (np.concatenate([r["prompt"] for r in lengths]),
               np.concatenate([r["output"] for r in lengths]))
    R = search_placements(profiles, lengths, args.gpu_budget, seed=args.seed,
                          workers=args.jobs, cluster=args.cluster)
    results = {"environment": {"date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "python": platform.python_version(), "numpy": np.__version__},
        "config": {"model": {"name": "opt-13b"}, "gpu_budget": args.gpu_budget,
                   "seed": args.seed}, "placement_search": R}
    print_and_save(args, placement_table(TEXT[args.lang], R), results)
    if args.figures:  # (--replot on its results.json draws them again)
        written, _ = draw_figures(results, args.out, args.dpi, args.format, 1)
        print(fit_lines(TEXT[args.lang]["wrote_json"].format(
            json=", ".join(os.path.join(args.out, name) for name in written))))
    return results


def refuse_pool_flags(args):
    """The flags of the disaggregated modes, refused in the main run (which reads none)."""
    if args.cluster:
        raise UsageError("--cluster runs --placement-search and --replay-distserve on Dask; "
                         "C's other simulations run on --jobs worker processes")
    given = link_flags(args) + ["--pp-micro-batches"] * (args.pp_micro_batches is not None)
    if given:
        raise UsageError(f"{', '.join(given)}: the KV hand-off's and PP's flags apply to "
                         "--replay-distserve (C's main run is one pool of colocated replicas)")


def _main(argv):
    args = build_parser().parse_args(argv)
    if args.replot:
        return replot(args)
    if args.catalog:
        results = {"catalog": catalog()}
        print(fit_lines(catalog_table(TEXT[args.lang], results["catalog"])))
        return results
    if args.validate:
        return run_validation(args)
    if args.calibrate:
        return run_calibration(args, argv)
    if args.replay_distserve:
        return run_distserve_replay(args)
    if args.placement_search:
        return run_placement_search(args)
    refuse_pool_flags(args)
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
    device = run.hardware.device and torch.device(run.hardware.device)
    if device and device.type == "cuda":
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
        kv = kv_setup(run, requests, None if device is None else device_memory(device))
    lengths, arrival = engine_requests(run) if "D" in run.measurement.experiments else (None, None)
    if lengths is not None:  # D's cache must hold the longest request
        check_engine(run, lengths)
    if device:  # the model (and D's cache) must fit, before anything is allocated
        check_memory(run, device, lengths)
    prepare_out_dir(run.output.out)
    return run, device, Inputs(requests, kv, lengths, arrival), probes


def run_experiments(run, device, results, inputs):
    """Every experiment in turn into results. A late failure keeps what finished and names
    itself in results["failed"]. -> whether Ctrl-C stopped them."""
    stage, benches = None, []
    try:
        with interrupt_on_sigterm(), torch.inference_mode(), sdpa_policy():
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
                                        step_costs(run.hardware, results), inputs.kv_budgets)
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
        after = results.get("D", {}).get("machine", {}).get("after")
        env["ceilings_end"] = after or measure_ceilings(run, device, log)


if __name__ == "__main__":
    main()
