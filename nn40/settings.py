"""The run's settings: RunConfig, one frozen group of settings per group of flags (workload,
hardware, scheduler, placement, SLO, measurement, engine, output), and the value types that refuse a bad
value in one line (argparse types, also used to read a profile's or a run's values)
"""
import argparse
import dataclasses
import math
from dataclasses import dataclass

from nn40.config import EXPERIMENTS, LENGTH_SEED, ModelConfig, RATES
from nn40.errors import UsageError
from nn40.kv import KV_MANAGERS
from nn40.traces import COUNT_MAX


def integer(low=1, high=COUNT_MAX):
    """An argparse type: an integer in [low, high]."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            kind = "a positive integer" if low == 1 else f"an integer from {low:,}"
            raise argparse.ArgumentTypeError(f"expected {kind} up to {high:,}, got {text!r}")
        return value
    parse.bounds = (low, high)
    parse.maker = integer
    return parse


def integers(text):
    """An argparse type: comma-separated positive integers (each at most COUNT_MAX)."""
    try:
        return tuple(integer()(v) for v in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers up to "
                                         f"{COUNT_MAX:,}, got {text!r}")


integers.bounds = (1, COUNT_MAX)


def number(low, high):
    """An argparse type: a number in [low, high] (both positive: no zero, no inf, no nan)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a number from {low:g} to {high:g}, got "
                                             f"{text!r}")
        return value
    parse.bounds = (low, high)
    parse.maker = number
    return parse


def numbers(low, high):
    """An argparse type: comma-separated numbers in [low, high]."""
    def parse(text):
        try:
            return tuple(number(low, high)(v) for v in text.split(","))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers from {low:g} to "
                                             f"{high:g}, got {text!r}")
    parse.bounds = (low, high)
    parse.maker = numbers
    return parse


def milliseconds(low, high):
    """An argparse type: a number of milliseconds in [low, high], as seconds."""
    in_ms = number(low, high)

    def parse(text):
        return in_ms(text) / 1e3
    parse.bounds = in_ms.bounds
    parse.maker = milliseconds
    return parse


def fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


fraction.bounds = (0.0, 0.99)  # (the ends the flag test tries: the range is [0, 1))


def rate_value(text):
    return "trace" if text == "trace" else number(*RATES)(text)


def usage_type(resolve):
    """An argparse type from a function that names a thing or raises UsageError (a card, a
    model or an engine profile as people write them: see named, profile_named)."""
    def parse(text):
        try:
            return resolve(text)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e))
    parse.resolves = True
    return parse


def experiment_letters(text):
    letters = "".join(text.replace(",", "").upper().split())
    unknown = sorted(set(letters) - set(EXPERIMENTS))
    if not letters or unknown:
        raise argparse.ArgumentTypeError(f"unknown experiment {''.join(unknown) or text!r}; "
                                         f"choose from {EXPERIMENTS}")
    return "".join(e for e in EXPERIMENTS if e in letters)


def attainment(text):
    """An argparse type: the share of requests that must meet the SLOs, as a share (0.99), a
    percentile (p99) or a per cent (99%)."""
    spelled = text.strip().lower()
    scale = 100 if spelled.startswith("p") or spelled.endswith("%") else 1
    try:
        value = float(spelled.strip("p%")) / scale
    except ValueError:
        value = math.nan
    if not 0.01 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share from 0.01 to 1, a percentile (p99) "
                                         f"or a per cent (99%), got {text!r}")
    return value


attainment.bounds = (0.01, 1.0)


@dataclass(frozen=True)
class WorkloadConfig:
    """The requests C (and D) serve: how many, their lengths, arrivals and shared prefixes."""
    requests: int = 600
    seed: int = LENGTH_SEED
    lengths_file: str = None
    prompt_len: int = 128         # prompt tokens of each generated request
    trace: str = None             # a request trace CSV (replaces the generated lengths)
    trace_limit: int = None
    rate: object = None           # requests/s (float), "trace" (its timestamps), None (all at 0)
    burstiness: float = 1.0       # shape of the gamma gaps: 1 = Poisson, below 1 burstier
    rates: tuple = None           # the rate sweep (default: fractions of capacity)
    prefix_len: int = 0           # generated requests: system prompts' tokens (0: none)
    num_prefixes: int = 1         # how many system prompts
    prefix_share: float = 1.0     # share of conversations a system prompt opens
    prefix_zipf: float = 1.0      # their popularity: the i-th as 1 / i^zipf
    turns: int = 1                # turns per conversation
    think_time_s: float = 0.0     # mean gap between a conversation's turns


@dataclass(frozen=True)
class HardwareConfig:
    """The model and what it runs on (A, B, D's device; C's card and prices)."""
    model: ModelConfig
    device: str = None            # "cuda" or "cpu"; None when only C runs
    peak_bandwidth_gbs: float = None  # replace the measured ceilings
    peak_tflops: float = None
    cost: str = None              # "measured", "analytic"; default measured when A ran
    gpu: str = None               # a named card (GPUS) C prices and budgets for
    tp: int = 1                   # C: cards per replica, tensor parallel
    ep: int = 1                   # C: each replica one card of an expert-parallel group
    pp: int = 1                   # C: pipeline stages a replica's layers are split over
    weight_first_rows: int = 0    # CPU matmuls of up to this many rows as W x^T (see linear)
    engine_profile: str = "tensorrt-llm"  # how C prices the card (ENGINE_PROFILES)
    preset: tuple = ()            # the model fields the CPU preset set ("layers=4", ...)
    dtype_given: bool = False     # --dtype was given (else on CPU a probe chooses)


