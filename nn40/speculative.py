"""Speculative decoding: the tokens a verify step gains, drawn per request, and its price (NumPy)

A speculating decoder proposes k draft tokens (an n-gram lookup in its own text, an EAGLE or
MTP head on the target's hidden states, or a smaller draft model), and one pass of the target
verifies them with the token before: k + 1 query tokens a decoder, the weights read once. The
step emits the accepted drafts and one token of the target's own (the bonus, or the correction
of the first rejected draft): from 1 to k + 1 tokens. The acceptance is a law over positions:
a_i, the share of verify steps whose i-th draft is accepted (vLLM's per-position counts over
its drafts, vllm:spec_decode_num_accepted_tokens_per_pos / num_drafts), so a step emits on
average E = 1 + a_1 + ... + a_k tokens (its "acceptance length").

The loop keeps a decoder as its start and the step it ends (DecodeBatch): a SpeculativeBatch
draws, for each request and from the run's seed, how many verify steps its tokens take (each
step's gain drawn from the law), so percentiles spread as acceptance does; between its start and
its end a decoder's cache grows at its own mean rate.
"""
import dataclasses
import heapq
import json
from dataclasses import dataclass

import numpy as np

from nn40.accounting import card_kv_bytes_per_token, card_weight_bytes, weight_parts
from nn40.config import MODELS
from nn40.errors import UsageError
from nn40.pricing import NO_DRAFT, DraftMemory, steps_to
from nn40.replicas import DecodeBatch, DecodeTokens


METHODS = ("ngram", "eagle", "eagle3", "mtp", "draft_model")  # vLLM's speculative_config methods
MAX_SPECULATIVE_TOKENS = 16

# each method's acceptance where none is given: per-position rates from a cited measurement
# (longer drafts extend it geometrically at its last ratio); a method not here needs one given
DEFAULT_ACCEPTANCE = {
    # vLLM's regression baseline (tests/v1/spec_decode/test_acceptance_length.py):
    # Llama-3.1-8B-Instruct with RedHatAI's EAGLE-3 speculator, MT-Bench, temperature 0, k = 3
    "eagle3": ((0.7296, 0.5208, 0.3545), "vLLM's EAGLE-3 baseline for Llama-3.1-8B on MT-Bench "
                                         "(tests/v1/spec_decode/test_acceptance_length.py)"),
    # DeepSeek-V3's technical report (section 5.4.3): the second token its MTP module predicts is
    # accepted 85-90% of the time; one draft of one module
    "mtp": ((0.85,), "DeepSeek-V3's report: the MTP token accepted 85-90% of the time"),
}
# the KV a speculating decoder's step allocates past its own tokens: the k drafts it verifies,
# and vLLM's num_lookahead_tokens (vllm/v1/core/sched/scheduler.py: k more for EAGLE-type heads
# and draft models, whose proposer writes its own drafts' KV; none for an n-gram lookup)
LOOKAHEAD_METHODS = ("eagle", "eagle3", "mtp", "draft_model")


def lookahead_tokens(method, k):
    """KV tokens a speculating decoder holds beyond its own (Speculation.lookahead)."""
    return k + (k if method in LOOKAHEAD_METHODS else 0)


# The drafts' own layers (vLLM loads them on the target's cards, at its TP): EAGLE's head is
# one decoder layer fed by `fc`, the token's embedding joined with the target's hidden state (2h
# -> h: vllm/model_executor/models/llama_eagle.py); EAGLE-3's joins three of the target's hidden
# states (3h -> h), and its layer's q, K and V read the embedding beside them (2h wide:
# llama_eagle3.py); DeepSeek's MTP module is one layer of the target's kind after its eh_proj (2h
# -> h: deepseek_mtp.py). Each shares the target's embedding; EAGLE and MTP its LM head too
# (load_eagle_model shares what the head's checkpoint lacks), EAGLE-3 keeps its own over a draft
# vocabulary (32,000 tokens: draft_vocab_size of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).
FUSED_WIDTHS = {"eagle": 2, "eagle3": 3, "mtp": 2}
EAGLE3_DRAFT_VOCAB = 32000


