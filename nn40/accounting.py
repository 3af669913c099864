"""Accounting: FLOPs and bytes of one forward step (pure: the one source of truth for A, B,

MBU/MFU, C's prices and every memory check) Per layer the block holds its matmul weights
(see layer_weights: for the post's model 12 h^2, qkv 3h^2, proj h^2, fc 4h^2, out 4h^2) and
two norms (LayerNorm 2h each, RMSNorm h); the model adds a final norm, an LM head (h V, the
token table itself when tied) and embedding tables (token V h, and with learned positions P
h) of which a step reads only the rows it looks up. A step runs `new_tokens` tokens in each
of `batch` rows whose cache already holds `context` tokens, and computes logits for the last
token of each row only (as servers do).
"""
import dataclasses
import functools
import math

import numpy as np


def attention_weights(cfg):
    """Attention's matmul weights in one block: q and the output projection h x q_dim each
    (q_dim = h unless a head is wider), K and V h x kv_dim each (grouped heads share them);
    or latent attention's down- and up-projections of q and of the K/V latent, and the output."""
    h = cfg.hidden
    if not cfg.mla:
        return 2 * h * cfg.q_dim + 2 * h * cfg.kv_dim
    qk = cfg.heads * (cfg.head_dim + cfg.rope_head_dim)  # (a rotary part beside each head)
    q = (h + qk) * cfg.q_lora_rank if cfg.q_lora_rank else h * qk
    return q + h * (cfg.kv_lora_rank + cfg.rope_head_dim) + \
        cfg.kv_lora_rank * cfg.heads * (cfg.head_dim + cfg.v_head) + cfg.heads * cfg.v_head * h


def layer_weights(cfg):
    """Matmul weights of one dense block: attention, then the MLP 2 h f (gelu) or 3 h f
    (gated)."""
    return attention_weights(cfg) + cfg.mlp_matrices * cfg.hidden * cfg.ffn


def expert_weights(cfg):
    """One expert's weights: a gated MLP of expert_ffn."""
    return 3 * cfg.hidden * cfg.expert_width


def routed_expert_bytes(cfg):
    """The bytes of one routed expert in every MoE layer: what each expert a pass touches
    a layer adds to its reads."""
    return cfg.moe_layers * expert_weights(cfg) * cfg.expert_element_bytes


def dense_matmul_weights(cfg):
    """Every matmul weight a step reads whatever the routing: attention, the dense MLPs, and in
    each MoE layer the router (h x experts) and the shared experts."""
    h, moe = cfg.hidden, cfg.moe_layers
    return cfg.layers * attention_weights(cfg) + \
        (cfg.layers - moe) * cfg.mlp_matrices * h * cfg.ffn + \
        moe * (h * cfg.experts + cfg.shared_experts * expert_weights(cfg))


def experts_touched(cfg, tokens):
    """Distinct experts a pass of `tokens` tokens reads in one MoE layer, each token routed to
    experts_per_token of them independently: sum over experts of 1 - (1 - q_i)^tokens, where
    q_i is the chance a token picks expert i; uniformly, E (1 - (1 - k/E)^tokens)."""
    if not cfg.experts:
        return 0
    if not cfg.expert_skew:
        E, k = cfg.experts, cfg.experts_per_token
        return E * (1 - (1 - k / E) ** tokens)
    return float(np.sum(1 - (1 - expert_inclusion(cfg)) ** tokens))


@functools.lru_cache(maxsize=64)
def expert_inclusion(cfg):
    """The chance q_i that a token's k experts include expert i, when the router favours
    expert i in proportion to i^-skew (a Zipf law; skew 0 is uniform, q_i = k/E): q_i =
    min(1, c i^-skew), c such that the q_i sum to k (a popular expert is picked at most once
    a token)."""
    E, k = cfg.experts, cfg.experts_per_token
    weight = np.arange(1, E + 1, dtype=np.float64) ** -cfg.expert_skew
    q = np.minimum(1.0, weight * k / weight.sum())
    for _ in range(E):  # water-filling: what the capped experts lose goes to the others
        capped = q >= 1.0
        if not capped.any() or q.sum() >= k - 1e-12:
            break
        rest = weight[~capped]
        q[~capped] = np.minimum(1.0, rest * (k - capped.sum()) / rest.sum())
    return q


def moe_step_bytes(cfg, batch, context, touched):
    """A decode step's bytes (flops_and_bytes's) with `touched` experts read a layer in place of
    the routing's expectation: what a measured step read."""
    cost = flops_and_bytes(cfg, batch, 1, context)
    return cost["bytes"] + (touched - experts_touched(cfg, batch)) * routed_expert_bytes(cfg)


