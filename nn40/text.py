"""Every string the run prints, in English: the --help's usage, description and epilog, and
TEXT_EN, the messages, table headers and notes by key (text_ko.py holds the same in Korean)
"""


# --help (in English alone, as argparse writes the rest of it)
USAGE = "NN_40_serving.py [--quick] [--experiments ABCD] [--model NAME] [--gpu CARD] [flags]"

DESCRIPTION = """\
Measures the post's three claims on this machine, then checks its simulation:
  A  decode batch sweep   decode is bound by reading the weights, so batching is nearly free
  B  prefill vs decode    prefill is bound by arithmetic, decode far below it
  C  static vs continuous continuous batching fills the seats static batching leaves empty
                          (a pure simulation in seconds; the capacity planner)
  D  a real engine        both policies run on the model, against C's prediction
vLLM's flag names work too: --request-rate, --num-prompts, --max-num-seqs, --goodput, ..."""

EPILOG = """\
recipes:
  NN_40_serving.py --quick                       a smoke run of A-D (about 15 s on a CPU)
  NN_40_serving.py --experiments C               the simulation alone (touches no device)
  NN_40_serving.py --model llama-3-8b --gpu h100 --request-rate 20 --target-rate 20 \\
      --goodput ttft:1000 --slo-attainment p99   H100s for 20 requests/s at p99 TTFT < 1 s
  NN_40_serving.py --model-config config.json --gpu a100-80gb --experiments C   your model
  NN_40_serving.py --trace trace.csv --rate trace --experiments C       replay a trace
  NN_40_serving.py --model llama-3.1-70b --gpu h100 --tensor-parallel-size 4 --weights fp8 \\
      --kv-cache-dtype fp8 --experiments C       tensor parallel, FP8 weights and KV cache"""


SHARED_TEXT = {  # the same in every language: units, acronyms, names
    "cuda": ", CUDA {cuda}", "gbs": "GB/s", "mbu": "MBU", "mfu": "MFU",
    "metric_ttft": "TTFT", "metric_tpot": "TPOT", "metric_e2e": "E2E", "metric_itl": "ITL",
    "stat_p50": "p50",
    "stat_p90": "p90", "stat_p99": "p99", "unit_ms": "ms",
    "source_file": "{path}", "memory_flag": "--kv-memory-gb",
    "memory_tokens": "--kv-tokens {tokens:,}",
}

