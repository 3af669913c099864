"""The command line: argv to a RunConfig (run_config) or to a mode's ModeConfig (mode_config),
each flag declared once in its group, its destination a field and its default the field's
(build_parser), with the parser's form: one-line errors, the help's layout, vLLM's --goodput
"""
import argparse
import dataclasses
import functools
import os

from nn40.config import (
    CALIBRATION_CSV, CPU_KV_MEMORY_GB, CPU_PRESET, DISK_READ_GBS, DTYPE_NAMES, ENGINE_CPU,
    ENGINE_QUICK,
    EXPERIMENTS, GPUS, KV_DTYPES, KV_MEMORY_FRACTION, LENGTH_MAX, MODELS, ModelConfig,
    PUBLISHED_CSV, RATES, REPLICAS_MAX, WEIGHT_FORMATS, read_model_config)
from nn40.errors import UsageError
from nn40.figures import FORMATS
from nn40.handoff import LINKS
from nn40.kv import KV_MANAGERS, KVBudget
from nn40.memory import check_card_fits
from nn40.modes import MODES
from nn40.names import named
from nn40.placement import check_placement
from nn40.pricing import DEFAULT_PROFILE, ENGINE_RULES
from nn40.profiles import profile_named, run_profile
from nn40.queues import EVICTION_ORDERS, ORDERS
from nn40.routers import ROUTERS
from nn40.settings import (
    RUN_FIELDS, ModeConfig, RunConfig, SchedulerConfig, attainment, experiment_letters, fraction,
    integer, integers, milliseconds, number, numbers, rate_value, usage_type)