def draft_config(method, cfg, model=None):
    """The model a method's drafts run (see FUSED_WIDTHS): EAGLE's and EAGLE-3's head, one dense
    decoder layer of the target's width with an LM head (EAGLE-3's its own, over its draft
    vocabulary); the MTP modules, a layer of the target's own kind each; a draft model, its own
    preset; an n-gram lookup, none."""
    if method in ("eagle", "eagle3"):
        own = method == "eagle3"  # (its own LM head, whatever the target ties)
        return dataclasses.replace(cfg, layers=1, experts=0, experts_per_token=0,
                                   shared_experts=0, dense_layers=0, mtp_layers=0,
                                   ffn_hidden=cfg.ffn_hidden or cfg.expert_ffn,
                                   vocab=min(cfg.vocab, EAGLE3_DRAFT_VOCAB) if own else
                                   cfg.vocab, tied=cfg.tied and not own,
                                   name=f"{cfg.name} {method} head")
    if method == "mtp":  # (every module the checkpoint ships: vLLM builds them all)
        return dataclasses.replace(cfg, layers=max(cfg.mtp_layers, 1), dense_layers=0,
                                   mtp_layers=0, name=f"{cfg.name} mtp module")
    if method == "draft_model":
        return dataclasses.replace(MODELS[model], weights=cfg.weights, kv_dtype=cfg.kv_dtype)
    return None


def draft_memory(method, draft, tp=1, ep=1):
    """What the `draft` (draft_config's) keeps on each of the target's cards (DraftMemory): a
    draft model all its weights; a head its layer and `fc` (FUSED_WIDTHS), less the target's
    embedding and LM head it shares; and each its KV a token, its layers' in the target's
    cache. An n-gram lookup keeps nothing."""
    if draft is None:
        return NO_DRAFT._replace(method=method)
    weights = card_weight_bytes(draft, tp, ep)
    if method in FUSED_WIDTHS:
        parts = weight_parts(draft)
        shared = ("embeddings",) if method == "eagle3" else ("embeddings", "lm_head")
        split = tp if ep == 1 else 1  # (an expert-parallel card holds every dense weight)
        own = (FUSED_WIDTHS[method] * draft.hidden ** 2 + (draft.hidden * (
            draft.q_dim + 2 * draft.kv_dim) if method == "eagle3" else 0)) * \
            draft.weight_element_bytes
        weights += (own - sum(n * e for name, (n, e) in parts.items() if name in shared)) / split
    return DraftMemory(weights, card_kv_bytes_per_token(draft, tp), method)


def geometric_rates(rate, k):
    """Per-position rates of one acceptance rate, each draft accepted with `rate` once those
    before it were: rate, rate^2, ..., rate^k."""
    return tuple(rate ** i for i in range(1, k + 1))


def expected_length(rates):
    """Mean tokens a verify step emits: 1 + the per-position rates' sum (the bonus token
    included)."""
    return 1.0 + float(sum(rates))


def rates_for_length(length, k):
    """The geometric rates of k drafts whose acceptance length is `length` (1 to k + 1)."""
    if not 1.0 <= length <= k + 1:
        raise UsageError(f"--acceptance-length {length:g}: a verify step of {k} drafts emits "
                         f"from 1 to {k + 1} tokens")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # (the length rises with the rate: bisect)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_length(geometric_rates(mid, k)) < length else (lo, mid)
    return geometric_rates((lo + hi) / 2, k)


def extended(rates, k):
    """Per-position rates cut or extended to k drafts, at the last ratio of those given."""
    rates = tuple(rates)
    ratio = rates[-1] / rates[-2] if len(rates) > 1 and rates[-2] else rates[-1]
    while len(rates) < k:
        rates += (rates[-1] * ratio,)
    return rates[:k]


def checked_rates(rates):
    """Per-position rates a law can be: each from 0 to 1, never rising (a draft is accepted only
    after those before it). -> the rates, or a one-line UsageError"""
    if not rates or any(not 0.0 <= a <= 1.0 for a in rates):
        raise UsageError(f"--acceptance-rates {','.join(f'{a:g}' for a in rates)}: each rate is "
                         "a share from 0 to 1")
    if any(b > a + 1e-12 for a, b in zip(rates, rates[1:])):
        raise UsageError(f"--acceptance-rates {','.join(f'{a:g}' for a in rates)}: a position's "
                         "rate counts drafts accepted after every one before it, so it never "
                         "rises")
    return tuple(float(a) for a in rates)