TEXT_EN = {**SHARED_TEXT,
    # banner
    "command": "command: {command}", "device": "device: {device}",
    "threads": ", {threads} torch threads",
    "experts_line": "mixture of experts: {experts} experts a layer ({experts_per_token} a token, "
                    "{shared_experts} shared), each {width:,} wide; the first {dense_layers} "
                    "layers dense",
    "expert_skew": "; routed with skew {expert_skew:g} (expert i drawn as i^-{expert_skew:g})",
    "model": "model: {label}: {layers} layers, hidden {hidden}, {heads} heads{kv}, "
             "{mlp_text} MLP of {ffn:,}, vocab {vocab:,}, {dtype}: {params:,.1f} M "
             "parameters, {gib:.2f} GiB",
    "label_post": "the post's", "kv_heads": " ({n} K/V heads)", "mlp_gelu": "GELU",
    "mlp_gated": "gated SiLU",
    "card": "card: {tp} x {name} ({bandwidth:,.0f} GB/s, {tflops:,.1f} TFLOP/s dense FP16/BF16, "
            "{memory:g} GB by its spec sheet, {link}); C prices it by the {profile} profile "
            "({bandwidth_share:.0%} of its bandwidth, up to {matmul_share:.0%} of its FLOP/s)",
    "card_ep": "; each replica one card of {ep} that spread the experts between them "
               "(attention data-parallel, two all-to-alls an MoE layer)",
    "slow_cpu": "note: {name} runs at its own size on this CPU ({gib:.1f} GiB of weights, all "
                "read at every decode step): expect minutes per experiment; --experiments C "
                "prices it without running it",
    "model_post": "model: the post's proxy, {layers} square {hidden} x {hidden} {dtype} "
                  "matmuls per token (no attention, KV cache, norms, embeddings or LM "
                  "head): {params:,.1f} M parameters, {gib:.2f} GiB",
    "preset": "CPU preset (the post's model would take minutes per experiment): {fields}",
    "dtype_probe": "dtype: {chosen}, the fastest here by a probe (F.linear at the run's "
                   "{rows} rows, {rounds} rounds with the types in turn; time against "
                   "float32's, weighted as the run spends it: {ratios}; {margin}; a 2-byte "
                   "type unless float32 is {preference:g}x faster); --dtype to choose",
    "probe_ratio": "{dtype} {median:.2f}x (p10-p90 {p10:.2f}-{p90:.2f})",
    "probe_dropped": "{dtype} out (over 4x the best at a shape)",
    "probe_margin": "the next choice {margin:.2f}x behind", "probe_alone": "no other choice",
    "probe_tied": "tied within {noise:.0%} with {types} (a fixed order decides)",
    "layout_linear": "matmuls: F.linear at every row count, W x^T no faster by more than the "
                     "noise (a probe, ms at {counts} rows: F.linear {linear}; W x^T {first})",
    "layout_probe": "matmuls: W x^T up to {rows} rows, F.linear beyond (a probe, ms at {counts} "
                    "rows: F.linear {linear}; W x^T {first})",
    "ceilings": "ceilings: {bandwidth:,.1f} GB/s ({bandwidth_source}), {tflops:.2f} TFLOP/s "
                "({matmul_source}); ridge {ridge} FLOP/byte",
    "cpu_graphs": "  (CPU: eager only; CUDA graphs need CUDA)",
    "given": "given", "measured_copy": "measured: copy of {gib:.2f} GiB",
    "measured_matmul": "measured: {n}x{n}x{n} {dtype} matmul",
    "does_not_fit": "does not fit: needs {needed_gib:.2f} GiB, {free_gib:.2f} GiB free",
    # A and B
    "A": "A  decode batch sweep (context {context} tokens)",
    "A_post": "A  decode batch sweep (the post's proxy: no KV cache)",
    "A_contexts": "A  where the KV cache takes over: decode step ms ({mode})",
    "ctx_ms": "ctx {context}: ms",
    "crossover": "KV-cache reads exceed weight reads from batch {batches}",
    "crossover_at": "{batch} at context {context}",
    "B": "B  prefill vs decode", "row": "one step",
    "prefill": "prefill ({tokens} tokens)", "decode": "decode (batch {batch})",
    "mode": "mode", "batch": "batch", "step_ms": "step ms (= wait)",
    "tokens_per_s": "tokens/s", "throughput_vs_1": "throughput vs 1", "wait_vs_1": "wait vs 1",
    "experts_touched": "experts read", "experts_expected": "experts expected",
    "dense_twin_ms": "dense twin ms", "bytes_vs_1": "bytes vs 1",
    "us_per_token": "µs / token", "tflops": "TFLOP/s", "intensity": "FLOP/byte",
    "bound": "bound",
    "eager": "eager", "graph": "graph", "memory": "memory", "compute": "compute",
    "launch": "launch", "graph_failed": "eager (graph failed)",
    "above_ceiling": "> ceiling",
    "few_reps": "* timed fewer than 5 times: one call took over a fifth of the {budget:g} s "
                "each shape is given",
    "above_ceiling_note": "> ceiling: the step ran faster than a measured ceiling allows, "
                          "so that ceiling (measured at one shape) or the step's accounting "
                          "is wrong for it; its share is not printed",
    "launch_note": "launch: under {share:.0%} of both ceilings, bound by kernel launches and "
                   "host work, not by memory or arithmetic",
    "overhead": "overhead",
    "overhead_note": "overhead: under {share:.0%} of both ceilings, bound by neither memory "
                     "nor arithmetic: the CPU's matmul library is far from its best at this "
                     "shape, or host work dominates",
    "kernels": "attention kernels: {kernels} (allowed: {backends}; none that plans each new "
               "shape)",
    "view_too_large": "skipped: a K/V view of {elements:,} elements, past {limit:,} (32-bit "
                      "offsets)",
    "out_of_memory": "skipped: out of memory ({error})",
    "chain": "bare F.linear chain over the same {mb:,.0f} MB of weights ({mode}, batch 1): "
             "{ms:.3f} ms, {gbs:.1f} GB/s",
    "chain_decode": "; decode at batch 1 moves {gbs:.1f} GB/s = {share:.0%} of it",
    # C: the post's table
    "C": "C  static vs continuous batching ({requests} requests, {slots} slots)",
    "policy": "policy", "steps": "total steps", "occupancy": "slot occupancy",
    "static": "static batching", "continuous": "continuous batching",
    "chunked": "chunked prefill", "speedup": "speedup",
    "lengths": "{speedup}: {value:.2f}x   (lengths: median {median:.0f}, mean {mean:.1f}, "
               "max {max:,})",
    "spread": "over {seeds} seeds of the same law, p50 (p10-p90): static {static}, "
              "continuous {continuous}, speedup {speedup}",
    "times": "x",
    # C in seconds
    "C_seconds": "C  in seconds: {requests:,} requests ({source}), {slots} slots, "
                 "arrivals {arrivals}",
    "step_costs": "   step costs: {pricing}",
    "source_law": "the post's law: floor(e^N({mu:g}, {sigma:g}^2)) <= {max:,}, seed {seed}",
    "source_trace": "trace {name}", "arrivals_zero": "all at t=0",
    "arrivals_trace": "the trace's timestamps",
    "arrivals_poisson": "Poisson at {rate:g} requests/s",
    "arrivals_gamma": "gamma gaps, burstiness {burstiness:g}, at {rate:g} requests/s",
    "pricing_analytic": "analytic roofline ({bandwidth_gbs:,.0f} GB/s, {tflops:.3g} "
                        "TFLOP/s, {layers}x{hidden} {dtype})",
    "pricing_card": "the {card}'s spec priced by the {profile} profile ({bandwidth_share:.0%} "
                    "of its bandwidth, up to {matmul_share:.0%} of its FLOP/s, {step_us:.0f} "
                    "us a pass and {layer_us:.0f} us a layer), {model} with {weights} weights and a {kv_dtype} KV cache on "
                    "{tp} card(s)",
    "pricing_measured": "measured on {device} ({mode})",
    "pricing_stages": "{stages}, as {pp} pipeline stages (a micro-batch in flight on each)",
    "pricing_engine": "measured for D on {device} (means)",
    "seconds": "seconds", "req_s": "req/s", "goodput": "goodput req/s",
    "simulations": "{runs} simulations (these, the KV study's, who waits and the rate "
                   "sweep's): "
                   "{iterations:,} loop iterations in {seconds:,.2f} s ({rate:,.0f} per "
                   "second), {wall:,.2f} s of wall time on {jobs} worker processes",
    # C: the orders of the queue, and who waits
    "orders_steps": "C  the same table in each order of the queue (all {requests} waiting "
                    "at t=0; finish: the step at which a request ends)",
    "order": "order", "static_steps": "static steps", "static_occ": "static occupancy",
    "static_finish": "static mean finish", "continuous_steps": "continuous steps",
    "continuous_occ": "continuous occupancy", "continuous_finish": "continuous mean finish",
    "continuous_p99": "continuous p99 finish",
    "order_fcfs": "first come, first served", "order_sjf": "shortest first (true lengths)",
    "order_predicted": "shortest predicted first", "order_longest": "longest first",
    "order_sjf_guarded": "shortest first + guard",
    "order_predicted_guarded": "shortest predicted + guard",
    "queue": "   queue: {order}",
    "queue_predicted": " (lengths x e^N(0, {sigma:g}^2): Kendall tau {kendall_tau:.2f})",
    "queue_guard": "; a request that has waited {max_wait_s:g} s goes first",
    "who_waits": "C  who waits: {requests:,} requests through continuous batching, {slots} "
                 "slots, arrivals {arrivals}, KV cache: {kv}",
    "who_waits_kv_none": "unlimited (no policy fits every request)",
    "who_waits_setup": "   predicted lengths: true x e^N(0, {sigma:g}^2), Kendall tau "
                       "{tau:.2f}; guard: a request that has waited {guard:,.3g} s goes "
                       "first ({source})",
    "guard_flag": "--max-wait-s", "guard_fcfs": "FCFS's 99th-percentile wait",
    "stat_mean": "mean", "unit_s": "s",
    "per_token_ms": "ms per output token", "longest_wait": "longest wait s",
    "who_waits_by_length": "C  who waits, by output length (this workload's terciles)",
    "output_tokens": "output tokens", "count": "count",
    "bucket": "{name} {low:,}-{high:,}", "bucket_short": "short", "bucket_medium": "medium",
    "bucket_long": "long",
    "kv_unfit_row": "{policy}: does not fit, so not simulated: {why}",
    "kv_no_memory": "the weights leave no memory for the KV cache",
    "kv_short": "the engine's rule leaves the KV cache nothing: {short_gib:.2f} GiB a card "
                "short; it would fit with {would}",
    "kv_max_output": "--max-output {max_output:,} is below the longest output, {longest:,}",
    "kv_too_long": "request {request:,} alone needs {needs:,} tokens at its longest (prompt "
                   "{prompt:,} + output {output:,} as the policy holds them, in blocks of "
                   "{block:,}), the budget holds {holds:,}",
    # C: replicas and capacity
    "one_share": "   one replica's share of {replicas} (every {replicas}th request, as "
                 "round-robin routes them); the replica table below serves them all",
    "fleet": "C  {replicas} replicas of {slots} slots behind each router: {requests:,} "
             "requests, arrivals {arrivals}, continuous batching, KV cache: {kv}",
    "router": "router", "slo_met": "SLO met", "per_replica": "requests per replica",
    "busiest": "busiest occupancy",
    "capacity": "C  capacity at the SLO ({slo}, for {attainment:.0%} of requests): one "
                "replica serves {rate} requests/s ({tokens:,.0f} output tokens/s); over "
                "{seeds} draws of {requests:,} Poisson arrivals: {low}-{high}",
    "slo_ttft": "TTFT <= {ms:g} ms", "slo_tpot": "TPOT <= {ms:g} ms",
    "capacity_none": "none", "capacity_all": "more than {rate:.3g}",
    "replicas_needed": "C  replicas needed for {rate:g} requests/s at that SLO ({requests:,} "
                       "Poisson arrivals per count tried)",
    "replicas_col": "replicas", "attained_col": "SLO met at that count",
    "below_col": "with one fewer", "too_many": "more than {n:,}",
    "router_plain": "{router}, no prefix caching",
    "answer": "answer: {replicas} ({gpus}), with {router}{tie}",
    "warn_moved": "warning: the machine's speed moved during this run: its ceilings, measured "
                  "again at the end, went from {bandwidth:,.1f} to {bandwidth_end:,.1f} GB/s "
                  "({bandwidth_moved:+.0%}) and from {tflops:.3g} to {tflops_end:.3g} TFLOP/s "
                  "({tflops_moved:+.0%}), more than {share:.0%}: something else was running. "
                  "A's, B's and D's times are suspect: re-run on a quiet machine, or give "
                  "--peak-bandwidth-gbs and --peak-tflops",
    "warn_busy": "warning: the machine was busy while {stages} ran: other processes used "
                 "{others:.0%} of its {cpus} CPUs{steal}, so what was measured then is slower "
                 "and noisier than this machine's own: close what else runs (a browser, a "
                 "build) and run again",
    "busy_steal": " and the hypervisor took {steal:.0%}",
    "note_load": "note: this system gives no machine-wide CPU times (no /proc/stat), so "
                 "whether other programs slowed {stages} is not known",
    "warn_ridge": "warning: the ridge is {ridge:.2g} FLOP/byte, under {least:g}: the matmul "
                  "ceiling ran slower than a copy of its bytes, which no idle CPU or GPU does, "
                  "so the bound column is wrong: re-run --experiments AB on a quiet machine, "
                  "or give --peak-tflops",
    "warn_above": "warning: {shares} over 100% in {rows} of A's and B's rows: a ceiling was "
                  "measured while the machine was slower than when the steps ran: re-run "
                  "--experiments AB on a quiet machine, or give --peak-bandwidth-gbs and "
                  "--peak-tflops",
    "warn_engine": "warning: the machine's speed moved while D ran: {bandwidth:,.1f} to "
                   "{bandwidth_end:,.1f} GB/s ({bandwidth_moved:+.0%}), {tflops:.3g} to "
                   "{tflops_end:.3g} TFLOP/s ({tflops_moved:+.0%}): D's verdict compares a run "
                   "with prices timed on a machine of another speed: re-run --experiments D on "
                   "a quiet machine",
    "verdict_machine_held": "the machine's speed held around D: ceilings {bandwidth_moved:+.0%} "
                            "(bandwidth) and {tflops_moved:+.0%} (matmul) from before its "
                            "pricing to after its run (a move: both past {share:.0%} one way, "
                            "or one past {alone:.0%})",
    "verdict_machine_moved": "the machine's speed moved between D's pricing and its run: "
                             "ceilings {bandwidth_moved:+.0%} (bandwidth) and {tflops_moved:+.0%}"
                             " (matmul), past {share:.0%}: the verdict is the machine's, not C's",
    "summary": "in short, as measured in this run:",
    "summary_decode": "  1. decode is bound by bytes, so batching is nearly free: batch {batch} "
                      "decodes {throughput:.1f}x batch 1's tokens/s for {wait:.2f}x its wait "
                      "(batch 1: {bound}-bound{turn})",
    "summary_decode_not": "  1. decode did not batch nearly free here, as the post has it: "
                          "batch {batch} decodes {throughput:.1f}x batch 1's tokens/s for "
                          "{wait:.2f}x its wait (batch 1: {bound}-bound{turn})",
    "summary_turn": "; compute-bound from batch {batch}",
    "summary_prefill": "  2. prefill is bound by arithmetic: {tokens:,} prompt tokens at "
                       "{intensity:.0f} FLOP/byte ({bound}-bound) ran {ratio:.0f}x the FLOP/s "
                       "of decode at batch 1 ({decode:.1f} FLOP/byte)",
    "summary_prefill_not": "  2. prefill was not bound by arithmetic here, as the post has "
                           "it: {tokens:,} prompt tokens at {intensity:.0f} FLOP/byte, under "
                           "this machine's ridge of {ridge} ({bound}-bound), ran {ratio:.0f}x "
                           "the FLOP/s of decode at batch 1 ({decode:.1f} FLOP/byte)",
    "summary_batching_not": "  3. continuous batching was not ahead here, as the post has it: "
                            "{continuous:.0%} of slot-steps filled against static's "
                            "{static:.0%}, {speedup:.2f}x the steps{engine}",
    "summary_batching": "  3. continuous batching fills the seats static batching leaves "
                        "empty: {continuous:.0%} of slot-steps filled against {static:.0%}, "
                        "{speedup:.2f}x fewer steps{engine}",
    "summary_engine": "; a real engine here {measured:.2f}x faster (C predicted {predicted:.2f}x)",
    "noun_replica": "{n:,} replica|{n:,} replicas", "noun_gpu": "{n:,} GPU|{n:,} GPUs",
    "answer_one": "answer: one replica of {model} on {card} serves {one} requests/s with "
                  "{slo} for {attainment:.0%} of requests",
    "answer_fleet": "answer: {rate:g} requests/s of {model} with {slo} for {attainment:.0%} "
                    "of requests need {replicas} ({gpus}) on {card}, routed {router} (one "
                    "replica serves {one} requests/s)",
    "answer_fleet_none": "answer: no count up to {n:,} replicas of {model} on {card} serves "
                         "{rate:g} requests/s with {slo} for {attainment:.0%} of requests",
    "answer_assumes": "  assuming {arrivals}; prompts of {prompt:,.0f} tokens and outputs of "
                      "median {output:,.0f}, max {longest:,} ({source}); {limits}; "
                      "continuous batching, {kv} KV cache (details below)",
    "serving_limits": "{slots:,} sequences a replica and {chunk:,} tokens a step ({source})",
    "limits_post": "the post's, as its table", "limits_flag": "the flags'",
    "limits_profile": "the engine profile's", "limits_flag_too": ", and a flag's",
    "limits_logged": "the logged run's own, as its meta.json says",
    "limits_logged_too": ", and the logged run's",
    "limits_vllm_large": "vllm serve's defaults on a card of 70 GiB or more",
    "limits_vllm_small": "vllm serve's defaults on a card under 70 GiB or an A100",
    "limits_sglang": "SGLang's defaults for the card",
    "limits_sglang_drafting": "SGLang's defaults for the card, 48 running while it speculates",
    "answer_arrivals_poisson": "Poisson arrivals", "answer_post": "the post's model",
    "answer_arrivals_gamma": "gamma arrivals of shape {burstiness:g}",
    "answer_tie": " (as few as any router needs)",
    "answer_none": "answer: no count up to {n:,} replicas serves it",
    # C: the KV cache
    "vllm_short_context": "C  vllm serve would not start here at the model's full "
                          "{context:,}-token context (its default --max-model-len: one request "
                          "that long must fit the cache), as the cache holds {tokens:,} tokens: "
                          "start it with --max-model-len {tokens:,} or less; C serves these "
                          "requests as it would then",
    "vllm_short_max_model_len": "C  vllm serve would not start here at the logged run's "
                                "--max-model-len {context:,} (one request that long must fit "
                                "the cache), as the cache holds {tokens:,} tokens; C serves "
                                "these requests as if it had",
    "kv": "C  KV cache: {gb:,.2f} GB ({memory_source}) = {tokens:,} tokens of {bytes:,} "
          "bytes; reserve: prompt + {max_output:,} output tokens each; paged: blocks of "
          "{block}{admission}",
    "admit_watermark": ", admitted when the prompt's blocks fit and {share:.0%} stay free",
    "admit_naive": ", admitted when the first step's blocks fit",
    "memory_logged": "{tokens:,} tokens, the logged run's own (its meta.json)",
    "memory_cpu": "the CPU default",
    "memory_card": "{fraction:g} x ({total_gb:.1f} GB of each of {tp} x {card} less its "
                   "{weights_gib:.2f} GiB of weights and {reserved_gb:g} GB reserved)",
    "memory_vllm": "vLLM's rule on each of {tp} x {card}, {total_gib:.2f} GiB as the driver "
                   "reports it ({sold_gb:g} GB sold): {fraction:g} x {total_gib:.2f} GiB "
                   "less {weights_gib:.2f} GiB of weights, {activation_gib:.2f} GiB of "
                   "activations at {tokens:,} tokens a step and {seqs:,} sequences, and "
                   "{non_torch_gib:.2f} GiB outside torch = {kv_gib:.2f} GiB",
    "memory_sglang": "SGLang's rule on each of {tp} x {card}, {total_gib:.2f} GiB as the "
                     "driver reports it ({sold_gb:g} GB sold): mem_fraction_static "
                     "{fraction:g} x ({total_gib:.2f} GiB less {context_gib:.2f} GiB of CUDA "
                     "context) less {weights_gib:.2f} GiB of weights = {kv_gib:.2f} GiB",
    "memory_cuda": "{fraction:g} x {total_gib:.2f} GiB of {device} less {weights_gib:.2f} "
                   "GiB of weights",
    "memory_reference": "the post's RTX 5080: {fraction:g} x {total_gb:g} GB less "
                        "{weights_gib:.2f} GiB of weights",
    "allocation": "allocation", "reserve": "reserve", "paged": "paged",
    "prefix": "paged + prefix cache", "radix": "radix cache",
    "queried": "prompt tokens", "hit_card": "hit",
    "hit_host": "hit in host", "hit_disk": "hit on disk", "load_wait": "s waited for loads",
    "prefill_computed": "prefilled", "prefill_saved": "not prefilled",
    "evicted": "blocks evicted", "found_cached": "its prompt found cached",
    "prefix_cache": "Prefix cache (paged blocks that keep what they computed; {host}): prompt "
                    "tokens looked up at admission and the share found cached, per tier",
    "prefix_host": "a {write} host tier of {gb:,.1f} GB ({tokens:,} tokens) over {link} at "
                   "{gbs:g} GB/s, {share:.0%} of it a load's",
    "prefix_no_host": "no host tier",
    "prefix_disk": "; below it a {write} disk tier of {gb:,.1f} GB ({tokens:,} tokens) read at "
                   "{gbs:g} GB/s",
    "prefix_prefetch": ", each read starting as its request arrives",
    "prefix_by_hit": "TTFT by the share of its prompt a request found cached at admission:",
    "hit_none": "none", "hit_some": "up to half", "hit_most": "over half",
    "wait_p99": "queued p99 s", "tier": "cache", "capacity_col": "card tokens",
    "tier_card": "card", "tier_card_host": "card + host", "tier_unlimited": "unlimited",
    "tier_card_host_disk": "card + host + disk",
    "prefix_study_disk": "; below the host tier a disk tier of {tokens:,} tokens",
    "tier_optimum": "one at a time", "unlimited": "unlimited",
    "prefix_study": "Prefix cache against its capacity (continuous batching; shares of the card's "
                    "budget of {tokens:,} tokens, from 1/64 to 4x; the host tier {host:,} tokens "
                    "over {link} at {gbs:g} GB/s; one at a time: unlimited, each request served "
                    "alone, the workload's own optimum): the share of prompt tokens found cached "
                    "per tier, and TTFT",
    "prefix_capacity": "One replica at the SLO: {cached:,.3g} requests/s with prefix caching, "
                       "{plain:,.3g} without.",
    "spec_head": "C  speculative decoding: {method}, {k} draft token(s) a step, accepted by "
                 "position {rates} ({law}): {length:.2f} tokens a verify step; {draft}; "
                 "{lookahead} KV tokens a request beyond its own (the drafts verified, and "
                 "vLLM's lookahead); KV cache: {kv}",
    "spec_law_rates": "as given", "spec_law_rate": "one rate given, each position its power",
    "spec_law_length": "a mean length given, one rate fitted to it",
    "spec_law_default": "the method's default: {source}",
    "spec_draft": "the drafts by {model}, {k} pass(es) a step on the same card(s)",
    "spec_no_draft": "the drafts looked up in the request's own text (on the CPU: not priced)",
    "spec_memory": "The draft beside the model on each card: {weights:.2f} GiB of its own "
                   "weights and {kv:,.0f} bytes of KV a token (vLLM keeps them in its cache, "
                   "SGLang in memory it reserves apart); the KV cache holds {spec} tokens where "
                   "plain decoding's holds {plain}.",
    "spec_plain": "plain decoding", "spec_run": "speculating",
    "spec_speedup": "speedup at this load: {x:.2f}x (TPOT p50, plain over speculating)",
    "spec_nothing": "No request decodes past its first token (the prefill emits it): nothing "
                    "to speculate.",
    "spec_by_concurrency": "The speedup by concurrency (TPOT p50, plain over speculating, with k drafts a "
                  "step; that many requests in flight, all waiting at t=0, as a benchmark's "
                  "clients keep them):",
    "spec_concurrency": "concurrency", "spec_plain_tpot": "plain TPOT p50 ms",
    "spec_k": "k={k}", "spec_best": "best k",
    "spec_crossover": "where speculation stops paying: {each}",
    "spec_pays": "pays at every concurrency", "spec_below_at": "below 1x from {load}",
    "capacity_spec": "Speculating ({method}, k={k}): one replica serves {rate} requests/s at the "
                     "SLO{fleet}.",
    "capacity_spec_fleet": "; the target rate needs {replicas} ({gpus}) behind {router}",
    "capacity_spec_none": "; no fleet of up to {n:,} replicas serves the target rate",
    "capacity_spec_only": "  (speculating: {method}, k={k}; without speculation no arrival rate "
                          "meets the SLO on one replica)",
    "capacity_spec_misses": "Speculating ({method}, k={k}): no arrival rate meets the SLO on one "
                            "replica.",
    "concurrency": "requests peak / mean", "kv_used": "KV used", "never_used": "never used",
    "max_allocated": "max allocated", "preempted": "preempted", "recomputed": "recomputed",
    "check_shape": "{rows:,} rows x {tokens:,} tokens = {gb:.2f} GB",
    "check": "on {device}: allocated the budget's KV cache as {shape} and ran a decode step "
             "of the peak's {batch} requests at their contexts (max {max_context:,}"
             "{clamped}): {ms:.1f} ms",
    "check_clamped": ", {n} clamped to the row",
    "check_skipped": "on {device}: the budget's KV cache ({shape}) {reason}",
    # D
    "D": "D  a real engine on the model: {requests} requests ({source}: median output "
         "{median:.0f}, max {max:,}), prompts of {prompt} tokens, {slots} slots, greedy; "
         "queue: {order}; arrivals {arrivals}",
    "D_source": "the post's law", "D_source_shrunk": "the post's law, outputs / {shrink}",
    "D_prefix_label": "continuous + prefix cache",
    "D_prefix": "prefix caching: the continuous run again, its prompts' K/V kept in blocks as "
                "vLLM's block pool keeps them (system prompts of {prefix_tokens} tokens): "
                "{hit_tokens:,} of {prompt_tokens:,} prompt tokens found cached (C's PrefixCache: "
                "{hit_simulated:,}; each request's hit as C's: "
                "{hits_agree} of {requests}); greedy tokens identical to "
                "the run without: {identical}; steps as C's: {steps}; time saved {saved_s:,.2f} s "
                "measured, {saved_predicted_s:,.2f} s predicted",
    "D_spec_label": "continuous + speculating",
    "D_spec": "speculative decoding: the continuous run again, each decoder verifying its last "
              "token and {k} random drafts in one pass, accepting as C draws for the same "
              "request (vLLM's synthetic acceptance: rates {rates}, E = {expected_length:.2f} "
              "tokens a step; {emitted_per_step:.2f} emitted); steps as C's: {steps}; speedup "
              "over the continuous run {measured:.2f}x measured, {predicted:.2f}x predicted",
    "D_pool": "block pool: the continuous run on {tokens:,} tokens of paged blocks (--kv-tokens), "
              "caching nothing, as vLLM without prefix caching: preempted {preemptions:,} "
              "times (C's paged blocks: {preemptions_simulated:,})",
    "D_prefix_preempted": "; preempted {preemptions:,} times (C: {preemptions_simulated:,}), "
                          "their own K/V found again on return {readmitted_hit_tokens:,} tokens "
                          "(C: {readmitted_hit_tokens_simulated:,})",
    "D_prefix_within": " ({off:+.0%}): within {tolerance:.0%}",
    "D_prefix_outside": " ({off:+.0%}): outside {tolerance:.0%}",
    "D_cpu": "   on CPU, D serves the post's law shrunk: a CPU's decode step stays flat in the "
             "batch only to about 8 rows (a GPU's past 100), and shorter outputs keep the "
             "run short (--engine-requests, --engine-slots, --engine-shrink)",
    "D_bound": "   both runs priced at {priced_s:,.0f} s with the step costs timed beforehand, "
               "past D's bound of {bound_s:.0f} s: outputs divided by {shrunk_by} more "
               "({priced_shrunk_s:,.0f} s)",
    "D_requests": "D  request by request: C's simulation of the same requests, priced with "
                  "the run's own passes and with the step costs timed beforehand",
    "latency": "latency", "measured_col": "measured", "passes_col": "own passes",
    "priced_col": "timed beforehand", "off_col": "off",
    "lat_makespan_s": "makespan", "lat_ttft_p50_s": "TTFT p50", "lat_ttft_p90_s": "TTFT p90",
    "lat_e2e_p50_s": "E2E p50", "lat_e2e_p90_s": "E2E p90",
    "D_steps": "steps: {static} requests (static) and {continuous} (continuous) emit their "
               "first token and their last at the same step in the engine and in C's "
               "simulation",
    "D_steps_spec": "; speculating: {speculative}",
    "D_steps_count": "{agree} of {requests}",
    "D_steps_mismatch": "; the first that differs: request {request} ({policy}), first token "
                        "and finish at steps {engine} in the engine, {simulated} simulated",
    "D_steps_arrivals": "steps: not compared (requests arrive on the wall clock)",
    "D_passes": "the step costs timed beforehand against the engine's {policy} passes: "
                "decode {decode:+.0%} ({n_decode:,} passes), prefill {prefill:+.0%} "
                "({n_prefill:,})",
    "verdict_steps": "verdict: steps exact for every request: {answer}",
    "verdict_prefix": "; the prefix cache's hits (and steps, all waiting at t=0) as C's for every "
                      "request: {answer}",
    "verdict_spec": "; speculation's speedup within {tolerance:.0%} of C's: {answer}",
    "yes": "yes", "no": "no", "not_checked": "not checked (arrivals)",
    "verdict_seconds": "; seconds within {tolerance:.0%}: {passes} of {checked} priced with "
                       "the run's own passes, {priced} of {checked} priced beforehand (worst "
                       "{mode}'s {metric}, {off:+.0%})",
    "D_predicted": "   predicted: C's simulation of the same requests, priced with step "
                   "costs {pricing}",
    "wall_s": "wall s", "predicted_s": "predicted s",
    "prefill_s": "prefill s (meas / pred)", "decode_s": "decode s (meas / pred)",
    "between_s": "between passes s",
    "attention_calls": "attention calls per layer per decode step: static {static:.1f}, "
                       "continuous {continuous:.1f}",
    "attention_spans": " (one per span of rows at one position; continuous is priced with "
                       "decode costs timed with each batch's rows spread over the contexts, "
                       "a span per row)",
    "attention_padded": "; {padded:,} of continuous's {steps:,} decode steps padded to "
                        "their longest row, and priced with decode costs timed padded",
    "verdict": "{speedup}: measured {measured:.2f}x, predicted {predicted:.2f}x ({off:+.0%})",
    "verdict_within": ": within {tolerance:.0%}",
    "verdict_outside": ": outside {tolerance:.0%}; the largest gap is {mode}'s {part}: "
                       "{measured_s:.2f} s measured, {priced_s:.2f} s priced",
    "part_decode": "decode passes", "part_prefill": "prefill passes",
    "part_host": "host work between passes (scheduling, sampling, moving rows), which C "
                 "does not price",
    # --catalog
    "catalog_kv_fraction": "KV tokens that fit in {fraction:g} of the card's memory after the "
                           "weights and {reserved_gb:g} GB",
    "catalog_kv_vllm": "KV tokens that fit by vLLM's rule ({fraction:g} of the card's memory, "
                       "less the weights, the activations at vllm serve's default limits on "
                       "the card and the memory outside torch)",
    "catalog_kv_sglang": "KV tokens that fit by SGLang's rule (its mem_fraction_static for the "
                         "card, less the weights)",
    "catalog_kv_sglang_given": "KV tokens that fit by SGLang's rule (mem_fraction_static "
                               "{fraction:g} of the card's memory, less the weights)",
    "catalog": "every named model on every named card: {kv}; decode steps "
               "priced by the {name} profile ({bandwidth_share:.0%} of the card's bandwidth, "
               "{matmul_share:.0%} of its FLOP/s, {step_us:.0f} us a pass and {layer_us:.0f} us "
               "a layer), each row holding "
               "{context:,} tokens",
    "model_col": "model", "card_col": "card", "weights_gb": "weights GB",
    "kv_per_token": "KV bytes / token", "kv_fit": "KV tokens that fit",
    "crossover_col": "KV reads > weights from batch", "decode_b1": "decode b1 ms",
    "decode_bn": "decode b{batch} ms", "no_fit": "does not fit",
    "engine_run": "C against the engine's own run of these requests (the engine's "
                  "settings: {settings}; C's: {slots} slots, {chunk_tokens} tokens a step, "
                  "{kv_tokens} KV tokens, arrivals: {rate})",
    "engine_measured": "engine (measured)", "engine_simulated": "C ({label})",
    "engine_error": "  its error", "run_col": "run",
    # --validate
    "validation": "C against published measurements of real engines ({validation}; "
                  "calibration: {calibration}); profiles: {profiles}",
    "role_col": "role", "source_col": "source", "rows_col": "rows",
    "median_abs_col": "median |error|", "median_col": "median error",
    "max_abs_col": "max |error|", "within_col": "within 15%", "tp_col": "TP",
    "weights_col": "weights", "lengths_col": "batch x in/out", "metric_col": "metric",
    "published_col": "published", "predicted_col": "C", "error_col": "error",
    "validation_worst": "the {n} rows C gets most wrong:",
    "validation_left": "rows C cannot express: {left}",
    # --calibrate
    "calibration": "C calibrated on {n} measured run(s), from the {start} profile: each run's "
                   "p50 as the engine measured it and as C replays it (* not fitted)",
    "cal_measured_col": "measured ms", "cal_start_col": "before", "cal_fitted_col": "C ms",
    "cal_error_col": "error", "cal_loo_col": "left out",
    "metric_ttft_s": "TTFT p50", "metric_tpot_s": "TPOT p50", "metric_e2e_s": "E2E p50",
    "calibration_fit": "fitted: all-reduces at {link:.0%} of the link's spec, all-to-alls at "
                       "{a2a:.0%}, {step_ms:.2f} ms a pass, "
                       "{layer_us:.1f} us a layer, {bandwidth:.0%} of the bandwidth, "
                       "{matmul:.0%} of the FLOP/s; rms error on its runs {rms:.1%}",
    "calibration_wrote": "wrote {path} (pass it back: --engine-profile {path})",
    "replay_cached": "{runs}: the engine cached prefixes (its settings say so), but a log of "
                     "token counts names no prompt's tokens, so C replays it with no prompt "
                     "sharing a block with another; where the prompts did share whole blocks, "
                     "the engine computed less than C's replay",
    # --replay-distserve
    "distserve_replay": "DistServe's logged runs (OPT-13B, A100-80GB, ShareGPT) against C on "
                        "their own placements and arrivals, priced by {profiles} alone; SLO: "
                        "TTFT <= 0.2 s and TPOT <= 0.1 s",
    "file_col": "run", "placement_col": "placement", "who_col": "", "slo_col": "SLO met",
    "measured": "measured", "simulated": "C",
    "placement_search": "OPT-13B on up to {budget} A100-80GB by goodput per card (the highest "
                        "rate at which 90% of {requests} ShareGPT requests meet TTFT <= 0.2 s "
                        "and TPOT <= 0.1 s, DistServe's profile of its engine)",
    "placement_timing": "{simulations:,} simulations, {p50_ms:,.0f} ms each (p10 {p10_ms:,.0f}, "
                        "p90 {p90_ms:,.0f}), in {wall_s:.1f} s on {where} (started in "
                        "{start_s:.1f} s): {busy:.2f} of them busy on average",
    "on_workers": "{workers} worker processes", "on_dask": "the Dask cluster {cluster}",
    "placement_best": "the best of each kind: {best}",
    # C's pools
    "pools": "C  disaggregated serving on {gpus} cards beside colocated replicas on as many "
             "as whole replicas take ({colocated_gpus}): {requests:,} requests, each pool's engine limits and KV cache on its own cards; "
             "disaggregated: {disaggregated}; colocated: {colocated}",
    "kind_col": "kind", "kind_disaggregated": "disaggregated", "kind_colocated": "colocated",
    "pool_col": "pool", "replicas_col": "replicas", "busy_col": "busy", "wait_col": "wait s",
    "placements": "C  the cheapest placement for {rate:g} requests/s with {slo} for "
                  "{attainment:.0%} of requests ({requests:,} arrivals a simulation): each "
                  "shape's fewest replicas, searched by simulation from TensorRT-LLM's "
                  "rate-matching rule (rule: its prefill + decode replicas)",
    "placements_timing": "{simulations:,} simulations, {each_ms:,.0f} ms each on average, in "
                         "{wall_s:.1f} s on {where}",
    "placement_none": "{shapes}: none meets the SLO",
    "placement_skipped": "{shapes}: skipped (misses the SLO idle, or past the budget)", "rule_col": "rule",
    "placements_none": "answer: no placement searched serves the rate at the SLO",
    "placements_answer": "answer: {kind}, {placement}: {cards}, {attainment:.1%} meeting the "
                         "SLO",
    "placements_other": "the best {kind}: {placement}, {cards} ({more:+d} GPUs for the same "
                        "rate, {attainment:.1%} meeting the SLO)",
    "placements_other_none": "no placement of the other kind serves the rate at the SLO",
    "rate_matching": "the rate-matching rule for that pair: a prefill replica prefills "
                     "{context_rps:,.3g} requests/s, a decode replica completes "
                     "{generation_rps:,.3g} (a batch of {batch:,}, {ms:,.1f} ms a step): "
                     "{prefill_replicas} + {decode_replicas} replicas, {gpus} cards, "
                     "{output_tokens_per_s_per_gpu:,.0f} output tokens/s a card",
    "pools_kv": "wait s: a prefill's p90 wait for its first step; a decode's mean wait for "
                "room at its replica (back-pressure: {waited:,} requests waited, {wait_s:,.2f} s "
                "in all). KV moved: {gb:,.2f} GB in {sends:,} sends over {link} ({gbs:g} GB/s, "
                "{us:g} us), {ms:,.3f} ms a send on average",
    "gpus_col": "cards", "goodput_col": "goodput req/s", "per_gpu_col": "req/s per card",
    "simulations_col": "simulations", "search_col": "search s",
    # the end
    "wrote": "wrote {json} and {figures}", "wrote_json": "wrote {json}",
    "older_figures": "kept from an older run (this one drew none): {figures}",
    "interrupted": "interrupted: the tables above are the experiments that finished",
}