from nn40.speculative import MAX_SPECULATIVE_TOKENS, PP_METHODS, parse_config, resolve
from nn40.speculative_study import run_speculation
from nn40.stages import stage_model
from nn40.text import DESCRIPTION, EPILOG, USAGE
from nn40.text_ko import TEXT
from nn40.tiers import HOST_TIERS
from nn40.workload import is_engine_run, read_run_meta


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
    for flags in (workload_flags, prefix_flags, model_flags, scheduler_flags, speculation_flags,
                  placement_flags, slo_flags, measurement_flags, d_flags, output_flags):
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
    add_flag(w, "--host-write-policy", choices=tuple(HOST_TIERS), shown=KVBudget.host_write,
             metavar="WRITE", help="host tier: write-through (vLLM, LMCache) or write-back "
             "(SGLang)")
    add_flag(w, "--disk-kv-gb", type=number(1e-3, 1e9), shown="none",
             help="prefix cache: a disk tier below the host's, GB")
    add_flag(w, "--disk-kv-gbs", type=number(1e-3, 1e4), shown=f"{DISK_READ_GBS:g}, an NVMe "
             "drive's", help="disk tier: its read bandwidth, GB/s")
    add_flag(w, "--disk-prefetch", action="store_true",
             help="disk tier: reads start as requests arrive (SGLang's L3 prefetch)")
    add_flag(w, "--eviction-policy", choices=tuple(EVICTION_ORDERS), metavar="ORDER",
             help="prefix cache: lru, fifo or lfu (SGLang's) first out")
    add_flag(w, "--prefix-len", type=integer(0, 10**6), help="system prompts' tokens (generated)")
    add_flag(w, "--num-prefixes", type=integer(1, 10**5), help="how many system prompts")
    add_flag(w, "--prefix-share", type=number(1e-3, 1.0),
             help="share of conversations one opens")
    add_flag(w, "--prefix-zipf", type=number(0.0, 10.0),
             help="popularity: the i-th drawn as 1/i^zipf")
    add_flag(w, "--turns", "--num-turns", type=integer(1, 1000),
             help="turns a conversation (each repeats the last, its answer)")
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
             help="A, B: a transformer, or the post's bare matmuls")
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
    add_flag(m, "--dtype", choices=list(DTYPE_NAMES), shown=f"{ModelConfig.dtype}; CPU: a probe's",
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
    add_flag(m, "--pp", "--pipeline-parallel-size", type=integer(1, 64),
             help="--gpu pipeline stages a replica spans")
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
    add_flag(s, "--kv-tokens", type=integer(), shown="from GB",
             help="KV cache, tokens (D: its block pool)")
    add_flag(s, "--kv-fraction", "--gpu-memory-utilization", "--mem-fraction-static",
             type=number(0.01, 1.0), shown="the engine's", help="memory share (vLLM: of the card; "
             "SGLang: for weights + KV; else: of what is free)")
    add_flag(s, "--block-tokens", "--block-size", type=integer(), help="paged: tokens a block")
    add_flag(s, "--watermark", type=fraction, help="paged: share of blocks kept free")
    add_flag(s, "--max-output", type=integer(), shown=f"longest; law: {LENGTH_MAX}",
             help="reserve: output tokens held")


def speculation_flags(p):
    s = p.add_argument_group("speculative decoding (C on --gpu; D with method ngram)")
    add_flag(s, "--speculative-config", metavar="JSON", type=usage_type(parse_config),
             default=None, shown="off", help="vLLM's: method (ngram, eagle, eagle3, mtp, "
             "draft_model), num_speculative_tokens, model")
    add_flag(s, "--num-speculative-tokens", type=integer(1, MAX_SPECULATIVE_TOKENS),
             shown="the config's, else 1", help="k: drafts a step")
    add_flag(s, "--acceptance-rate", type=number(0.0, 1.0), default=None,
             shown="the method's", help="one rate: position i accepted a^i of steps")
    add_flag(s, "--acceptance-rates", dest="acceptance_rates_given", type=numbers(0.0, 1.0),
             default=None, shown="the method's",
             help="per position, as vLLM counts them")
    add_flag(s, "--acceptance-length", type=number(1.0, MAX_SPECULATIVE_TOKENS + 1),
             default=None, shown="the method's", help="mean tokens a verify step emits")


def placement_flags(p):
    s = p.add_argument_group("placement: prefill and decode pools and the KV link between them (C)")
    card = usage_type(functools.partial(named, kind="card"))
    for role in ("prefill", "decode"):
        add_flag(s, f"--{role}-replicas", type=integer(1, REPLICAS_MAX), shown="none",
                 help=f"{role} replicas")
        add_flag(s, f"--{role}-tp", type=integer(1, 64), shown="--tp", help=f"a {role} "
                 "replica's TP")
        add_flag(s, f"--{role}-pp", type=integer(1, 64), shown="--pp", help=f"a {role} "
                 "replica's PP")
        add_flag(s, f"--{role}-gpu", metavar="CARD", type=card, shown="--gpu",
                 help=f"a {role} replica's card")
    add_flag(s, "--kv-link", choices=list(LINKS), shown="the card's in a node, else network",
             help="the KV hand-off's link")
    add_flag(s, "--kv-link-gbs", type=number(1e-6, 1e6), default=None,
             shown="the link's", help="the KV hand-off's GB/s")
    add_flag(s, "--kv-link-latency-us", type=number(0, 1e9), default=None,
             shown="the link's", help="a KV hand-off's latency")
    add_flag(s, "--kv-layerwise", action="store_true",
             help="the hand-off sends each layer's KV as the prefill makes it")
    add_flag(s, "--gpu-budget", type=integer(1, 4096), shown="none; --placement-search: 4",
             help="the cheapest placements' cards at most")


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
    add_flag(o, "--pp-micro-batches", type=integer(), default=None, shown="as the engine runs",
             help="decode batches in flight on PP stages")
    add_flag(o, "--placement-search", metavar="DIR", nargs="?", const="", default=None,
             shown="off", help="cheapest placements; DIR: DistServe's, exit")


CALIBRATION_FLAGS = {"model": ("--model",), "gpu": ("--gpu",),
                     "tp": ("--tp", "--tensor-parallel-size"), "ep": ("--ep",),
                     "replicas": ("--replicas",), "slots": ("--slots", "--max-num-seqs"),
                     "chunk_tokens": ("--chunk-tokens", "--max-num-batched-tokens"),
                     "kv_tokens": ("--kv-tokens",)}


def flags_said(argv):
    """The flags the command line spells out ("--tp" of "--tp=2" too): what a user gave, as
    against a default."""
    return {a.split("=")[0] for a in argv if a.startswith("--")}


def given_settings(args, argv):
    """The settings the command line gives a run that does not state them (flags left at
    their defaults give nothing)."""
    said = flags_said(argv)
    return {field: getattr(args, field) for field, flags in CALIBRATION_FLAGS.items()
            if said & set(flags)}


def link_flags(args):
    """The KV hand-off's link flags given (read by C's pools and --replay-distserve)."""
    return tuple(flag for flag, given in (
        ("--kv-link", args.kv_link is not None), ("--kv-link-gbs", args.kv_link_gbs is not None),
        ("--kv-link-latency-us", args.kv_link_latency_us is not None),
        ("--kv-layerwise", args.kv_layerwise)) if given)


def mode_config(args, argv):
    """The ModeConfig of the first mode the flags give (in MODES' order), or None: the run
    (whose flags refuse the modes' own)."""
    name = next((mode for mode in MODES if getattr(args, mode)), None)
    if name is None:
        refuse_pool_flags(args)
        return None
    if name in ("replay_distserve", "placement_search"):
        refuse_unread_flags(name, argv)
    return ModeConfig(
        name, getattr(args, name), out=args.out, lang=args.lang, jobs=args.jobs,
        figures=args.figures, dpi=args.dpi, format=args.format, seed=args.seed,
        calibration=args.calibration, engine_profile=args.engine_profile,
        kv_fraction=args.kv_fraction,
        settings=given_settings(args, argv) if name == "calibrate" else {},
        link_flags=link_flags(args), link_name=args.kv_link, link_gbs=args.kv_link_gbs,
        link_latency_us=args.kv_link_latency_us, layerwise=args.kv_layerwise,
        pp_micro_batches=args.pp_micro_batches, gpu_budget=args.gpu_budget or 4,
        cluster=args.cluster)


# what DistServe's replay and the placement search do not read: they price OPT-13B on
# A100-80GB by DistServe's profiles, at DistServe's SLO
DISTSERVE_FIXED = ("--model", "--model-config", "--gpu", "--tp", "--tensor-parallel-size",
                   "--ep", "--weights", "--engine-profile", "--slo-ttft-ms", "--slo-tpot-ms",
                   "--slo-attainment", "--target-rate", "--goodput", "--pp",
                   "--pipeline-parallel-size") + tuple(
    f"--{role}-{what}" for role in ("prefill", "decode") for what in ("replicas", "tp", "pp",
                                                                        "gpu"))


def refuse_unread_flags(name, argv):
    """A flag the DistServe modes would silently ignore is refused in one line."""
    said = flags_said(argv)
    given = [flag for flag in DISTSERVE_FIXED + ("--gpu-budget",) * (name == "replay_distserve")
             if flag in said]
    if given:
        raise UsageError(f"--{name.replace('_', '-')} prices OPT-13B on A100-80GB by "
                         f"DistServe's profiles at DistServe's SLO: {', '.join(given)} "
                         "would not be read (C's main run prices your model, card and SLO; "
                         "--placement-search without DIR searches its placements)")


POOL_FLAGS = tuple(f"{role}_{what}" for role in ("prefill", "decode")
                   for what in ("tp", "pp", "gpu"))


def searches_placements(args):
    """--placement-search given without DIR: C's cheapest placements of the run's model (its
    flag's const; with DIR, DistServe's mode)."""
    return args.placement_search == ""


def refuse_pool_flags(args):
    """The main run's pool flags that would go unread: a pool's TP, PP or card, or the KV
    link, without both pools or the placement search; --cluster and --gpu-budget without a
    search; --pp-micro-batches (the DistServe modes')."""
    pools, search = (args.prefill_replicas, args.decode_replicas), searches_placements(args)
    searching = (pools[0] or search) and args.target_rate  # (the cheapest placements)
    if args.cluster and not searching:
        raise UsageError("--cluster runs --placement-search, --replay-distserve and the "
                         "cheapest placements (--placement-search or both pools, with "
                         "--target-rate) on Dask; C's other simulations run on --jobs worker "
                         "processes")
    if args.pp_micro_batches is not None:
        raise UsageError("--pp-micro-batches applies to --replay-distserve (C's pipeline "
                         "stages run one micro-batch a stage)")
    if (pools[0] is None) != (pools[1] is None):
        raise UsageError("disaggregated serving needs both pools: give --prefill-replicas and "
                         "--decode-replicas")
    if search:
        refuse_unsearchable(args)
    given = [f"--{f.replace('_', '-')}" for f in POOL_FLAGS if getattr(args, f) is not None
             and not (search and f.endswith("_gpu"))]  # (the search puts a role on its card)
    given += [] if search else list(link_flags(args))
    if args.gpu_budget is not None and not searching:
        raise UsageError("--gpu-budget bounds the cheapest placements of a target rate: give "
                         "--placement-search (or both pools) and --target-rate")
    if given and pools[0] is None:
        raise UsageError(f"{', '.join(given)}: a pool's and the KV link's flags shape "
                         "disaggregated serving: give --prefill-replicas and --decode-replicas")
    if (pools[0] is not None or search) and not args.gpu:
        raise UsageError("--prefill-replicas, --decode-replicas and --placement-search price "
                         "placements on a named card: give --gpu")
    unread = [flag for flag, given in (
        ("--kv-tokens", args.kv_tokens), ("--kv-memory-gb", args.kv_memory_gb),
        ("--peak-bandwidth-gbs", args.peak_bandwidth_gbs), ("--peak-tflops", args.peak_tflops),
        ("--cost", args.cost), (f"--kv-policy {args.kv_policy}", not getattr(
            KV_MANAGERS.get(args.kv_policy), "served", True)),  # (a policy engines do not run)
        ("--max-output", args.max_output)) if given]
    if (pools[0] is not None or search) and unread:
        raise UsageError(f"{', '.join(unread)}: the pools price each role's card by the engine "
                         "profile and size its KV cache by the engine's rule on it; leave them "
                         "out with --prefill-replicas, --decode-replicas and --placement-search")
    if (pools[0] is not None or search) and args.ep > 1:
        raise UsageError("--ep: a disaggregated placement is priced at TP and PP per role "
                         "(expert parallel pools are not modelled yet): give --ep 1")


def refuse_unsearchable(args):
    """--placement-search alone (C's cheapest placements) needs a target rate and an SLO to
    search for; it searches each role's TP and PP itself."""
    if not args.target_rate or not (args.slo_ttft_s or args.slo_tpot_s):
        raise UsageError("--placement-search searches the cheapest placements for a target "
                         "rate at an SLO: give --target-rate and --slo-ttft-ms or --slo-tpot-ms "
                         "(or a DIR of DistServe's runs)")
    given = [flag for flag, value in (("--prefill-tp", args.prefill_tp),
                                      ("--decode-tp", args.decode_tp),
                                      ("--prefill-pp", args.prefill_pp),
                                      ("--decode-pp", args.decode_pp)) if value is not None]
    if given and args.prefill_replicas is None:
        raise UsageError(f"{', '.join(given)}: --placement-search tries each role's TP and PP "
                         "itself (give both pools to run one placement beside the search)")


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
    device = None
    if set("ABD") & set(experiments):  # (torch is loaded for the experiments that run it alone)
        try:
            from nn40.device import resolve_device
        except ImportError as e:
            raise UsageError(f"experiments {''.join(sorted(set('ABD') & set(experiments)))} "
                             f"run the model on torch, which does not import here ({e}): "
                             "install it (requirements.txt), or run --experiments C") from None
        device = resolve_device(args.device)
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
                       "search_placements": searches_placements(args),
                       "device": device and device.type, "graphs": graphs[args.graphs],
                       "contexts": tuple(sorted(set(contexts) | {args.context})),
                       "prompt_len": args.prompt_len or RUN_FIELDS["prompt_len"].default,
                       "preset": preset, "dtype_given": args.dtype is not None,
                       "engine_profile": args.engine_profile or DEFAULT_PROFILE,
                       "slots": args.slots or SchedulerConfig.slots,
                       "chunk_tokens": args.chunk_tokens or SchedulerConfig.chunk_tokens,
                       **engine_fields(args, on_cpu)})
    run = run.replace(**serving_limits(run, args),
                      **speculation_fields(args, run.hardware.model))
    longest = max(max(run.measurement.contexts) + 1, max(run.measurement.prefill_lengths))
    if device is not None and model.arch == "transformer" and longest > model.max_positions:
        raise UsageError(f"a sequence of {longest} tokens exceeds --max-positions "
                         f"{model.max_positions}")
    if run.hardware.gpu:
        try:
            check_card_fits(run)
        except UsageError as e:  # (with pools, --tp and --pp shape the colocated replicas)
            raise UsageError(f"the colocated replicas run beside the pools: {e}" if
                             run.placement.disaggregated else str(e)) from None
    if run.scheduler.speculative_method:  # (a draft that leaves no KV cache: before anything
        run_speculation(run)               # runs)
    if run.placement.disaggregated:  # (before anything runs)
        check_placement(run)
    return quick_run(run) if run.measurement.quick else run