def step_gains(u, rates):
    """The tokens verify steps emit for uniform draws `u` (an array): 1 + the drafts accepted,
    the i-th accepted when u < a_i (the rates never rise, so those before it are too)."""
    gains = np.ones(np.shape(u), dtype=np.int64)
    for a in rates:
        gains += u < a
    return gains


def verify_steps(tokens, rates, rng, columns=32, gains=None):
    """How many verify steps each request takes to emit `tokens` (an int array; 0: none), each
    step's gain drawn from the law; a step emits what is left at most. Drawn `columns` steps a
    request at a time for the requests still short (a million requests: a second or two).
    gains: a list of a list per request, given each of its steps' gains as drawn (D's engine
    emits them)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    steps = np.zeros(len(tokens), dtype=np.int64)
    left, short = tokens.copy(), np.flatnonzero(tokens > 0)
    while short.size:
        drawn = step_gains(rng.random((short.size, columns)), rates)
        emitted = drawn.cumsum(axis=1)
        reached = emitted >= left[short, None]
        done = reached.any(axis=1)
        if gains is not None:
            keep_gains(gains, short, drawn, np.where(done, reached.argmax(axis=1) + 1, columns),
                       left)
        steps[short[done]] += reached[done].argmax(axis=1) + 1
        steps[short[~done]] += columns
        left[short[~done]] -= emitted[~done, -1]
        short = short[~done]
    return steps


def keep_gains(gains, short, drawn, taken, left):
    """(verify_steps) Requests `short` take the first `taken` steps of their rows of `drawn`
    gains, the last of a request's steps cut to what it has left."""
    for r, row, n in zip(short.tolist(), drawn, taken.tolist()):
        steps = row[:n].tolist()
        steps[-1] -= max(sum(steps) - int(left[r]), 0)
        gains[r] += steps


@dataclass(frozen=True)
class Speculation:
    """A replica's speculative decoding: `method` (one of METHODS), k drafts a step, their
    per-position acceptance `rates` (`law`: where they come from), `lookahead` KV tokens a
    decoder holds beyond its own (the k drafts verified, and the scheduler's lookahead), and
    the `seed` its draws come from."""
    method: str
    k: int
    rates: tuple
    law: str
    lookahead: int
    seed: int = 0

    @property
    def expected_length(self):
        return expected_length(self.rates)

    @property
    def decode_tokens(self):
        """A verify step runs k + 1 query tokens a decoder (what it takes of a step's token
        budget and what its pass is priced for)."""
        return DecodeTokens(self.k + 1, 1)

    def batch(self, output):
        """The SpeculativeBatch of a replica serving requests of `output` tokens each."""
        return SpeculativeBatch(self, output)

    def steps_for(self, output):
        """Each request's verify steps for its decode (output - 1 tokens: the first comes out
        of its prefill), drawn once per array of outputs and seed (every replica of a run draws
        the same for the same request)."""
        memo = _DRAWN.get(self)
        if memo is None or memo[0] is not output:
            steps = verify_steps(np.maximum(np.asarray(output) - 1, 0), self.rates,
                                 np.random.default_rng(self.seed))
            memo = _DRAWN[self] = (output, steps.tolist())
        return memo[1]

    def gains_for(self, output):
        """Each request's verify steps' gains, the tokens each emits, as steps_for draws them
        (D's engine emits them)."""
        gains = [[] for _ in range(len(output))]
        verify_steps(np.maximum(np.asarray(output) - 1, 0), self.rates,
                     np.random.default_rng(self.seed), gains=gains)
        return gains


_DRAWN = {}  # Speculation -> (the outputs it drew for, their steps): see steps_for