@dataclass(frozen=True)
class SchedulerConfig:
    """C's replicas: seats, the step budget, the queue's order, the router, the KV cache."""
    slots: int = 32               # the post's table's seats (--slots, else the post's 32)
    chunk_tokens: int = 512       # chunked prefill: tokens per step, decodes included
    serve_slots: int = None       # capacity, fleets, the rate sweep and a trace's replay: the
    serve_chunk_tokens: int = None  # engine's max_num_seqs and max_num_batched_tokens (see
    serve_source: str = "post"    # serving_limits: "flag", "logged", the engine's defaults, or
    # "post", with "+logged" or "+flag" where those gave one of the two)
    serve_kv_tokens: int = None   # a logged run's KV cache in tokens (its meta.json's): C's
    # where no flag sizes it (D's pool is --kv-tokens alone)
    serve_max_model_len: int = None  # a logged run's max_model_len (else the model's context)
    kv_fraction: float = None     # the engine's memory fraction, as its flag names it
    order: str = "fcfs"           # the waiting queue's order (see Order)
    predict_sigma: float = 0.8    # "predicted": log-normal error of the predicted lengths
    max_wait_s: float = None      # the starvation guard (None: off)
    replicas: int = 1             # C: identical replicas behind a router
    router: str = "all"           # the routers C's fleet and capacity studies compare
    kv_policy: str = "both"       # C's KV-cache study: a name in KV_MANAGERS, or "both"
    enable_prefix_caching: bool = False  # paged blocks keep computed prefixes (policy "prefix")
    host_kv_gb: float = None      # prefix: a second tier of blocks in host memory
    host_write_policy: str = None  # its write policy (nn40.tiers.HOST_TIERS; None: KVBudget's)
    disk_kv_gb: float = None      # prefix: a third tier below the host's, on disk or remote
    disk_kv_gbs: float = None     # its read bandwidth, GB/s (None: config.DISK_READ_GBS)
    disk_prefetch: bool = False   # its reads start as a request arrives (SGLang's L3 prefetch)
    eviction_policy: str = "lru"  # prefix: the order cached blocks go (EVICTION_ORDERS)
    prefix_study: bool = False    # the prefix cache's hits against its capacity (a figure)
    kv_memory_gb: float = None    # memory for the KV cache (default: see kv_budget_bytes)
    kv_tokens: int = None         # the KV cache in tokens (replaces kv_memory_gb)
    block_tokens: int = 16        # paged: tokens per block
    max_output: int = None        # reserve: output tokens reserved per request
    watermark: float = 0.01       # paged: share of the blocks admission keeps free (vLLM's)
    speculative_method: str = None  # speculative decoding (nn40.speculative.METHODS; None: off)
    num_speculative_tokens: int = None  # k: drafts a verify step checks
    speculative_model: str = None  # draft_model: the draft's preset (MODELS)
    acceptance_rates: tuple = None  # per-position acceptance rates (k of them), resolved
    acceptance_law: str = None    # where they come from: "rates", "rate", "length" or a method's

    @property
    def kv_policies(self):
        policies = tuple(p for p, m in KV_MANAGERS.items() if m.in_both) \
            if self.kv_policy == "both" else (self.kv_policy,)
        return tuple(KV_MANAGERS[p].caching or p if self.enable_prefix_caching else p
                     for p in policies)


@dataclass(frozen=True)
class PlacementConfig:
    """C's pools: with prefill_replicas and decode_replicas, a prefill pool hands each
    request's KV over a link to a decode pool (disaggregated serving), run beside colocated
    replicas on as many cards; each role's TP, PP and card default to --tp, --pp and --gpu."""
    prefill_replicas: int = None
    decode_replicas: int = None
    prefill_tp: int = None
    decode_tp: int = None
    prefill_pp: int = None
    decode_pp: int = None
    prefill_gpu: str = None
    decode_gpu: str = None
    kv_link: str = None           # a named link (handoff.LINKS); None: the card's own within a
    kv_link_gbs: float = None     # node, the network past it; GB/s and a send's latency, us,
    kv_link_latency_us: float = None  # in place of the named link's
    kv_layerwise: bool = False    # the KV sent layer by layer during the prefill
    gpu_budget: int = None        # the cheapest placements' cards at most (None: no bound)
    search_placements: bool = False  # --placement-search alone: the cheapest placements

    @property
    def disaggregated(self):
        return self.prefill_replicas is not None


@dataclass(frozen=True)
class SLOConfig:
    """The latency bounds C's goodput and capacity search hold requests to."""
    slo_ttft_s: float = None
    slo_tpot_s: float = None
    slo_attainment: float = 0.9   # the share of requests that must meet the SLO
    target_rate: float = None     # requests/s C finds the fewest replicas for


