"""The event loop: requests in seconds through one replica's seats (pure Python)

The loop moves from event to event: an arrival, an admission, a prefill (or a chunk of one),
a finish, a preemption, or, when memory binds, the block boundary the cache cannot pass.
Between two events the batch is fixed and every step is alike but for its growing caches, so
a run of k steps is priced in closed form: step j takes a + e (j - 1) seconds. Nothing is
done per step or per slot: the decoding requests are kept as aggregates (a DecodeBatch: how
many, their cached tokens, a heap of the steps at which they end), so an event costs O(log
slots).
"""
import heapq
import math
import time

import numpy as np

from nn40.kv import KVUnfit, Seq, kv_manager
from nn40.queues import Ledger, waiting_queue
from nn40.replicas import DecodeBatch, PrefillQueue, SimulationStalled, schedule_prefill


class MemoryRecord:
    """A run's KV memory over time: the integrals of tokens held and allocated and of requests
    running over seconds, peaks, preemptions, and a series of points (t, held, allocated,
    running) at every stride-th iteration, thinned to at most 4,096."""
    __slots__ = ("totals", "stride")

    def __init__(self):
        self.totals = {"held_s": 0.0, "alloc_s": 0.0, "running_s": 0.0, "peak_running": 0,
                       "max_alloc": 0, "preemptions": 0, "recomputed_tokens": 0, "series": [],
                       "peak_held": 0, "peak_contexts": []}
        self.stride = 1

    def run(self, held0, growth, k, a, e):
        """k steps (step j: a + e (j - 1) s) from held0 tokens held, `growth` more after each
        step: the tokens held after each step weighted by its seconds. -> tokens held after
        the last step."""
        self.totals["held_s"] += a * (k * held0 + growth * (k * (k + 1) // 2)) + e * (
            held0 * (k * (k - 1) // 2) + growth * ((k - 1) * k * (k + 1) // 3))
        return held0 + growth * k

    def allocated(self, alloc_token_s, running_s):
        """A run's integrals of tokens allocated and of requests running over its seconds."""
        self.totals["alloc_s"] += alloc_token_s
        self.totals["running_s"] += running_s

    def hold(self, tokens, allocated, seconds):
        """`tokens` (in `allocated` tokens of blocks) held `seconds` beyond the runs counted:
        a prefill's KV kept until it has crossed to the decode pool."""
        self.totals["held_s"] += tokens * seconds
        self.totals["alloc_s"] += allocated * seconds

    def preempted(self, cached):
        self.totals["preemptions"] += 1
        self.totals["recomputed_tokens"] += cached

    def point(self, t, iteration, held, allocated, running, contexts):
        """Peaks, and a point of the series; contexts(): the tokens each request holds."""
        mem = self.totals
        mem["peak_running"] = max(mem["peak_running"], running)
        mem["max_alloc"] = max(mem["max_alloc"], allocated)
        if held > mem["peak_held"]:
            mem["peak_held"] = held
            mem["peak_contexts"] = contexts()
        if iteration % self.stride == 0:
            mem["series"].append((t, held, allocated, running))
            if len(mem["series"]) >= 4096:  # every other point, and half as often from now on
                del mem["series"][1::2]
                self.stride *= 2


class Admission:
    """Admission, ServingSim's part: who takes a free seat, into what memory, and who is
    preempted to make room. It reads the replica's state that ServingSim keeps (waiting,
    retry, running, ledger, kv, slots, scheduler, chunk_tokens, prefill, decode, memory, t,
    steps, admissions) and changes it only as admission does."""

    def make_room(self):
        """Preempt the newest request while the planned step needs more memory than exists.
        -> the KV tokens the planned step then takes."""
        ledger, kv = self.ledger, self.kv
        while True:
            taken = kv.planned(self.steps, schedule_prefill(
                self.prefill.seqs, self.decode.tokens, self.chunk_tokens, self.chunk_cap))
            if not self.running or taken <= kv.capacity:
                return taken
            seq = self.running[next(reversed(self.running))]
            to_emit, cached = self.leave(seq, preempted=True)
            r = seq.id  # readmitted, it prefills its prompt and what it generated again
            ledger.to_prefill[r] = ledger.prompt[r] + ledger.generated[r]
            ledger.remaining[r], ledger.cached[r] = to_emit, 0
            self.memory.preempted(cached)
            heapq.heappush(self.retry, r)

    def admit(self, taken):
        """Admit waiting requests (preempted first, then in the queue's order) into free
        slots, into the KV memory the planned step leaves (`taken`: what it takes); nobody
        overtakes the head of the line. A request may come part-way: ledger.cached of it
        computed already (all of it: it decodes at once). -> True when the head of the line
        waits for memory."""
        first = self.first_to_admit()
        if first is None:  # (the usual event: nobody to admit, found before anything is set up)
            return False
        r, free, spare = first
        retry, t, head = self.retry, self.t, self.waiting.head
        kv, ledger, tracks, need, pop = self.kv, self.ledger, self.tracks, 0, self.waiting.pop
        lookup = kv.lookup if kv.tracks_prefixes else None  # (else ledger.cached's, read)
        known, to_prefill, start = ledger.cached, ledger.to_prefill, ledger.start
        room, watermark, running, admitted = kv.capacity - taken, kv.watermark, \
            self.running, self.admissions
        joined, blocked = [], False  # (the prefill queue is joined once, at the end)
        whole = self.prompt_tokens  # (a budget of whole prompts: continuous)
        while True:
            cached = lookup(ledger, r) if lookup else known[r]
            prompt_left = to_prefill[r] - cached
            if whole and prompt_left > spare and (joined or self.prefill.left):
                break  # (a whole prompt past the step's budget waits for the next step)
            if tracks:  # (the null manager needs nothing and holds nothing)
                need = kv.need(ledger.prompt[r], cached,
                               prompt_left if whole else min(prompt_left, spare), prompt_left)
                if need + watermark > room:
                    blocked = True
                    break
            if retry:
                heapq.heappop(retry)
            else:
                pop()
            seq = Seq(r, admitted, prompt_left, ledger.remaining[r], cached)
            running[admitted] = seq
            admitted += 1
            if start[r] != start[r]:  # (nan: its first admission)
                start[r] = t
            if tracks:
                kv.admit(seq, need)
            spare -= self.place(seq, prompt_left if whole else min(prompt_left, spare), joined)
            room, free = room - need, free - 1
            if not free or spare <= 0:
                break
            r = retry[0] if retry else head(t)
            if r is None:
                break
        self.admissions = admitted
        self.prefill.join(joined)
        return blocked

    def place(self, seq, chunk, joined):
        """Where a request just admitted goes: the prefill queue (`joined`, its first `chunk`
        tokens' blocks cached as they are scheduled), parked while a host tier loads its KV,
        or, its prompt computed elsewhere, the decode batch from the next step. -> the prompt
        tokens it takes of this step's budget"""
        kv = self.kv
        if not seq.prompt_left:
            self.decode.join((seq,), self.steps)
            if self.tracks:
                kv.join(seq)  # (after the join: it reads the decoder's start)
            return 0
        wait = kv.load_s(seq, self.t) if kv.loads else 0.0
        if wait:
            self.parked.append((self.t + wait, seq))
            self.parked_cached += seq.num_cached
            return 0
        if kv.caches_scheduled:  # (a pipeline's chunk: within one batch's budget)
            kv.schedule(seq, min(chunk, self.chunk_cap or chunk))
        joined.append(seq)
        return seq.prompt_left

    def unpark(self):
        """The parked requests whose KV has landed by now join the prefill queue (their
        loaded blocks cached from now on)."""
        landed = [seq for ready, seq in self.parked if ready <= self.t]
        if landed:
            self.parked = [(ready, seq) for ready, seq in self.parked if ready > self.t]
            self.parked_cached -= sum(seq.num_cached for seq in landed)
            for seq in landed:
                self.kv.landed(seq)
            self.prefill.join(landed)

    def idle_until(self, land):
        """Nothing runs while KV loads until `land`: the clock moves to it, or to an arrival
        before it, and plans there. -> plan()'s answer"""
        arrival = self.waiting.next_arrival() if self.waiting else math.inf
        self.t = min(land, arrival if arrival > self.t else math.inf)
        return self.plan()

    def first_to_admit(self):
        """(the request admission takes first, the free slots, the prompt tokens the step can
        still take), or None where nobody can be admitted now; idle, the clock moves to the
        next arrival."""
        if self.running:
            if self.scheduler == "static":
                return None
        elif not self.retry and self.waiting.head(self.t) is None and self.waiting:
            self.t = self.waiting.next_arrival()  # idle until the next request arrives
        free = self.slots - len(self.running)
        spare = self.spare() if free else 0
        if spare <= 0:
            return None
        r = self.retry[0] if self.retry else self.waiting.head(self.t)
        return None if r is None else (r, free, spare)

    def spare(self):
        """Prompt tokens this step could still take in (chunked: its token budget, less the
        decodes'; continuous with prompt_tokens: that budget)."""
        if self.chunk_tokens is not None:
            return self.chunk_tokens - self.decode.tokens - self.prefill.left
        return math.inf if self.prompt_tokens is None else \
            self.prompt_tokens - self.prefill.left

    def could_join(self, blocked):
        """Whether a request arriving now could be admitted at the next step."""
        return not blocked and self.scheduler != "static" and len(self.running) < self.slots \
            and self.spare() > 0


class ServingSim(Admission):
    """One replica in the serving simulation (see simulate_serving): plan (admit at the clock,
    choose the next run of identical steps), then commit (run it). Pools of replicas
    (simulate_pools) interleave their loops in one event queue, handing each its requests as
    they arrive (alone: all at once, `ids`), and are told of first tokens and finishes (hooks)."""

    def __init__(self, req, replica, progress=None, ledger=None, ids=None):
        self.ledger = ledger = ledger or Ledger(req)
        ids = range(len(ledger.output)) if ids is None else ids
        self.waiting = waiting_queue(ledger, ids, replica.order)  # requests not yet admitted
        self.n, self.slots, self.costs, self.scheduler = len(ids), replica.slots, \
            replica.costs, replica.scheduler
        self.chunk_tokens = replica.chunk_tokens if replica.scheduler == "chunked" else None
        self.chunk_cap = replica.batch_tokens  # (a chunk's most: a pipeline's batch budget)
        # (whole prompts up to a budget: a continuous step's)
        self.prompt_tokens = replica.prompt_tokens if replica.scheduler == "continuous" \
            else None
        self.fused, self.progress = replica.fused, progress
        self.prefill_first = replica.prefill_first and not replica.fused
        self.kv = kv = kv_manager(replica.kv, replica.decode_tokens.gains)
        spec = replica.speculation
        if spec is not None:
            kv.for_speculation(spec)
            unfit = kv.unfit(req) if kv.tracks and req is not None else None  # (its drafts'
            # slots too; a pool's stage checks its own requests: see pools.pool_stage)
            if unfit:
                raise KVUnfit(replica.kv.policy, unfit)
        self.tracks, self.preempts = kv.tracks, kv.preempts
        self.retry = []                  # preempted ids (a heap: the oldest first)
        self.parked, self.parked_cached = [], 0  # [(when its KV lands, Seq)] waiting for a
        # host tier's load, and the tokens they hold
        self.pending = self.price = None  # the planned run (see plan), its price (planned_price)
        self.running = {}                # admission order -> Seq, oldest first
        self.prefill = PrefillQueue()  # the running requests by phase
        self.decode = DecodeBatch(replica.decode_tokens) if spec is None else \
            spec.batch(ledger.output)
        self.t, self.steps, self.busy, self.done, self.iterations, self.admissions = \
            0.0, 0, 0, 0, 0, 0
        self.prefill_s = self.decode_s = self.longest_step_s = 0.0
        self.memory = MemoryRecord()     # (where kv.tracks)
        self.on_first_token = self.on_finish = None  # hooks (request, t): what a pool is told

    # the loop: plan (admit at the clock, choose a run of identical steps), then commit

    def serve(self):
        """Serve every request given; -> result()."""
        clock = time.perf_counter()
        while self.plan():
            self.commit()
            if self.progress and not self.iterations % 65536 and \
                    time.perf_counter() - clock > 10:
                clock = time.perf_counter()
                self.progress(f"{self.done:,} / {self.n:,} requests finished, "
                              f"{self.t:,.1f} s simulated")
        return self.result()

    def plan(self):
        """Admit at the clock and plan the run of steps up to the next event: self.pending is
        (this step's prefill chunks [(Seq, tokens)], how many steps, whether the head of the
        line waits for memory). -> False when there is nothing left to run (nothing running,
        waiting or preempted)."""
        self.iterations += 1
        if self.parked:
            self.unpark()
        taken = self.make_room() if self.preempts else \
            self.kv.planned(self.steps, ()) if self.tracks else 0
        if self.kv.caches_scheduled:  # (the running requests' next step is allocated and
            # cached as scheduled, before newcomers look theirs up: vLLM's order)
            self.kv.schedule_decoders(self.steps)
            for seq, chunk in schedule_prefill(self.prefill.seqs, self.decode.tokens,
                                               self.chunk_tokens, self.chunk_cap) \
                    if self.prefill.seqs else ():
                self.kv.schedule(seq, chunk)
        blocked = self.admit(taken)
        plan = schedule_prefill(self.prefill.seqs, self.decode.tokens, self.chunk_tokens,
                                self.chunk_cap)
        if not plan and not self.decode.size:
            if self.parked:  # idle while KV loads
                return self.idle_until(min(ready for ready, _ in self.parked))
            if not (self.waiting or self.retry) or self.kv.lent:
                return False  # (or its room is lent to KV in flight: it plans as that lands)
            raise SimulationStalled(
                f"the {self.scheduler} simulation stalled at t = {self.t:.3f} s with "
                f"{len(self.waiting) + len(self.retry):,} requests waiting and none running")
        self.pending = (plan, self.steps_until_event(plan, blocked), blocked)
        self.price = None
        return True

    def commit(self):
        """Run the planned steps."""
        plan, k, _ = self.pending
        price = self.planned_price()
        self.pending = self.price = None
        self.advance(plan, k, price)
        for seq in self.decode.due(self.steps, self.running):  # (finished: they retire)
            self.retire(seq)

    # stepping: how many identical steps run, what they cost, and who they move on

    def steps_until_event(self, plan, blocked):
        """How many identical steps run before the next event can change the batch."""
        decode = self.decode
        k = decode.ends[0][0] - self.steps if decode.size else math.inf  # the next finish
        if plan:
            seq, chunk = plan[0]
            if len(plan) > 1 or chunk == seq.prompt_left:
                return 1  # a prefill ends (or several run): one step
            k = min(k, (seq.prompt_left - 1) // chunk)  # one prompt's chunks, short of its last
        elif self.waiting and self.could_join(blocked):
            k = self.steps_to_reach(self.waiting.next_arrival(), k)  # a newcomer could join
        if self.parked and k > 1:  # (a load lands: it joins at the next step boundary)
            k = 1 if plan else self.steps_to_reach(min(ready for ready, _ in self.parked), k)
        if self.preempts and k > 1:
            k = self.kv.max_steps(self.steps, plan, k)
        return k

    def steps_to_reach(self, when, k):
        """The first step count in 1..k whose decode run ends at or after `when` (else k)."""
        decode = self.decode  # (DecodeBatch.cached, inline)
        return self.costs.decode_steps_to(decode.tokens, decode.base_sum + decode.growth
                                          * self.steps, self.t, when, k, decode.growth)

    def planned_price(self):
        """The planned run's price (PassPrices.run_price's), priced once a plan: the clock
        commit sets, and the end a fleet's event queue reads first (FleetReplica.pending_end),
        are one sum of one price."""
        price = self.price
        if price is None:
            plan, k, _ = self.pending
            decode = self.decode  # (DecodeBatch.cached, inline)
            price = self.costs.run_price(plan, decode.tokens, decode.base_sum + decode.growth
                                         * self.steps, k, self.fused, decode.growth)
            self.price = price
        return price

    def advance(self, plan, k, price):
        """Run the k steps of the plan at their price: account memory, move every running
        request on."""
        emitted = []  # a finished prefill emits a token (a loop: a comprehension is a call)
        for s, c in plan:
            if c == s.prompt_left:
                emitted.append(s)
        prefill_s, decode_s, first_s, growth_s, tokens = price
        running, held = len(self.running), 0
        if self.tracks:  # (before the clock moves: it reads the run's start)
            held = self.account(plan, k, price)
        self.t += prefill_s + decode_s
        self.prefill_s += prefill_s
        self.decode_s += decode_s
        self.longest_step_s = max(self.longest_step_s, first_s + growth_s * (k - 1))
        self.steps += k
        self.busy += k * running
        if plan:
            self.prefill.advance(plan, k, tokens)
        if emitted:
            self.emit_first_tokens(emitted, held, running,
                                   self.t - decode_s if self.prefill_first else self.t)
        elif self.tracks:
            self.memory.point(self.t, self.iterations, held, self.kv.total, running,
                              self.contexts)

    def emit_first_tokens(self, emitted, held, running, t):
        """The requests whose prefill has just ended emit a token at t; each then decodes
        (or, with nothing left to emit, finishes)."""
        first, first_step, steps = self.ledger.first_token, self.ledger.first_step, self.steps
        cached, decoders, finished = 0, [], []
        for s in emitted:
            if first[s.id] != first[s.id]:  # (nan; a readmitted request keeps its first)
                first[s.id] = t
                first_step[s.id] = steps
                if self.on_first_token:
                    self.on_first_token(s.id, t)
            cached += s.num_cached
            s.to_emit -= 1
            s.num_cached += 1
            (decoders if s.to_emit else finished).append(s)
        self.prefill.done(len(emitted), cached)
        if self.tracks:
            self.memory.point(self.t, self.iterations, held, self.kv.total, running,
                              self.contexts)
        for s in finished:
            self.retire(s)
        self.decode.join(decoders, steps)
        if self.tracks:
            for s in decoders:
                self.kv.join(s)  # (after the join: it reads the decoder's start)

    def retire(self, seq):
        """A request's last token has come: it leaves its slot, finished."""
        self.leave(seq)
        ledger = self.ledger
        ledger.finish[seq.id] = self.t
        ledger.finish_step[seq.id] = self.steps
        self.done += 1
        if self.on_finish:
            self.on_finish(seq.id, self.t)

    def leave(self, seq, preempted=False):
        """Take a request out of its slot (finished, or preempted: to come back). -> (tokens
        still to emit, tokens it had cached)."""
        del self.running[seq.admitted]
        if seq.decode_base is None:  # prefilling (or a prefill that emitted its last token)
            if self.parked and any(s is seq for _, s in self.parked):  # (parked: preempted)
                self.parked = [(ready, s) for ready, s in self.parked if s is not seq]
                self.parked_cached -= seq.num_cached
                self.kv.cancel_load(seq, self.t)
            elif seq.prompt_left:
                self.prefill.leave(seq)
            to_emit, cached = seq.to_emit, seq.num_cached
        elif seq.end_step > self.steps:  # preempted while it decodes
            to_emit, cached = self.decode.leave(seq, self.steps)
        else:  # finished decoding (DecodeBatch.due took it out of the batch)
            to_emit, cached = 0, seq.decode_base + self.decode.gains * self.steps \
                if seq.rate is None else self.decode.held_by(seq, self.steps)  # (held_by,
            # inline: a finish is the loop's most frequent leave)
        if self.tracks:
            (self.kv.preempt if preempted else self.kv.release)(seq, cached)
        self.ledger.generated[seq.id] += seq.to_emit_admitted - to_emit
        return to_emit, cached

    # accounting: memory over time, and the result

    def held(self):
        """KV tokens the running requests hold (written: a decoder's newest token not yet)."""
        return self.decode.cached(self.steps) - self.decode.size + self.prefill.cached \
            + self.parked_cached - self.kv.shared

    def account(self, plan, k, price):
        """Memory integrals over the k steps just priced (step j: a + e (j - 1) s). -> tokens
        held after the last step (a prefill ending with the run has not written its first
        token)."""
        prefill_s, decode_s, a, e, tokens = price
        decode = self.decode  # (held and DecodeBatch.cached, inline: read at every event)
        memory = self.memory
        held = memory.run(decode.base_sum + decode.growth * self.steps - decode.size
                          + self.prefill.cached + self.parked_cached - self.kv.shared,
                          tokens + decode.growth, k, a, e)
        memory.allocated(self.kv.advance(self.steps, plan, k, a, e),
                         (prefill_s + decode_s) * len(self.running))
        return held

    def contexts(self):
        """The tokens each running request holds (written, as held: a prefill that has just
        emitted its first token has not written it)."""
        held_by, steps = self.decode.held_by, self.steps
        return [s.written(s.num_cached if s.decode_base is None else held_by(s, steps))
                for s in self.running.values()]

    def result(self):
        """The run's record (the ledger's times, and the tokens generated) with own_result."""
        generated = {"generated": np.array(self.ledger.generated)} if self.tracks else {}
        chunks = getattr(self.decode, "chunks", None)  # (a speculating replica's streams)
        chunked = {} if chunks is None else {"chunks": np.array(chunks)}
        return {"times": self.ledger.times(), **self.own_result(), **generated, **chunked}

    def own_result(self):
        """Its own counts, no per-request arrays (a pool's replica returns these alone)."""
        memory = {"kv": self.memory.totals} if self.tracks else {}
        busy = self.busy / (self.steps * self.slots) if self.steps else 0.0
        return {"steps": self.steps, "occupancy": busy,
                "longest_step_s": self.longest_step_s, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "iterations": self.iterations, **memory,
                **self.kv.report()}


class FleetReplica(ServingSim):
    """A replica of a pool, and what its router asks and tells it: the pools' event queue
    (simulate_pools) plans and commits its runs in time with every other replica's and routes
    by its load; a request routed to it can cut the planned run short, as the next arrival
    bounds a run when the replica runs alone."""

    def __init__(self, req, replica, ledger):
        super().__init__(req, replica, None, ledger, ids=[])
        self.version = 0           # the planned run's, to tell a queued commit that is stale
        self.wake_at = None        # idle while KV loads: when the first load lands
        self.plan_queued = False   # a plan is queued in the event queue
        self.draining = False      # every request of its pool has arrived

    def new_version(self):
        """Its planned run has changed (planned, or cut short): a commit queued for the old
        one is stale. -> the new version"""
        self.version += 1
        return self.version

    def drain(self):
        """Every request of its pool has arrived: it drops its plan (and any queued for it) and
        plans again unconditionally, as a replica alone is given its requests."""
        self.draining, self.plan_queued, self.pending, self.price = True, False, None, None
        self.version += 1

    def wake(self, t):
        """Room it lent is back at t: idle (no run planned, none queued), it plans from t.
        -> whether a plan must be queued"""
        if self.pending is not None or self.plan_queued:
            return False
        self.t, self.plan_queued = max(self.t, t), True
        return True

    def idle_until(self, land):
        """In a pool, requests not routed here yet may come before `land`: it plans again at
        land (the event queue's wake-up) or at such an arrival, whichever is first; draining,
        it has them all. -> plan()'s answer"""
        if self.draining:
            return super().idle_until(land)
        self.wake_at = land
        return False

    def may_plan(self):
        """Whether a plan now could run anything: the replica runs, or a request waits."""
        idle = not (self.running or self.retry) and self.waiting.head(self.t) is None
        return not idle or self.waiting.next_arrival() < math.inf

    def pending_end(self):
        """When the planned run ends: the clock its commit will set (see planned_price)."""
        prefill_s, decode_s = self.planned_price()[:2]
        return self.t + (prefill_s + decode_s)

    def arrive(self, r, t):
        """Request r, arriving at t, joins this replica's queue; the planned run stops at the
        first step boundary after t if r could join there."""
        self.waiting.push(r)
        self.n += 1
        if self.pending is not None:
            plan, k, blocked = self.pending
            if not plan and k > 1 and self.could_join(blocked):
                self.pending = (plan, self.steps_to_reach(t, k), blocked)
                self.price = None

    def queued_tokens(self):
        """At most the KV tokens the requests waiting here (arrived, or preempted) will take
        before a newcomer: their tokens and a block each, and a decode step's gains each."""
        ledger, room = self.ledger, self.kv.block + self.decode.gains
        return self.waiting.tokens + len(self.waiting) * room + sum(
            ledger.prompt[q] + ledger.generated[q] + room for q in self.retry)

    def load(self):
        """Requests queued, preempted and running: what least-requests routing compares."""
        return len(self.waiting) + len(self.retry) + len(self.running)

    def waiting_requests(self):
        """Requests queued and preempted: what a queue scorer compares."""
        return len(self.waiting) + len(self.retry)

    def committed_kv(self):
        """KV tokens allocated (else held), the prompt tokens admitted but not yet prefilled
        (where the allocation does not cover them) and the prompts waiting: what least-kv
        compares."""
        return self.kv.committed(self.held(), self.prefill.left) + self.waiting.tokens


def simulate_serving(req, replica, progress=None):
    """Run the requests through one Replica; per-request times and steps. progress: called
    with a line of progress now and then on a long run.

    A prefill pass and a decode pass in one step are priced as two passes. -> "times" (a
    RequestTimes: every request's start, first token and finish (s) and their steps), steps,
    occupancy, the loop's iterations, and with kv the memory it held and allocated (integrals
    over time, peaks, a thinned series).
    """
    return ServingSim(req, replica, progress).serve()