def dense_twin(cfg):
    """A mixture of experts' dense twin: every MLP one gated MLP as wide as a token's experts
    and shared experts together, so a token runs the same active parameters (the routers
    aside) but every step reads all of them, whatever its batch."""
    width = (cfg.experts_per_token + cfg.shared_experts) * cfg.expert_width
    return dataclasses.replace(cfg, experts=0, experts_per_token=0, shared_experts=0,
                               expert_ffn=None, dense_layers=0, expert_weights=None,
                               expert_skew=0.0, mlp="gated", ffn_hidden=width,
                               name=f"{cfg.name}'s dense twin")


def norm_weights(cfg):
    """Parameters of every norm: two a block and the final one, and latent attention's norms
    of its q and K/V latents."""
    return (2 * cfg.layers + 1) * cfg.norm_params + \
        cfg.layers * (cfg.q_lora_rank + cfg.kv_lora_rank) * (cfg.norm_params // cfg.hidden)


def weight_parts(cfg):
    """The model's weights by component: {name: (parameters, bytes per parameter)}."""
    h, L, e = cfg.hidden, cfg.layers, cfg.dtype_bytes
    if cfg.arch == "post":
        return {"matmuls": (L * h * h, cfg.weight_element_bytes)}
    parts = {"matmuls": (dense_matmul_weights(cfg), cfg.weight_element_bytes),
             "lm_head": (0 if cfg.tied else cfg.vocab * h, e),
             "norms": (norm_weights(cfg), e),
             "embeddings": ((cfg.vocab + cfg.position_rows) * h, e)}
    if cfg.experts:
        parts["experts"] = (cfg.moe_layers * cfg.experts * expert_weights(cfg),
                            cfg.expert_element_bytes)
    return parts


def active_param_count(cfg):
    """The parameters one token uses: all but the experts it is not routed to (the makers'
    "active" count, embedding tables included)."""
    idle = cfg.moe_layers * (cfg.experts - cfg.experts_per_token) * expert_weights(cfg)
    return param_count(cfg) - idle


def param_count(cfg):
    return sum(n for n, _ in weight_parts(cfg).values())


def weight_bytes(cfg):
    """Bytes of every weight the model holds, each component at its own element size."""
    return sum(n * e for n, e in weight_parts(cfg).values())


def kv_bytes_per_token(cfg):
    """K and V of one token in every layer (the post's proxy keeps none); latent attention
    keeps its K/V latent and rotary key instead: layers x (kv_lora_rank + rope_head_dim)."""
    if cfg.arch == "post":
        return 0
    width = cfg.kv_lora_rank + cfg.rope_head_dim if cfg.mla else 2 * cfg.kv_dim
    return cfg.layers * width * cfg.kv_element_bytes


def flops_and_bytes(cfg, batch, new_tokens, context):
    """FLOPs and bytes of one forward step.

    flops: 2 per multiply-add of every matmul (weights, and attention's QK^T and PV over the
           keys each query may see: its row's cached context plus the new tokens up to itself)
    bytes: weights read once (matmuls, norms, looked-up embedding rows) + the KV cache read
           (the cached context of every row) + the KV written (the new tokens) + activations
           (each matmul's input and output once, and the logits): a lower bound on traffic.
    Each component's bytes are counted at its own element size (see ModelConfig).
    """
    if cfg.arch == "post":
        return post_step_cost(cfg, batch * new_tokens)
    h, L, f, e = cfg.hidden, cfg.layers, cfg.ffn, cfg.dtype_bytes
    tokens = batch * new_tokens
    keys_seen = new_tokens * context + new_tokens * (new_tokens + 1) // 2  # per row, per layer
    dense, moe, expert = dense_matmul_weights(cfg), cfg.moe_layers, expert_weights(cfg)
    active = dense + moe * cfg.experts_per_token * expert  # (a token's experts, shared too)
    matmul_flops = 2 * tokens * active + 2 * batch * h * cfg.vocab
    attention_flops = attention_flops_per_key(cfg) * L * batch * keys_seen
    looked_up = (2 if cfg.positions == "learned" else 1) * tokens * h  # embedding rows
    weights_read = dense * cfg.weight_element_bytes + \
        experts_touched(cfg, tokens) * routed_expert_bytes(cfg) + \
        (h * cfg.vocab + norm_weights(cfg) + looked_up) * e
    kv_read_bytes = batch * context * kv_bytes_per_token(cfg)
    kv_write_bytes = tokens * kv_bytes_per_token(cfg)
    # each matmul's input and output: qkv h + (q_dim + 2 kv_dim), attention's q in and out
    # 2 q_dim, proj q_dim + h; the MLP (h + f) + (f + h), or gated (h + 2f) + (f + h); then
    # the logits (q_dim = h: 6 h + 2 kv_dim before the MLP)
    mlp_io = (L - moe) * (2 * h + cfg.mlp_matrices * f) + moe * (
        2 * h + 3 * cfg.expert_width * (cfg.experts_per_token + cfg.shared_experts))
    attention_io = 2 * h + 4 * cfg.q_dim + 2 * cfg.kv_dim
    activation_bytes = ((L * attention_io + mlp_io) * tokens + batch * cfg.vocab) * e
    return {"flops": matmul_flops + attention_flops,
            "matmul_flops": matmul_flops,
            "attention_flops": attention_flops,
            "weight_bytes": weights_read,
            "kv_read_bytes": kv_read_bytes,
            "kv_write_bytes": kv_write_bytes,
            "activation_bytes": activation_bytes,
            "replicated_weight_bytes": norm_weights(cfg) * e,
            "tokens": tokens,
            "bytes": weights_read + kv_read_bytes + kv_write_bytes + activation_bytes}


def attention_flops_per_key(cfg):
    """FLOPs of one query token against one cached key in one layer: QK^T and PV, 2 x head
    width each per head; latent attention with its up-projections absorbed (as FlashMLA and
    vLLM decode), scores over the latent and rotary key and values over the latent."""
    if cfg.mla:
        return 2 * cfg.heads * (2 * cfg.kv_lora_rank + cfg.rope_head_dim)
    return 4 * cfg.q_dim


def post_step_cost(cfg, tokens):
    """The post's proxy (--arch post): its L square matmuls alone, 2 L h^2 FLOPs per token,
    its weights read once, each matmul's input and output; no attention and no KV cache."""
    h, L = cfg.hidden, cfg.layers
    flops, weights = 2 * tokens * L * h * h, L * h * h * cfg.weight_element_bytes
    activations = 2 * L * h * tokens * cfg.dtype_bytes
    return {"flops": flops, "matmul_flops": flops, "attention_flops": 0, "weight_bytes": weights,
            "kv_read_bytes": 0, "kv_write_bytes": 0, "activation_bytes": activations,
            "replicated_weight_bytes": 0, "tokens": tokens, "bytes": weights + activations}


def kv_heads_per_card(cfg, tp):
    """K/V heads each of `tp` cards holds: its share, rounded up (one head copied to several
    cards where the cards outnumber the heads, as vLLM and TensorRT-LLM do)."""
    return -(-cfg.n_kv_heads // tp)


def card_weight_bytes(cfg, tp=1, ep=1):
    """The weights one of `tp` cards holds: its share of all but the norms, which every card
    keeps; or, one of `ep` cards of an expert-parallel group (see ep_card_cost), every weight
    but the experts, and 1/ep of those."""
    if ep > 1:
        return weight_bytes(cfg) - all_expert_bytes(cfg) * (1 - 1 / ep)
    replicated = 0 if cfg.arch == "post" else norm_weights(cfg) * cfg.dtype_bytes
    return (weight_bytes(cfg) - replicated) / tp + replicated


def all_expert_bytes(cfg):
    return cfg.experts * routed_expert_bytes(cfg)


def card_experts(cfg, tokens, ep):
    """The busiest of `ep` cards, expert i on card i mod ep, when `tokens` tokens are routed:
    (distinct experts it reads a layer, its share of the routes). Uniformly: (E/ep) (1 - (1 -
    k/E)^tokens) and 1/ep."""
    q = expert_inclusion(cfg)  # (k/E each, uniformly)
    read = [float(np.sum(1 - (1 - q[c::ep]) ** tokens)) for c in range(ep)]
    busiest = int(np.argmax(read))
    return read[busiest], float(q[busiest::ep].sum()) / cfg.experts_per_token


def ep_card_cost(cfg, tokens, ep):
    """One card's pass of its own `tokens` tokens as one of `ep` data-parallel ranks of an
    expert-parallel group (vLLM's --data-parallel-size ep --enable-expert-parallel; DeepSeek's
    serving): attention, dense MLPs and the LM head with all their weights and its own KV
    cache; its E/ep experts serve the routes of the whole group's tokens (each other rank
    taken to run as many), so it reads the experts those touch on the busiest card; each MoE
    layer dispatches every token to its experts' cards and combines their outputs back: two
    all-to-alls, each sending the (ep - 1)/ep of its routes that leave the card."""
    own = flops_and_bytes(cfg, tokens, 1, 0)
    read, routes = card_experts(cfg, tokens * ep, ep)
    expert_flops = 2 * tokens * cfg.experts_per_token * cfg.moe_layers * expert_weights(cfg)
    flops = expert_flops * (routes * ep - 1)  # (the busiest card's routes past its own tokens')
    weights = own["weight_bytes"] + (read - experts_touched(cfg, tokens)) * \
        routed_expert_bytes(cfg)
    routed = tokens * cfg.experts_per_token * cfg.hidden * cfg.dtype_bytes * (ep - 1) / ep
    return {**own, "flops": own["flops"] + flops, "matmul_flops": own["matmul_flops"] + flops,
            "weight_bytes": weights, "bytes": own["bytes"] - own["weight_bytes"] + weights,
            "collectives": 2 * cfg.moe_layers, "collective_bytes": 2 * cfg.moe_layers * routed}


def card_kv_share(cfg, tp):
    """The share of each token's cache one of `tp` cards keeps: its K/V heads' (a latent
    attention's latent is every head's, so every card keeps all of it)."""
    return 1.0 if cfg.mla else kv_heads_per_card(cfg, tp) / cfg.n_kv_heads


def peak_activation_bytes(cfg, tokens, sequences, tp=1):
    """The largest set of activations a forward pass of `tokens` tokens keeps live on one of
    `tp` cards, as an engine's start-up profile run measures it (vLLM's profile_run at
    max_num_batched_tokens): per token the residual stream and its normed copy, beside the
    widest of attention's projections (q, K, V and its output) and the MLP's (its first
    matmul's output and the activation; a mixture of experts: each chosen expert's, and the
    routed tokens' outputs before they are summed); and the sampler's float32 logits and
    probabilities over the vocabulary for min(tokens, sequences) rows."""
    if cfg.arch == "post":
        return 0
    attention = (2 * cfg.q_dim + 2 * cfg.kv_dim) / tp
    first = 2 if cfg.mlp == "gated" else 1
    mlp = (first + 1) * cfg.ffn / tp
    if cfg.experts:
        mlp = max(mlp, cfg.experts_per_token * ((first + 1) * cfg.expert_width / tp + cfg.hidden))
    per_token = (2 * cfg.hidden + max(attention, mlp)) * cfg.dtype_bytes
    return tokens * per_token + min(tokens, sequences) * cfg.vocab * 4 * 2


def card_kv_bytes_per_token(cfg, tp=1):
    return kv_bytes_per_token(cfg) * card_kv_share(cfg, tp)


def card_share(cfg, cost, tp):
    """One card's part of a step's cost under tensor parallelism over `tp` cards (Megatron's
    split: q, K, V and the MLP's first matmuls by columns, the output projections by rows,
    the LM head and token table by vocabulary; norms and activations on every card). -> the
    cost with the FLOPs, matmul weights and KV traffic of one card, its `collectives` (the
    step's two all-reduces per layer) and `collective_bytes`: what each card sends (and
    receives) for them."""
    if tp == 1:
        return {**cost, "collectives": 0, "collective_bytes": 0}
    kv_share = card_kv_share(cfg, tp)
    weights = cost["weight_bytes"] - cost["replicated_weight_bytes"]
    share = {"flops": cost["flops"] / tp, "matmul_flops": cost["matmul_flops"] / tp,
             "attention_flops": cost["attention_flops"] / tp,
             "weight_bytes": weights / tp + cost["replicated_weight_bytes"],
             "kv_read_bytes": cost["kv_read_bytes"] * kv_share,
             "kv_write_bytes": cost["kv_write_bytes"] * kv_share,
             "activation_bytes": cost["activation_bytes"]}
    # ring all-reduce of the step's activations (tokens x hidden): 2 (tp - 1) / tp of them
    share["collective_bytes"] = 2 * cfg.layers * cost["tokens"] * cfg.hidden * \
        cfg.dtype_bytes * 2 * (tp - 1) / tp
    share["collectives"] = 2 * cfg.layers
    share["bytes"] = sum(share[k] for k in ("weight_bytes", "kv_read_bytes", "kv_write_bytes",
                                            "activation_bytes"))
    return {**cost, **share}


def memory_needed_bytes(cfg, batch, cache_len, new_tokens):
    """Device memory a step needs beyond the weights: its KV cache and peak activations.

    Activations are counted generously (the widest intermediate, the logits in fp32, and a
    full attention score matrix in case the kernel materialises it).
    """
    e = cfg.dtype_bytes
    tokens = batch * new_tokens
    if cfg.arch == "post":  # a cycle of 8 fresh inputs, and a matmul's input and output
        return 10 * tokens * cfg.hidden * e
    kv = batch * cache_len * kv_bytes_per_token(cfg)
    widest = cfg.mlp_matrices * cfg.ffn + 2 * cfg.hidden
    if cfg.n_kv_heads < cfg.heads:  # (a prefill repeats K and V for every query head)
        widest += 2 * cfg.q_dim
    activations = (tokens * widest * e + batch * cfg.vocab * 4
                   + batch * cfg.heads * new_tokens * cache_len * 4)
    return kv + activations


def kv_crossover_batch(cfg, context):
    """Smallest batch whose KV-cache reads per decode step exceed the weight reads."""
    cost = flops_and_bytes(cfg, 1, 1, context)
    kv_per_row = cost["kv_read_bytes"]
    return math.floor(cost["weight_bytes"] / kv_per_row) + 1 if kv_per_row else None