def serving_limits(run, args):
    """The seats and step budget C serves with where it answers for an engine (capacity,
    fleets, the rate sweep, a trace's replay): the flags where given, else a logged engine
    run's own (its meta.json: a replay of it runs as it ran, its KV cache too), else with --gpu
    the engine profile's defaults on that card (see EngineRules.defaults), else the post's.
    The post's own table keeps --slots or the post's 32 seats."""
    slots, chunk, source = run.scheduler.slots, run.scheduler.chunk_tokens, "post"
    if run.hardware.gpu:
        profile = run_profile(run)
        drafting = args.speculative_config and args.speculative_config["method"]
        slots, chunk, source = ENGINE_RULES[profile.rules].defaults(
            profile, stage_model(run.hardware.model, run.hardware.pp), GPUS[run.hardware.gpu],
            run.hardware.tp, run.hardware.ep, drafting)
    logged = logged_limits(run, args)
    if logged.get("slots") and logged.get("chunk_tokens"):
        slots, chunk, source = logged["slots"], logged["chunk_tokens"], "logged"
    elif logged.get("slots") or logged.get("chunk_tokens"):
        slots, chunk = logged.get("slots") or slots, logged.get("chunk_tokens") or chunk
        source += "+logged"
    if args.slots or args.chunk_tokens:
        source = "flag" if args.slots and args.chunk_tokens else source + "+flag"
    return {"serve_slots": args.slots or slots, "serve_chunk_tokens": args.chunk_tokens or chunk,
            "serve_source": source, "serve_kv_tokens": logged.get("kv_tokens"),
            "serve_max_model_len": logged.get("max_model_len")}