class SpeculativeBatch(DecodeBatch):
    """The decoding requests of a speculating replica: each runs k + 1 query tokens a step and
    takes its own drawn number of verify steps (Speculation.steps_for; a request coming back
    from preemption draws again for what it has left), its cache growing at its own mean rate
    (seq.rate tokens a step) from its start to its end. (Tokens held are fractional between the
    two: a fluid account of what the drawn steps emit.)"""
    __slots__ = ("spec", "output", "drawn", "rng", "chunks")

    def __init__(self, spec, output):
        super().__init__(spec.decode_tokens)
        self.spec, self.output, self.drawn = spec, output, spec.steps_for(output)
        self.rng = np.random.default_rng(spec.seed + 1)  # (a preempted request's redraws)
        self.gains = spec.k + 1  # (the most a step gains: what a queue's room estimate takes)
        self.chunks = [0] * len(output)  # each request's stream chunks after its first token

    def join(self, seqs, steps):
        ends, base_sum, growth = self.ends, self.base_sum, self.growth
        for seq in seqs:
            n = seq.to_emit
            drawn = self.drawn[seq.id] if n == self.output[seq.id] - 1 else \
                int(verify_steps(np.array([n]), self.spec.rates, self.rng)[0])
            drawn = max(drawn, 1)
            seq.rate = n / drawn
            seq.decode_base = seq.num_cached - seq.rate * steps
            seq.end_step = steps + drawn
            self.chunks[seq.id] += drawn  # (less those a preemption cuts off: see leave)
            base_sum += seq.decode_base
            growth += seq.rate
            heapq.heappush(ends, (seq.end_step, seq.admitted))
        self.size += len(seqs)
        self.tokens += self.runs * len(seqs)
        self.growth, self.base_sum = growth, base_sum

    def leave(self, seq, steps):
        """(DecodeBatch.leave; its chunks: the verify steps it did not run taken off, and one
        on for the token the prefill that brings it back emits.)"""
        self.chunks[seq.id] += 1 - max(seq.end_step - steps, 0)
        return super().leave(seq, steps)

    def emitted(self, seq, cached):
        """The whole tokens it has emitted (its `cached` is its fluid account: what the cache
        frees), short of its last."""
        return min(int(cached - seq.num_cached + 1e-9), seq.to_emit - 1)

    def held_by(self, seq, steps):
        return seq.decode_base + seq.rate * steps

    def growth_of(self, seq):
        return seq.rate


