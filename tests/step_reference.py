"""The serving simulation one step at a time: the plain rules the event loop computes in closed
form between events. Nothing here is shared with the loop but the step prices (StepCosts.rates),
the budget's numbers and a speculating decoder's drawn steps (Speculation.steps_for); test_step_reference.py holds the loop to it on random small cases."""
import heapq
import math

import numpy as np

from nn40.speculative import verify_steps


def simulate_steps(req, replica):
    """-> {"start", "first_token", "finish", "first_step", "finish_step", "steps", and with a
    KV budget "preemptions", "max_alloc", "peak_running", "held_s", "alloc_s"}, per request."""
    kv, costs, n = replica.kv, replica.costs, len(req.output)
    runs, gains = replica.decode_tokens  # a decoder's tokens a step: run, and gained
    spec = replica.speculation  # (speculating: each decoder's verify steps drawn, see join)
    prices, draft = costs, None
    first = 0  # tokens a prompt's last chunk allocates beyond its prompt: speculating, the
    # drafts' slots its first verify step writes (its first token's KV the next step writes)
    if spec is not None:
        runs, drawn = spec.k + 1, spec.steps_for(req.output)
        prices, draft = costs.verify, costs.draft
        first += spec.lookahead
        redraw = np.random.default_rng(spec.seed + 1)
    prompt, output = req.prompt.tolist(), req.output.tolist()
    cached0 = [0] * n if req.cached is None else req.cached.tolist()
    chunk = replica.chunk_tokens if replica.scheduler == "chunked" else math.inf
    block = kv.block_tokens if kv and kv.policy == "paged" else 1
    cap = kv.capacity_tokens if kv else math.inf
    mark = int(kv.watermark * (cap // block)) * block if kv and kv.policy == "paged" else 0
    rank = replica.order.rank if replica.order and replica.order.rank else list(range(n))
    out = {k: [math.nan] * n for k in ("start", "first_token", "finish")}
    out.update(first_step=[0] * n, finish_step=[0] * n, steps=0, preemptions=0, max_alloc=0,
               peak_running=0, held_s=0.0, alloc_s=0.0, chunks=[0] * n)
    to_prefill, remaining, retry, waiting = list(prompt), list(output), [], list(range(n))
    run, t, admitted = [], 0.0, 0  # run: [admitted, id, prompt left, cached, to emit, and
    # speculating: tokens gained a step, steps left, tokens held at its start, KV allocated
    # beyond those written]

    def blocks(x):
        return -(-x // block) * block

    def alloc(rows):  # tokens allocated to rows (after's)
        if kv is None:
            return 0
        if kv.policy == "reserve":
            return sum(prompt[r] + kv.max_output for r, _, _, _ in rows)
        return sum(blocks(x + ahead) if fluid is None else x + fluid
                   for _, x, fluid, ahead in rows)

    def join(s):  # a speculating decoder starts: its steps, drawn, and its rate
        n = s[4]
        steps = drawn[s[1]] if n == output[s[1]] - 1 else \
            int(verify_steps(np.array([n]), spec.rates, redraw)[0])
        steps = max(int(steps), 1)
        written = s[3] - 1  # (its newest token's KV not yet)
        beyond = blocks(written + spec.lookahead) - written if kv and kv.policy == "paged" \
            else 0
        s[5:] = [n / steps, steps, s[3], beyond]

    def schedule():  # [(row, chunk)]: prompts oldest first, in the room decodes leave
        room, plan = chunk - sum(runs for s in run if not s[2]), []
        for s in run:
            if s[2] and room > 0:
                plan.append((s, min(s[2], room)))
                room -= plan[-1][1]
        return plan

    def after(plan):  # [(id, tokens written after the planned step (a decoder's newest not
        # yet), a speculating decoder's KV beyond them or None, and else the tokens allocated
        # beyond them: a prompt's last chunk's drafts' slots)]
        chunks = {id(s): c for s, c in plan}
        return [(s[1], s[3] + (gains if len(s) == 5 else s[5]) - 1,
                 None if len(s) == 5 else s[8], 0) if not s[2] else
                (s[1], s[3] + chunks.get(id(s), 0), None, (chunks.get(id(s)) == s[2]) * first)
                for s in run]

    while waiting or retry or run:
        assert out["steps"] < 10**5, "stalled"
        taken = alloc(after(schedule()))
        while run and taken > cap:  # preempt the newest
            s = run.pop()
            if len(s) > 5:  # a speculating decoder keeps the whole tokens it emitted
                s[4] -= min(int(s[3] - s[7] + 1e-9), s[4] - 1)
            to_prefill[s[1]] = prompt[s[1]] + output[s[1]] - s[4]
            remaining[s[1]], cached0[s[1]] = s[4], 0
            out["preemptions"] += 1
            heapq.heappush(retry, s[1])
            taken = alloc(after(schedule()))
        if not run and not retry and not any(req.arrival_s[r] <= t for r in waiting):
            t = max(t, min(req.arrival_s[r] for r in waiting))
        room, closed = cap - taken, bool(run) and replica.scheduler == "static"
        while not closed and len(run) < replica.slots:
            spare = chunk - sum(runs for s in run if not s[2]) - sum(s[2] for s in run)
            came = [r for r in waiting if req.arrival_s[r] <= t]
            r = retry[0] if retry else min(came, key=rank.__getitem__) if came else None
            if r is None or spare <= 0:
                break
            c, left = cached0[r], to_prefill[r] - cached0[r]
            need = (0 if kv is None else prompt[r] + kv.max_output if kv.policy == "reserve"
                    else blocks(c + left + first) if mark else
                    blocks(c + min(left, spare) + (min(left, spare) == left) * first))
            if need + mark > room:
                break
            (heapq.heappop(retry) if retry else waiting.remove(r))
            out["start"][r] = t if out["start"][r] != out["start"][r] else out["start"][r]
            run.append([admitted, r, left, c, remaining[r]])
            if spec is not None and not left:
                join(run[-1])
            admitted, room = admitted + 1, room - need
        plan, decoders = schedule(), [s for s in run if not s[2]]
        tokens, pre = sum(c for _, c in plan), sum(s[3] for s, _ in plan)
        pairs = sum(c * s[3] + c * (c + 1) // 2 for s, c in plan)
        dec = sum(s[3] for s in decoders)
        if replica.fused and tokens and decoders:
            f, kv_s = prices.rates(tokens + runs * len(decoders))
            step_s = f + kv_s * (pre + dec) + prices.pair_s * pairs
        else:
            step_s = prices.pass_s(tokens, pre, pairs) + prices.pass_s(runs * len(decoders), dec)
        if draft is not None and decoders:  # (the draft's k passes at the batch)
            step_s += spec.k * draft.pass_s(len(decoders), dec)
        held_after = after(plan)
        out["peak_running"] = max(out["peak_running"], len(run))
        out["max_alloc"] = max(out["max_alloc"], alloc(held_after))
        out["held_s"] += step_s * sum(x for _, x, _, _ in held_after)
        out["alloc_s"] += step_s * alloc(held_after)
        t, out["steps"] = t + step_s, out["steps"] + 1
        for s in decoders:  # (its last step emits what is left)
            if len(s) > 5:
                s[3], s[6] = s[3] + s[5], s[6] - 1
                out["chunks"][s[1]] += 1  # (a verify step: one chunk of its stream)
                s[4] = s[4] if s[6] else 0
            else:
                s[3], s[4] = s[3] + gains, max(s[4] - gains, 0)
        for s, c in plan:
            s[2], s[3] = s[2] - c, s[3] + c
            if not s[2]:  # its prefill ends: its first token
                s[3], s[4] = s[3] + 1, s[4] - 1
                if out["first_token"][s[1]] != out["first_token"][s[1]]:
                    out["first_token"][s[1]], out["first_step"][s[1]] = t, out["steps"]
                else:  # (a preempted request's prefill again: its token a chunk)
                    out["chunks"][s[1]] += 1
                if spec is not None and s[4]:
                    join(s)
        for s in [s for s in run if not s[2] and not s[4]]:
            run.remove(s)
            out["finish"][s[1]], out["finish_step"][s[1]] = t, out["steps"]
    return out
