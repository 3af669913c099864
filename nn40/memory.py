"""A card's memory as C plans it: the model must split over the cards and fit (check_card_fits,
or the split that would: fitting_split), and the bytes C's KV cache gets, with where the
figure comes from (kv_budget_bytes: a flag, the engine's rule on --gpu, the device this run
measured on, or the reference card; memory_source: the rule's terms in GiB)
"""
from typing import NamedTuple

from nn40.accounting import (
    card_kv_bytes_per_token, card_weight_bytes, kv_bytes_per_token, weight_bytes)
from nn40.config import CPU_KV_MEMORY_GB, GPUS, KV_MEMORY_FRACTION, REFERENCE_MEMORY_GB
from nn40.errors import UsageError
from nn40.pricing import ENGINE_RULES, NO_DRAFT, card_kv_terms
from nn40.profiles import run_profile
from nn40.stages import stage_model


def check_card_fits(run):
    """The model must split over --tp cards, and one card's shard of the weights fit on it,
    before C plans for it."""
    hw, model = run.hardware, run.hardware.model
    card, weights = GPUS[hw.gpu], card_weight_bytes(stage_model(model, hw.pp), hw.tp, hw.ep)
    if hw.ep > 1 and (not model.experts or model.experts % hw.ep):
        raise UsageError(f"--ep {hw.ep} spreads a mixture's experts: the model's "
                         f"{model.experts} experts must divide over the cards")
    if model.heads % hw.tp:
        raise UsageError(f"--tp {hw.tp} must divide the model's {model.heads} heads (each "
                         "card holds whole heads)")
    if model.n_kv_heads % hw.tp and hw.tp % model.n_kv_heads:
        raise UsageError(f"--tp {hw.tp} must divide the model's {model.n_kv_heads} K/V heads "
                         "or be a multiple of them (each card holds whole K/V heads, or copies "
                         "of one)")
    if hw.pp > model.layers:
        raise UsageError(f"--pp {hw.pp}: a stage holds whole layers, and the model has "
                         f"{model.layers}")
    if weights > card.memory_bytes:
        raise UsageError(f"{model.name} in {model.weight_format} needs "
                         f"{weights / 1e9:,.1f} GB of weights on each of "
                         f"{hw.tp * hw.ep * hw.pp} x "
                         f"{card.name} ({card.memory_bytes / 1e9:,.1f} GB): "
                         + fitting_split(model, card, hw.ep))


def fitting_split(cfg, card, ep):
    """What to give when the weights do not fit: the fewest cards (--tp, or --ep with --ep)
    that the check above then accepts, or smaller weights when no count up to 64 does."""
    flag, parts = ("--ep", cfg.experts) if ep > 1 else ("--tp", cfg.heads)
    kv = cfg.n_kv_heads
    for n in range(2, 65):
        split = (1, n) if ep > 1 else (n, 1)
        whole = ep > 1 or not (kv % n and n % kv)  # (TP: the K/V heads split or copied whole)
        if parts % n == 0 and whole and card_weight_bytes(cfg, *split) <= card.memory_bytes:
            return f"give {flag} {n} (it divides the {parts} {'experts' if ep > 1 else 'heads'}" \
                   "), or smaller --weights"
    return f"no {flag} up to 64 fits it: give smaller --weights"


class DeviceMemory(NamedTuple):
    """What C's KV budget reads of the device this run measured on (device_memory makes it):
    "cuda" with its total bytes and name, or "cpu"."""
    kind: str
    total_bytes: int = 0
    name: str = ""


def kv_budget_bytes(run, device, draft=NO_DRAFT):
    """(bytes for C's KV cache, where the figure comes from); see KV_MEMORY_FRACTION. device:
    a DeviceMemory, or None where no device was resolved (C alone). A speculative `draft`
    (DraftMemory) takes its share: its weights from the card's memory, its KV a token from the
    cache's (bytes of the model's own KV are returned)."""
    cfg = run.hardware.model
    weights = weight_bytes(cfg)
    tokens = run.scheduler.kv_tokens or run.scheduler.serve_kv_tokens  # (a flag's, a log's)
    if tokens:
        return tokens * kv_bytes_per_token(cfg), {
            "kind": "memory_tokens" if run.scheduler.kv_tokens else "memory_logged",
            "tokens": tokens}
    if run.scheduler.kv_memory_gb:
        return run.scheduler.kv_memory_gb * 1e9 / draft_scale(run, draft), {"kind": "memory_flag"}
    if run.hardware.gpu:  # (the card C plans for, whatever this machine has; tp of them)
        card, profile = GPUS[run.hardware.gpu], run_profile(run)
        terms = card_kv_terms(stage_model(cfg, run.hardware.pp), card, profile, run.hardware.tp,
                              run.hardware.ep,
                              (run.scheduler.serve_slots, run.scheduler.serve_chunk_tokens),
                              draft)
        return terms["tokens"] * kv_bytes_per_token(cfg), memory_source(terms, card, run)
    if device is not None and device.kind == "cuda":
        total = device.total_bytes
        return (KV_MEMORY_FRACTION * total - weights,
                {"kind": "memory_cuda", "fraction": KV_MEMORY_FRACTION,
                 "total_gib": total / 2**30, "device": device.name,
                 "weights_gib": weights / 2**30})
    if device is not None:
        return CPU_KV_MEMORY_GB * 1e9, {"kind": "memory_cpu"}
    return (KV_MEMORY_FRACTION * REFERENCE_MEMORY_GB * 1e9 - weights,
            {"kind": "memory_reference", "fraction": KV_MEMORY_FRACTION,
             "total_gb": REFERENCE_MEMORY_GB, "weights_gib": weights / 2**30})


def draft_scale(run, draft, gpu=None, tp=None):
    """The bytes a cached token weighs over the model's own beside `draft` (a DraftMemory) on
    the run's card, or a pool's `gpu` at `tp`: 1 + the draft's K and V a token the engine's
    rule keeps in the same cache (EngineRules.draft_terms: vLLM's, none apart from SGLang's)
    over the model's own on one card."""
    if not draft.kv_bytes_per_token:
        return 1.0
    hw, profile = run.hardware, run_profile(run)
    tp = tp or hw.tp
    charged = ENGINE_RULES[profile.rules].draft_terms(profile, GPUS[gpu or hw.gpu], tp, draft)[2]
    return 1 + charged / card_kv_bytes_per_token(hw.model, tp)


def memory_source(terms, card, run):
    """The KV line's account of a card's memory (see card_kv_terms): each term of the engine's
    rule in GiB, the card's memory as the driver reports it and as its spec sheet sells it."""
    gib = {f"{k}_gib": v / 2**30 for k, v in terms.items()
           if k in ("total", "weights", "reserved", "activation", "non_torch", "context", "kv")}
    kind = "memory_card" if terms["rules"] == "fraction" else f"memory_{terms['rules']}"
    return {"kind": kind, "fraction": terms["fraction"], "card": card.name,
            "total_gb": card.memory_bytes / 1e9, "sold_gb": card.memory_gb,
            "tp": run.hardware.tp, "ep": run.hardware.ep, "reserved_gb": terms.get(
                "reserved", 0.0) / 1e9, "seqs": terms["limits"][0], "tokens": terms["limits"][1],
            "short_gib": max(-terms["kv"], 0.0) / 2**30, **gib}