class SpeculativeCosts:
    """A speculating replica's PassPrices: the target's (`verify`, priced for the k + 1 query
    tokens of each decoder, its KV read once a sequence) and, each step, the draft's k passes
    at the batch (`draft`: a StepCosts of the draft, over the same context; None: an n-gram
    lookup, on the CPU beside the step)."""

    def __init__(self, verify, draft, k):
        self.verify, self.draft, self.k = verify, draft, k

    @property
    def in_flight(self):
        return self.verify.in_flight

    def draft_price(self, decoders, cached, growth):
        """(seconds of a step's drafting, its growth a step) for `decoders` query tokens. On
        pipeline stages (the verify's in_flight micro-batches) the last stage drafts for each
        micro-batch in turn, after its share of the verify (vLLM's model runner V2)."""
        if self.draft is None or not decoders:
            return 0.0, 0.0
        batch = max(1, decoders // (self.k + 1))
        m = min(self.in_flight, batch)  # (the micro-batches with decoders)
        rows = -(-batch // m)
        grown = decoders if growth is None else growth
        return m * self.k * self.draft.pass_s(rows, cached * rows / batch), \
            m * self.k * self.draft.kv_s(rows) * grown * rows / batch

    def run_price(self, plan, decoders, cached, k, fused=False, growth=None):
        pre, dec, first, grows, tokens = self.verify.run_price(plan, decoders, cached, k, fused,
                                                               growth)
        a, e = self.draft_price(decoders, cached, growth)
        return pre, dec + a * k + e * k * (k - 1) / 2, first + a, grows + e, tokens

    def decode_steps_to(self, n, cached, t, when, k, growth=None):
        _, _, a, e, _ = self.run_price((), n, cached, 1, growth=growth)
        return steps_to(a, e, t, when, k)

    def pass_s(self, tokens, kv_tokens=0, pairs=0):
        return self.verify.pass_s(tokens, kv_tokens, pairs)

    def as_dict(self):
        return {**self.verify.as_dict(), "speculative_draft": None if self.draft is None
                else self.draft.as_dict(), "speculative_tokens": self.k}


# The methods vLLM runs on pipeline stages: EAGLE-3 (vllm-project/vllm#50514, "Support eagle3
# spec decode with pipeline parallel", tests/v1/e2e/spec_decode/eagle/test_eagle3_pp.py); MTP
# with PP is still broken there (#49355), the others refused by its config
PP_METHODS = ("eagle3",)

# --speculative-config: the keys of vLLM's speculative_config C reads, and those it takes without
# reading (an n-gram lookup's window and a length limit change the acceptance, given apart, not
# the price); others name what C does not model: refused, by name
CONFIG_KEYS = ("method", "num_speculative_tokens", "model")
UNPRICED_KEYS = ("prompt_lookup_max", "prompt_lookup_min", "max_model_len")


def parse_config(text):
    """--speculative-config's JSON, as vLLM's flag takes it -> {key: value} (one line where it
    is not)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--speculative-config {text!r}: not JSON ({e.msg})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--speculative-config {text!r}: a JSON object, as vLLM's flag takes")
    unknown = sorted(set(config) - set(CONFIG_KEYS) - set(UNPRICED_KEYS))
    if unknown:
        raise UsageError(f"--speculative-config: C reads {', '.join(CONFIG_KEYS)}, not "
                         f"{', '.join(unknown)}")
    method = config.get("method")
    if method not in METHODS:
        raise UsageError(f"--speculative-config: method {method!r} is none of "
                         f"{', '.join(METHODS)}")
    k = config.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                          or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
        raise UsageError(f"--speculative-config: num_speculative_tokens {k!r} is not a whole "
                         f"number from 1 to {MAX_SPECULATIVE_TOKENS}")
    if method == "draft_model" and "model" not in config:
        raise UsageError("--speculative-config: method draft_model names its draft by \"model\" "
                         "(a preset: see --catalog)")
    if method in ("ngram", "mtp") and "model" in config:
        raise UsageError(f"--speculative-config: method {method} drafts without a model of its "
                         "own: leave \"model\" out")
    return config


def resolve(config, k=None, rate=None, rates=None, length=None):
    """The run's speculation from --speculative-config (parse_config's) and the acceptance
    flags (one of them at most; else the method's DEFAULT_ACCEPTANCE) -> the SchedulerConfig
    fields: method, k (--num-speculative-tokens, else the config's, else the rates', else 1),
    the draft model, k per-position rates and where they come from."""
    method = config["method"]
    given = [flag for flag, value in (("--acceptance-rate", rate), ("--acceptance-rates", rates),
                                      ("--acceptance-length", length)) if value is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)}: give the acceptance one way")
    if k is not None and config.get("num_speculative_tokens") not in (None, k):
        raise UsageError(f"--num-speculative-tokens {k} and --speculative-config's "
                         f"num_speculative_tokens {config['num_speculative_tokens']}: give one")
    k = k or config.get("num_speculative_tokens") or (len(rates) if rates else None) or 1
    if k > MAX_SPECULATIVE_TOKENS:
        raise UsageError(f"--acceptance-rates: {k} positions, more drafts a step than C takes "
                         f"({MAX_SPECULATIVE_TOKENS}): give --num-speculative-tokens")
    if rates is not None:
        if len(rates) < k:
            raise UsageError(f"--acceptance-rates: {len(rates)} rate(s) for {k} drafts a step "
                             "(one a position)")
        law, rates = "rates", checked_rates(rates)[:k]
    elif rate is not None:
        law, rates = "rate", geometric_rates(rate, k)
    elif length is not None:
        law, rates = "length", rates_for_length(length, k)
    elif method in DEFAULT_ACCEPTANCE:
        law, rates = method, extended(DEFAULT_ACCEPTANCE[method][0], k)
    else:
        raise UsageError(f"--speculative-config: method {method} has no published acceptance "
                         "C takes as its default (it depends on the text): give "
                         "--acceptance-rate, --acceptance-rates or --acceptance-length")
    return {"speculative_method": method, "num_speculative_tokens": k,
            "speculative_model": config.get("model"), "acceptance_rates": tuple(rates),
            "acceptance_law": law}