@dataclass(frozen=True)
class MeasurementConfig:
    """What runs and how it is timed: the experiments, A's and B's shapes, repetitions."""
    experiments: str = EXPERIMENTS
    quick: bool = False
    batch_sizes: tuple = (1, 8, 32, 128, 256)
    context: int = 128            # tokens already in each row's KV cache when a decode step runs
    contexts: tuple = (128,)      # A sweeps every batch size at each of these contexts
    graphs: str = "eager"         # "eager", "graph" or "both": CUDA graphs for decode (CUDA only)
    prefill_lengths: tuple = (512, 2048)
    decode_batches: tuple = (1, 32)
    jobs: int = 1                 # worker processes for C's independent simulations
    cluster: str = None           # a Dask scheduler for the placements' searches ("local")
    warmup: int = 3               # untimed calls at each shape
    reps: int = 50                # timed calls at each shape (fewer if a call is slow)
    time_budget_s: float = 2.0    # per shape: stop repeating after this, but keep >= 5 calls


@dataclass(frozen=True)
class EngineConfig:
    """D's engine: its requests, slots, prompt tokens, output divisor and attention. The
    defaults: the run's own; run_config resolves them by device (engine_fields)."""
    engine_requests: int = WorkloadConfig.requests
    engine_slots: int = SchedulerConfig.slots
    engine_prompt_len: int = WorkloadConfig.prompt_len  # (with --prefix-len: the prefix first)
    engine_shrink: int = 1
    engine_attention: str = "auto"  # D's decode attention: "spans", "padded", or by device


@dataclass(frozen=True)
class OutputConfig:
    """Where the results, tables and figures go, and in which language."""
    out: str = "figures"
    figures: bool = True
    dpi: int = 100
    format: str = "png"
    lang: str = "en"
    save_requests: str = None


@dataclass(frozen=True)
class RunConfig:
    """A run's settings, a frozen group for each group of flags (run.workload.requests,
    run.scheduler.slots, ...). RunConfig.of and replace take fields by their own names."""
    workload: WorkloadConfig
    hardware: HardwareConfig
    scheduler: SchedulerConfig
    placement: PlacementConfig
    slo: SLOConfig
    measurement: MeasurementConfig
    engine: EngineConfig
    output: OutputConfig

    @classmethod
    def of(cls, **fields):
        """A run from fields by name, each group's defaults for the rest."""
        known_fields(fields)
        return cls(**{name: group(**{f: v for f, v in fields.items() if RUN_GROUP[f] == name})
                      for name, group in RUN_GROUPS.items()})

    def replace(self, **fields):
        """This run with fields changed by name (each in its group)."""
        known_fields(fields)
        return dataclasses.replace(self, **{name: dataclasses.replace(
            getattr(self, name), **{f: v for f, v in fields.items() if RUN_GROUP[f] == name})
            for name in {RUN_GROUP[f] for f in fields}})

    def flat(self):
        """Every field by name, the groups in order (results.json's "config")."""
        return {k: v for name in RUN_GROUPS
                for k, v in dataclasses.asdict(getattr(self, name)).items()}


def known_fields(fields):
    """RunConfig.of's and replace's names, each a field of a group, or a TypeError naming them."""
    unknown = set(fields) - set(RUN_FIELDS)
    if unknown:
        raise TypeError(f"RunConfig has no field {', '.join(sorted(unknown))}")


RUN_GROUPS = {f.name: f.type for f in dataclasses.fields(RunConfig)}
RUN_FIELDS = {f.name: f for group in RUN_GROUPS.values() for f in dataclasses.fields(group)}
RUN_GROUP = {f: name for name, group in RUN_GROUPS.items()
             for f in (g.name for g in dataclasses.fields(group))}


@dataclass(frozen=True)
class ModeConfig:
    """A mode that runs instead of the experiments and exits (the first given, in the order of
    the registry, modes.MODES): what it reads of the command line.

    name          the mode (its flag's name: "validate" is --validate)
    given         the mode's own argument: a file, files or a folder (True: --catalog)
    settings      --calibrate: the run settings the command line states ({field: value})
    link_flags    the KV link's flags given; link_name, link_gbs, link_latency_us,
                  layerwise: their values
    pp_micro_batches, gpu_budget, cluster, calibration, engine_profile, kv_fraction, seed:
                  their flags'
    out, lang, jobs, figures, dpi, format: as the main run's
    """
    name: str
    given: object
    out: str = "figures"
    lang: str = "en"
    jobs: int = 1
    figures: bool = True
    dpi: int = 100
    format: str = "png"
    seed: int = LENGTH_SEED
    calibration: str = None
    engine_profile: str = None
    kv_fraction: float = None
    settings: dict = dataclasses.field(default_factory=dict)
    link_flags: tuple = ()
    link_name: str = None
    link_gbs: float = None
    link_latency_us: float = None
    layerwise: bool = False
    pp_micro_batches: int = None
    gpu_budget: int = 4
    cluster: str = None
