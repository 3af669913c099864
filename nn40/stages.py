"""Pipeline stages: a replica whose layers are split over pp cards, each stage one card (or a
TP group), the decoders as micro-batches in flight (PipelineCosts), and a stage's share of the
model, which is what a card of it holds (stage_model) (pure)
"""
import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineCosts:
    """A replica of `pp` pipeline stages, each holding 1/pp of the layers: a stage's pass is
    1/pp of the whole model's (`inner`, any StepCosts or PhaseCosts), a pass through the
    replica the stages' sum plus pp - 1 hops of the pass's activations (hop_latency_s +
    hop_token_s x the pass's tokens: a token's hidden bytes over the link). The decoders run
    as pp micro-batches in flight, as vLLM and Vidur run them: each stage busy with one of
    them at a time, every micro-batch of n / pp rows (rounded up) emits a token each cycle of
    pp stage passes, its hops among them (micro_batches 1: the whole batch goes through the
    stages, one in flight). The prompts' chunks of a step are shared among the micro-batches
    too, each chunk whole in one of them (the longest first, each into the lightest), so
    that the heaviest micro-batch sets the cycle: prompts prefilled side by side overlap
    across the stages, where a lone prompt still passes through every stage in turn (vLLM
    v1's engine core keeps pp scheduled batches in flight, each its own step:
    vllm/v1/engine/core.py, step_with_batch_queue)."""
    inner: object
    pp: int
    hop_latency_s: float = 0.0
    hop_token_s: float = 0.0
    micro_batches: int = None  # in flight at once (None: pp; 1: a batch through the stages)
    row_tokens: int = 1  # query tokens a decoder runs a step (a verify step's k + 1), whole in
    # one micro-batch

    def hops_s(self, tokens):
        return (self.pp - 1) * (self.hop_latency_s + self.hop_token_s * tokens) if tokens \
            else 0.0

    def micro_batch(self, n, cached):
        """(query rows, tokens cached) of the heaviest of the micro-batches in flight, of n
        query rows (row_tokens a decoder) holding `cached`: its decoders' share, rounded
        up."""
        per = self.row_tokens
        rows = per * -(-(n // per) // self.in_flight)
        return rows, cached * rows / n if n else 0

    @property
    def in_flight(self):
        return self.micro_batches or self.pp

    def heaviest_prompts(self, plan):
        """The chunks of `plan` ([(Seq, tokens)]) that the heaviest of the micro-batches in
        flight carries: each chunk whole in one, the longest first, each into the one with
        the fewest tokens so far."""
        m = self.in_flight
        if len(plan) < 2 or m == 1:
            return plan
        shares, loads = [[] for _ in range(m)], [0] * m
        for item in sorted(plan, key=lambda item: -item[1]):
            i = loads.index(min(loads))
            shares[i].append(item)
            loads[i] += item[1]
        return shares[loads.index(max(loads))]

    def run_price(self, plan, decoders, cached, k, fused=False, growth=None):
        rows, held = self.micro_batch(decoders, cached)
        # (a micro-batch's share of the growth)
        grown = None if growth is None or not decoders else growth * rows / decoders
        pre_s, dec_s, first, growth, tokens = self.inner.run_price(
            self.heaviest_prompts(plan), rows, held, k, fused, grown)
        pre_hops, dec_hops = self.hops_s(tokens), self.hops_s(rows)
        return (pre_s + k * pre_hops, dec_s + k * dec_hops, first + pre_hops + dec_hops,
                growth, sum(c for _, c in plan))

    def decode_steps_to(self, n, cached, t, when, k, growth=None):
        """The first step count in 1..k whose decode run ends at or after `when` (else k)."""
        first, growth = self.run_price((), n, cached, 1, growth=growth)[2:4]
        return steps_reaching(first, growth, when - t, k)

    def pass_s(self, tokens, kv_tokens=0, pairs=0):
        return self.inner.pass_s(tokens, kv_tokens, pairs) + self.hops_s(tokens)

    def as_dict(self):
        stages = self.inner.as_dict()
        return {"pp": self.pp, "hop_latency_s": self.hop_latency_s,
                "hop_token_s": self.hop_token_s, "stages": stages, "source": {
                    "kind": "pricing_stages", "pp": self.pp, "stages": stages["source"]}}


def steps_reaching(first, growth, gap, k):
    """The fewest steps j in 1..k with first j + growth j (j - 1) / 2 >= gap (else k)."""
    if growth > 0:
        x = ((growth / 2 - first) + math.sqrt((first - growth / 2) ** 2 + 2 * growth *
                                               max(gap, 0))) / growth
    else:
        x = gap / first if first > 0 else k
    j = min(max(1, math.ceil(x)), k)
    while j > 1 and first * (j - 1) + growth * (j - 1) * (j - 2) / 2 >= gap:
        j -= 1
    return j


def pipeline_costs(costs, pp, cfg, card, tp=1, micro_batches=None):
    """`costs` on pp stages joined by the card's link (a hop: one token's hidden state in the
    model's dtype over the link, at the link's spec, no latency), or `costs` itself at pp 1."""
    if pp == 1:
        return costs
    return PipelineCosts(costs, pp, 0.0, cfg.hidden * cfg.dtype_bytes / tp /
                         (card.link_gbs * 1e9), micro_batches)


def pipelined(replica):
    """A replica of pipeline stages with a step's budget for each micro-batch in flight (vLLM
    v1 schedules each of the pp batches it keeps in flight with its own
    max_num_batched_tokens), a prompt's chunk within one batch's, else the replica itself."""
    if not isinstance(replica.costs, PipelineCosts):
        return replica
    m = replica.costs.in_flight
    return dataclasses.replace(replica, chunk_tokens=replica.chunk_tokens and
                               replica.chunk_tokens * m, prompt_tokens=replica.prompt_tokens
                               and replica.prompt_tokens * m,
                               batch_tokens=replica.chunk_tokens if m > 1 else None)


def stage_model(cfg, pp):
    """What one card of a replica of pp stages holds: the largest stage's layers (the
    embeddings and the head counted on it, the safe side), so its weights and its share of
    every token's KV."""
    return cfg if pp == 1 else dataclasses.replace(cfg, layers=-(-cfg.layers // pp))
