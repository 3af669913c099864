"""The event queue every pool of a fleet runs in time together: arrivals, plans, commits and KV
sends, in the order they happen and, at one time, in their kinds' order (runs ending, then KV
sends ending, then arrivals, then new plans)
"""
import enum
import heapq
import itertools
import math
import time


class EventKind(enum.IntEnum):
    """What an event is, its value its place among the events at one time (the queue sorts by
    time, then kind): a replica's run ends first, then a KV send (its KV lands on the decode
    replica), then a request enters a pool, then a replica plans."""
    COMMIT = 0  # a replica's planned run ends (target: the replica; value: the plan's version)
    SENT = 1    # a KV send on a link ends (target: the link's KVSends; value: what was sent)
    ARRIVE = 2  # a request enters a pool (target: the pool's stage; value: the request)
    PLAN = 3    # a replica's plan, put off past the arrivals at its time (target: the replica)


COMMIT, SENT, ARRIVE, PLAN = EventKind  # (the names the loop reads)
LANDS = 1  # a PLAN's value where a parked request's KV lands (else 0: a plan put off)


class EventQueue:
    """The pools' events in time (Vidur's event queue), each an EventKind: a replica's run
    ending, a request entering a pool (the requests' own arrivals are kept apart, as they come
    in order; hand-offs are events), a replica's plan put off past the arrivals at its time.
    A replica runs ahead, planning and committing, while its runs end by the next event."""

    def __init__(self, arrival):
        self.events, self.order = [], itertools.count()  # (t, kind, order, target, value)
        self.arrival, self.r = arrival, 0  # the requests' arrivals; the next to come

    def push(self, t, kind, target, value=0):
        heapq.heappush(self.events, (t, kind, next(self.order), target, value))

    def horizon(self):
        """When the next event is (math.inf: none)."""
        events, r = self.events, self.r
        t = events[0][0] if events else math.inf
        return min(t, self.arrival[r]) if r < len(self.arrival) else t

    def run_ahead(self, server):
        """Plan and commit the replica's runs while they end by the next event; then queue
        its commit, or its plan where an arrival may come at its clock."""
        while True:
            if server.pending is None:
                if not (server.draining or server.may_plan()) or not server.plan():
                    if server.wake_at is not None:  # (idle while KV loads: woken as it lands)
                        self.push(server.wake_at, PLAN, server, LANDS)
                        server.wake_at = None
                    return
                server.new_version()
            end = server.pending_end()
            if end > self.horizon():
                self.push(end, COMMIT, server, server.version)
                return
            server.commit()
            if not server.draining and server.t >= self.horizon():
                server.plan_queued = True
                self.push(server.t, PLAN, server)
                return

    def enter(self, stage, r, t):
        """Request r enters a stage at t: routed and queued at its replica, whose run may be cut
        short; once the stage's last request is in, its replicas plan again unconditionally
        and drain, as a replica alone is given its requests."""
        if not stage.last:
            stage.ledger.remaining[r] = 1  # (served to its first token)
        server = stage.route(r, t)
        pending = server.pending
        server.arrive(r, t)
        if server.pending is not pending:  # (cut short: the run ends at another time)
            self.push(server.pending_end(), COMMIT, server, server.new_version())
        elif server.wake(t):  # (idle: it plans from t)
            self.push(t, PLAN, server)
        if not stage.left:
            for server in stage.servers:
                server.drain()
                self.run_ahead(server)

    def run(self, first, progress):
        """Every event in time order, the requests' arrivals entering the first stage."""
        events, arrival, n, clock = self.events, self.arrival, len(self.arrival), time.perf_counter()
        while self.r < n or events:
            r = self.r
            if r < n and (not events or events[0][0] > arrival[r] or
                          events[0][0] == arrival[r] and events[0][1] >= ARRIVE):
                self.r += 1  # (an arrival before a hand-off at its time)
                self.enter(first, r, arrival[r])
                if progress and not r % 8192 and time.perf_counter() - clock > 10:
                    clock = time.perf_counter()
                    progress(f"{r:,} / {n:,} requests routed, {arrival[r]:,.1f} s simulated")
                continue
            t, kind, _, target, value = heapq.heappop(events)
            if kind == ARRIVE:  # (target: a stage; value: the request)
                self.enter(target, value, t)
            elif kind == PLAN:
                if value == LANDS:  # (KV lands at an idle replica: it plans from t)
                    if target.wake(t):
                        target.plan_queued = False
                        self.run_ahead(target)
                elif target.plan_queued:
                    target.plan_queued = False
                    self.run_ahead(target)
            elif kind == SENT:  # (target: a KVSends)
                target.sent(t, value)
            elif value == target.version:  # (else stale: the run was cut short since)
                target.commit()
                if target.draining or target.t < self.horizon():
                    self.run_ahead(target)
                else:
                    target.plan_queued = True
                    self.push(target.t, PLAN, target)