def logged_limits(run, args):
    """A replayed vLLM log's own limits (its meta.json: read_run_meta): its seats, step budget
    and context; its KV tokens where no flag sizes the cache and the run is on the log's card
    and TP (another card's cache is another size). {} for any other trace."""
    if not (args.trace and args.trace.endswith(".jsonl") and is_engine_run(args.trace)):
        return {}
    logged = read_run_meta(args.trace)
    sized = args.kv_tokens or args.kv_memory_gb or args.kv_fraction is not None or \
        args.prefill_replicas or searches_placements(args)  # (the pools size their own)
    try:
        same_card = named(logged.get("gpu") or "", "card") == run.hardware.gpu
    except UsageError:  # (a card C does not name: not the run's)
        same_card = False
    if sized or not same_card or logged.get("tp", 1) != run.hardware.tp:
        logged = {**logged, "kv_tokens": None}
    return logged


def speculation_fields(args, cfg):
    """--speculative-config and its acceptance, resolved (nn40.speculative.resolve), or
    nothing; the flags that need it refused without it, where C cannot price it yet, and MTP
    for a model (`cfg`) that ships no MTP module."""
    acceptance = [flag for flag, value in (
        ("--num-speculative-tokens", args.num_speculative_tokens),
        ("--acceptance-rate", args.acceptance_rate),
        ("--acceptance-rates", args.acceptance_rates_given),
        ("--acceptance-length", args.acceptance_length)) if value is not None]
    config = args.speculative_config
    if config is None:
        if acceptance:
            raise UsageError(f"{acceptance[0]} is speculative decoding's: add "
                             "--speculative-config")
        return {}
    chosen = set(chosen_experiments(args))
    for flag, refused in (("--gpu", "C" in chosen and not args.gpu),
                          ("--experiments C, D or CD", chosen - {"C", "D"})):
        if refused:
            raise UsageError("--speculative-config is priced by C on a named card and run by D's "
                             f"engine: give {flag}")
    if "D" in chosen and config["method"] != "ngram":
        raise UsageError(f"--speculative-config: D's engine drafts as an n-gram lookup does, at "
                         f"no cost on the device, and has no {config['method']} draft: give "
                         "method ngram with D")
    if max(args.pp, args.prefill_pp or 1, args.decode_pp or 1) > 1 and \
            config["method"] not in PP_METHODS:
        raise UsageError(f"--speculative-config: vLLM runs {', '.join(PP_METHODS)} alone on "
                         f"pipeline stages, not {config['method']}: run it without --pp")
    if config["method"] == "draft_model":
        config = {**config, "model": named(config["model"], kind="model")}
    if config["method"] == "mtp" and not cfg.mtp_layers:
        raise UsageError(f"--speculative-config: method mtp drafts with the model's own MTP "
                         f"module, and {cfg.name} ships none (num_nextn_predict_layers): use "
                         "eagle3, ngram or a draft_model")
    return resolve(config, args.num_speculative_tokens, args.acceptance_rate,
                   args.acceptance_rates_given, args.acceptance_length)


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
    return "C" if args.target_rate or args.slo_ttft_s or args.slo_tpot_s or \
        args.prefill_replicas else EXPERIMENTS


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
    if (args.prefill_replicas or searches_placements(args)) and args.experiments and \
            "C" not in args.experiments:
        raise UsageError("--prefill-replicas, --decode-replicas and --placement-search are "
                         "simulated by C: add C to --experiments")
    if args.rate == "trace" and not args.trace:
        raise UsageError("--rate trace: the trace has no timestamps (give --trace FILE.csv)")
    for flag, given in (("--tp", args.tp > 1), ("--ep", args.ep > 1), ("--pp", args.pp > 1),
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
    if args.host_write_policy and not args.host_kv_gb:
        raise UsageError("--host-write-policy is the host tier's: add --host-kv-gb")
    if args.disk_kv_gb and not args.host_kv_gb:
        raise UsageError("--disk-kv-gb: the disk tier is below host memory (LMCache's disk "
                         "behind its CPU backend, SGLang's L3 behind L2): add --host-kv-gb")
    for flag, given in (("--disk-kv-gbs", args.disk_kv_gbs), ("--disk-prefetch",
                                                             args.disk_prefetch)):
        if given and not args.disk_kv_gb:
            raise UsageError(f"{flag} is the disk tier's: add --disk-kv-gb")
    cache_router = args.router in ROUTERS and not ROUTERS[args.router].in_all
    for flag, given in (("--host-kv-gb", args.host_kv_gb), (f"--router {args.router}",
                                                          cache_router),
                        (f"--eviction-policy {args.eviction_policy}",
                         args.eviction_policy != "lru")):
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
