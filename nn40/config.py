"""Configuration: the model's shape, the cards, and every limit and seed

Owns the frozen configs of the model and the cards (ModelConfig, GPU) and the constants
every module reads: the named models and cards, the post's length law, the limits on sizes
and counts, the random streams' offsets. (The run's settings, RunConfig, are settings.py's.)
"""
import dataclasses
import os
from dataclasses import dataclass

from nn40.errors import UsageError, read_json


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 12
    hidden: int = 2048
    heads: int = 16
    vocab: int = 32000
    max_positions: int = 8192  # the longest sequence (rows of a learned position table)
    dtype: str = "float16"
    arch: str = "transformer"  # or "post": the post's proxy for A and B (see PostProxy)
    kv_heads: int = None       # K/V heads (grouped-query attention; 1: multi-query); None: heads
    mlp: str = "gelu"          # "gelu": fc, GELU, out; "gated": SiLU(gate) * up, then down
    ffn_hidden: int = None     # the MLP's width; None: 4 x hidden (gelu), 8/3 x hidden (gated)
    norm: str = "layer"        # "layer" (LayerNorm) or "rms" (RMSNorm)
    positions: str = "learned"  # "learned" (a position table) or "rope" (rotary)
    rope_theta: float = 10000.0
    tied: bool = False         # the LM head is the token embedding
    name: str = "post"         # the preset it came from (see MODELS)
    weights: str = None        # C's weight format (WEIGHT_FORMATS); None: the dtype's
    kv_dtype: str = "auto"     # C's KV-cache elements: "auto" (the dtype's) or "fp8"
    head_width: int = None     # a head's width where it is not hidden / heads (Qwen3: 128)
    # mixture of experts: `experts` routed experts a layer, each token sent to
    # `experts_per_token` of them, beside `shared_experts` every token uses; each a gated MLP
    # of `expert_ffn`; the first `dense_layers` layers keep a dense MLP of `ffn_hidden`
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_ffn: int = None
    dense_layers: int = 0
    expert_weights: str = None  # the experts' weight format (None: --weights')
    expert_skew: float = 0.0   # routing's skew: expert i of E drawn in proportion to i^-skew
                               # (0: uniformly; see expert_inclusion)
    # latent attention (DeepSeek's MLA): K and V cached as one latent of kv_lora_rank and a
    # rotary key of rope_head_dim per token and layer; queries through a q_lora_rank latent
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_width: int = None   # MLA: a value head's width (None: head_dim)
    mtp_layers: int = 0        # multi-token prediction modules shipped beside the layers
                               # (num_nextn_predict_layers), the drafts of speculative "mtp"

    @property
    def head_dim(self):
        return self.head_width or self.hidden // self.heads

    @property
    def q_dim(self):  # the width of the queries (and of attention's output) in every layer
        return self.heads * self.head_dim

    @property
    def n_kv_heads(self):
        return self.kv_heads or self.heads

    @property
    def kv_dim(self):  # the width of K (and of V) in every layer
        return self.n_kv_heads * self.head_dim

    @property
    def moe_layers(self):  # layers whose MLP is experts
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def expert_width(self):
        return self.expert_ffn or self.ffn

    @property
    def mla(self):
        return self.kv_lora_rank > 0

    @property
    def v_head(self):
        return self.v_head_width or self.head_dim

    @property
    def ffn(self):
        if self.ffn_hidden:
            return self.ffn_hidden
        return 4 * self.hidden if self.mlp == "gelu" else -(-8 * self.hidden // 3 // 64) * 64

    @property
    def mlp_matrices(self):  # h x f matrices per MLP: fc and out, or gate, up and down
        return 2 if self.mlp == "gelu" else 3

    @property
    def norm_params(self):  # parameters of one norm: LayerNorm's weight and bias, RMSNorm's weight
        return 2 * self.hidden if self.norm == "layer" else self.hidden

    @property
    def position_rows(self):  # rows of the learned position table (rotary positions: none)
        return self.max_positions if self.positions == "learned" else 0

    # Bytes per element of each kind of tensor: the matmul weights (--weights, with their
    # scales), the KV cache (--kv-dtype), and everything else at --dtype (activations, norms,
    # embedding tables and the LM head, which quantizers leave in 16 bits)
    @property
    def dtype_bytes(self):
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_format(self):
        return self.weights or DTYPE_FORMAT[self.dtype]

    @property
    def weight_element_bytes(self):
        """A weight's bytes, its share of its group's scales included: int8 keeps one 2-byte
        scale per output channel (a group of `hidden` inputs), int4 a 2-byte scale and a
        2-byte zero per 32 weights (gpt-fast's g32), so 0.5 + 4/32 bytes."""
        bits, group, scale_bytes = WEIGHT_FORMATS[self.weight_format]
        return bits / 8 + (scale_bytes / (group or self.hidden) if scale_bytes else 0)

    @property
    def expert_element_bytes(self):
        return dataclasses.replace(self, weights=self.expert_weights).weight_element_bytes \
            if self.expert_weights else self.weight_element_bytes

    @property
    def kv_element_bytes(self):
        return 1 if self.kv_dtype == "fp8" else self.dtype_bytes

    @property
    def fp8_compute(self):  # W8A8: its matmuls run at the card's FP8 rate
        return self.weight_format == "fp8"


DTYPE_NAMES = ("float16", "bfloat16", "float32")  # (torch's types: DTYPES, with the model)
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
DTYPE_FORMAT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# C's weight formats: (bits per weight, weights per scale group (None: per output channel),
# bytes of scales per group). fp8 is W8A8 (FP8 matmuls, where the card has them); int8 and
# int4 are weight-only (dequantized into 16-bit matmuls), as gpt-fast's and most servers' are.
WEIGHT_FORMATS = {"fp32": (32, None, 0), "bf16": (16, None, 0), "fp16": (16, None, 0),
                  "fp8": (8, None, 0), "int8": (8, None, 2), "int4": (4, 32, 4),
                  "mxfp4": (4, 32, 1)}  # (OCP MXFP4: a 1-byte power-of-two scale per 32)
KV_DTYPES = ("auto", "fp8")

# Published measurements of real engines: the project's validation rows, and the calibration
# file the engine profiles are fitted on (beside the project, never copied into it)
PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (the script's folder)
PUBLISHED_CSV = os.path.join(PROJECT_DIR, "tests", "data", "published.csv")
CALIBRATION_CSV = os.path.normpath(os.path.join(PROJECT_DIR, "..", "shared", "published",
                                                "calibration.csv"))

# The post's model takes minutes per experiment on a CPU, so there every model field the user
# leaves unset comes from this smaller preset; its dtype is a probe's choice (see probe_dtypes)
# unless --dtype is given, bfloat16 where no probe runs.
CPU_PRESET = ModelConfig(layers=4, hidden=1024, heads=8, vocab=8192, max_positions=4096,
                         dtype="bfloat16")

# Models people serve on one GPU, by their published shapes (the config.json of each on the
# Hugging Face Hub; README cites them). Weights stay random: only shapes set bytes and FLOPs.
# Left out: Qwen2.5's biases on q, k and v (0.01% of its weights), rotary scaling (it changes
# values past 8k tokens, not costs), Mistral v0.1's sliding window (v0.3 has none).
_LLAMA = dict(mlp="gated", norm="rms", positions="rope", dtype="bfloat16")

MODELS = {
    "post": ModelConfig(),  # the post's 12 layers x 2048 (on CPU, the CPU preset)
    "llama-3-8b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256,
                              max_positions=8192, ffn_hidden=14336, rope_theta=500000.0,
                              name="llama-3-8b", **_LLAMA),
    "llama-3.2-1b": ModelConfig(layers=16, hidden=2048, heads=32, kv_heads=8, vocab=128256,
                                max_positions=131072, ffn_hidden=8192, rope_theta=500000.0,
                                tied=True, name="llama-3.2-1b", **_LLAMA),
    "mistral-7b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32768,
                              max_positions=32768, ffn_hidden=14336, rope_theta=1e6,
                              name="mistral-7b", **_LLAMA),
    "qwen2.5-7b": ModelConfig(layers=28, hidden=3584, heads=28, kv_heads=4, vocab=152064,
                              max_positions=32768, ffn_hidden=18944, rope_theta=1e6,
                              name="qwen2.5-7b", **_LLAMA),
    # the models of the published measurements C is checked against (see --validate); GPT-J's
    # biases and its rotary positions on a quarter of each head are left out (no cost of note)
    "gpt-j-6b": ModelConfig(layers=28, hidden=4096, heads=16, vocab=50400, max_positions=2048,
                            positions="rope", name="gpt-j-6b"),
    # Qwen3's heads are 128 wide whatever its width; its per-head q and k norms (256
    # parameters a layer) are left out
    "qwen3-32b": ModelConfig(layers=64, hidden=5120, heads=64, kv_heads=8, head_width=128,
                             vocab=151936, max_positions=40960, ffn_hidden=25600,
                             rope_theta=1e6, name="qwen3-32b", **_LLAMA),
    # mixtures of experts (A, B, C and D), and latent attention (C only: see run_config)
    "mixtral-8x7b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32000,
                                max_positions=32768, ffn_hidden=14336, experts=8,
                                experts_per_token=2, rope_theta=1e6, name="mixtral-8x7b",
                                **_LLAMA),
    "mixtral-8x22b": ModelConfig(layers=56, hidden=6144, heads=48, kv_heads=8, vocab=32768,
                                 max_positions=65536, ffn_hidden=16384, experts=8,
                                 experts_per_token=2, rope_theta=1e6, name="mixtral-8x22b",
                                 **_LLAMA),
    "qwen3-30b-a3b": ModelConfig(layers=48, hidden=2048, heads=32, kv_heads=4, head_width=128,
                                 vocab=151936, max_positions=40960, ffn_hidden=6144,
                                 experts=128, experts_per_token=8, expert_ffn=768,
                                 rope_theta=1e6, name="qwen3-30b-a3b", **_LLAMA),
    # DeepSeek-V3 as published, in FP8 (its 128 x 128 blocks' scales: 0.006% more bytes, left
    # out); 3 dense layers, then 256 routed experts (8 a token) and 1 shared; its multi-token
    # prediction module (not part of the 671 B) loaded only to speculate (mtp_layers)
    "deepseek-v3": ModelConfig(layers=61, hidden=7168, heads=128, vocab=129280,
                               max_positions=163840, ffn_hidden=18432, dense_layers=3,
                               experts=256, experts_per_token=8, shared_experts=1,
                               expert_ffn=2048, kv_lora_rank=512, q_lora_rank=1536,
                               head_width=128, rope_head_dim=64, v_head_width=128,
                               name="deepseek-v3", mlp="gated", norm="rms", positions="rope",
                               dtype="bfloat16", weights="fp8", mtp_layers=1),
    # gpt-oss-20b as published: its experts in MXFP4, the rest in bf16 (its biases, attention
    # sinks and sliding windows left out)
    "gpt-oss-20b": ModelConfig(layers=24, hidden=2880, heads=64, kv_heads=8, head_width=64,
                               vocab=201088, max_positions=131072, ffn_hidden=2880,
                               experts=32, experts_per_token=4, expert_weights="mxfp4",
                               rope_theta=150000.0, name="gpt-oss-20b", **_LLAMA),
    "opt-13b": ModelConfig(layers=40, hidden=5120, heads=40, vocab=50272, max_positions=2048,
                           tied=True, name="opt-13b"),  # (ReLU costs what GELU does)
    "llama-2-7b": ModelConfig(layers=32, hidden=4096, heads=32, vocab=32000, max_positions=4096,
                              ffn_hidden=11008, name="llama-2-7b", **_LLAMA),
    "llama-2-70b": ModelConfig(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=32000,
                               max_positions=4096, ffn_hidden=28672, name="llama-2-70b",
                               **_LLAMA),
    "llama-3.1-8b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256,
                                max_positions=131072, ffn_hidden=14336, rope_theta=500000.0,
                                name="llama-3.1-8b", **_LLAMA),
    "llama-3.1-70b": ModelConfig(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=128256,
                                 max_positions=131072, ffn_hidden=28672, rope_theta=500000.0,
                                 name="llama-3.1-70b", **_LLAMA),
    "llama-3.1-405b": ModelConfig(layers=126, hidden=16384, heads=128, kv_heads=8,
                                  vocab=128256, max_positions=131072, ffn_hidden=53248,
                                  rope_theta=500000.0, name="llama-3.1-405b", **_LLAMA),
    # the models people now publish serving numbers on, from their config.json: Llama-3.3-70B
    # has Llama-3.1-70B's shape; Qwen3-235B-A22B is Qwen3-30B-A3B's design, wider and deeper
    "llama-3.3-70b": ModelConfig(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=128256,
                                 max_positions=131072, ffn_hidden=28672, rope_theta=500000.0,
                                 name="llama-3.3-70b", **_LLAMA),
    "qwen3-235b-a22b": ModelConfig(layers=94, hidden=4096, heads=64, kv_heads=4,
                                   head_width=128, vocab=151936, max_positions=40960,
                                   ffn_hidden=12288, experts=128, experts_per_token=8,
                                   expert_ffn=1536, rope_theta=1e6, name="qwen3-235b-a22b",
                                   **_LLAMA),
    # Llama 4 Maverick's text model: 48 layers alternating a dense MLP (intermediate_size_mlp
    # 16384) and 128 routed experts (1 a token) beside a shared one, each 8192 wide; C counts
    # layers, not their order, so 24 dense layers then 24 MoE layers cost what it runs. Its
    # chunked attention (3 layers in 4 attend within 8,192-token chunks) is left out: past 8k
    # tokens C prices more cache reads than it makes
    "llama-4-maverick": ModelConfig(layers=48, hidden=5120, heads=40, kv_heads=8,
                                    head_width=128, vocab=202048, max_positions=1048576,
                                    ffn_hidden=16384, dense_layers=24, experts=128,
                                    experts_per_token=1, shared_experts=1, expert_ffn=8192,
                                    rope_theta=500000.0, name="llama-4-maverick", **_LLAMA),
}
# DeepSeek-R1 is DeepSeek-V3's shape (the same config.json), trained further
MODELS["deepseek-r1"] = dataclasses.replace(MODELS["deepseek-v3"], name="deepseek-r1")


# A Hugging Face config.json's fields, by model_type: ModelConfig field -> its key, read by
# read_model_config (every key required but HF_OPTIONAL's)
HF_COMMON = {"layers": "num_hidden_layers", "hidden": "hidden_size",
             "heads": "num_attention_heads", "vocab": "vocab_size",
             "max_positions": "max_position_embeddings"}
HF_FIELDS = {
    "llama": {"kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size"},
    "qwen3_moe": {"kv_heads": "num_key_value_heads", "experts": "num_experts",
                  "experts_per_token": "num_experts_per_tok",
                  "expert_ffn": "moe_intermediate_size"},
    "mixtral": {"kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size",
                "experts": "num_local_experts", "experts_per_token": "num_experts_per_tok"},
    "deepseek_v3": {"ffn_hidden": "intermediate_size", "experts": "n_routed_experts",
                    "experts_per_token": "num_experts_per_tok",
                    "shared_experts": "n_shared_experts", "expert_ffn": "moe_intermediate_size",
                    "dense_layers": "first_k_dense_replace", "kv_lora_rank": "kv_lora_rank",
                    "q_lora_rank": "q_lora_rank", "rope_head_dim": "qk_rope_head_dim",
                    "head_width": "qk_nope_head_dim", "v_head_width": "v_head_dim"},
}
HF_OPTIONAL = ("num_key_value_heads", "q_lora_rank")  # (absent: every head's K/V; no q latent)
HF_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
            "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3"}


def read_model_config(path):
    """A Hugging Face config.json -> ModelConfig (shapes only; one line naming a missing or
    unsupported field). Llama, Mistral, Qwen2/Qwen3, Mixtral, Qwen3-MoE and DeepSeek-V3."""
    hf = read_json(path)
    model_type = hf.get("model_type") if isinstance(hf, dict) else None
    kind = HF_TYPES.get(model_type)
    if kind is None:
        raise UsageError(f"{path}: model_type {model_type!r} is not one this reads "
                         f"({', '.join(HF_TYPES)})")
    fields = {}
    for field, key in {**HF_COMMON, **HF_FIELDS[kind]}.items():
        value = hf.get(key)
        if value is None and key not in HF_OPTIONAL:
            raise UsageError(f"{path}: no {key!r} (model_type {hf['model_type']})")
        if value is not None and not (isinstance(value, int) and value >= 0):
            raise UsageError(f"{path}: {key} must be a whole number, not {value!r}")
        fields[field] = (value or 0) if field == "q_lora_rank" else value
    mtp = hf.get("num_nextn_predict_layers") or 0  # (DeepSeek-V3's, GLM-4.5's MTP modules)
    if not (isinstance(mtp, int) and mtp >= 0):
        raise UsageError(f"{path}: num_nextn_predict_layers must be a whole number, not {mtp!r}")
    fields["mtp_layers"] = mtp
    if hf.get("head_dim") and kind != "deepseek_v3":  # (Qwen3's 128 whatever its width)
        fields["head_width"] = hf["head_dim"]
    dtype = {"float16": "float16", "bfloat16": "bfloat16"}.get(hf.get("torch_dtype"), "bfloat16")
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "config"
    return ModelConfig(**fields, mlp="gated", norm="rms", positions="rope", dtype=dtype,
                       rope_theta=float(hf.get("rope_theta") or 10000.0),
                       tied=bool(hf.get("tie_word_embeddings", False)), name=name)


@dataclass(frozen=True)
class GPU:
    """A card as its vendor specifies it: peak memory bandwidth, dense (not 2:4 sparse)
    FP16/BF16 and FP8 tensor throughput with FP32 accumulate (None: no FP8 units), memory as
    sold and as the driver reports it, and the link its tensor-parallel all-reduces cross
    (NVLink, or PCIe where a card has none), in GB/s each way."""
    name: str
    bandwidth_gbs: float
    tflops: float
    memory_gb: float
    fp8_tflops: float = None
    link: str = "PCIe 4.0 x16"
    link_gbs: float = 32.0
    memory_mib: float = None      # the driver's total (None: memory_gb x 1e9 bytes)

    @property
    def memory_bytes(self):
        return self.memory_mib * 2**20 if self.memory_mib else self.memory_gb * 1e9

    def matmul_tflops(self, fp8=False):
        """The rate a model's matmuls run at: FP8 (W8A8) where the card has FP8 units."""
        return self.fp8_tflops if fp8 and self.fp8_tflops else self.tflops


_NVLINK3, _NVLINK4, _NVLINK5 = ("NVLink 3", 300.0), ("NVLink 4", 450.0), ("NVLink 5", 900.0)
_PCIE4, _PCIE5 = ("PCIe 4.0 x16", 32.0), ("PCIe 5.0 x16", 64.0)

GPUS = {  # README cites the spec sheets; memory_mib: nvidia-smi's total (the RTX 4090's as
    # torch reported it in LLMServingSim's vLLM run)
    "rtx-3090": GPU("RTX 3090", 936.0, 71.0, 24.0, None, *_PCIE4, 24576),
    "rtx-4090": GPU("RTX 4090", 1008.0, 165.2, 24.0, 330.3, *_PCIE4, 24081),
    "rtx-5080": GPU("RTX 5080", 960.0, 112.6, 16.0, 225.1, *_PCIE5, 16303),
    "rtx-pro-6000": GPU("RTX PRO 6000 Blackwell", 1792.0, 503.8, 96.0, 1007.6, *_PCIE5,
                        97887),
    "l40s": GPU("L40S", 864.0, 362.1, 48.0, 733.0, *_PCIE4, 46068),
    "a100-40gb": GPU("A100 40GB SXM", 1555.0, 312.0, 40.0, None, *_NVLINK3, 40960),
    "a100-80gb": GPU("A100 80GB SXM", 2039.0, 312.0, 80.0, None, *_NVLINK3, 81920),
    "a100-pcie-80gb": GPU("A100 80GB PCIe", 1935.0, 312.0, 80.0, None, *_PCIE4, 81920),
    "h100-pcie": GPU("H100 PCIe", 2000.0, 756.0, 80.0, 1513.0, *_PCIE5, 81559),
    "h100": GPU("H100 SXM", 3350.0, 989.4, 80.0, 1978.9, *_NVLINK4, 81559),
    "h200": GPU("H200 SXM", 4800.0, 989.4, 141.0, 1978.9, *_NVLINK4, 143771),
    "b200": GPU("B200", 8000.0, 2250.0, 180.0, 4500.0, *_NVLINK5, 183359),
}


def card_key(card):
    """The GPUS key a card is registered under (None: a card of no name here)."""
    return next((key for key, named in GPUS.items() if named == card), None)

# Each card's link to its host's memory, one way (a prefix cache's host tier loads over it):
# the PCIe cards' own link; the SXM boards' host slots per NVIDIA's HGX/DGX spec sheets (A100:
# PCIe 4.0 x16; H100, H200: PCIe 5.0 x16; B200: PCIe 6.0 on the card, 5.0 on the DGX B200 host)
HOST_LINKS = {"a100-40gb": _PCIE4, "a100-80gb": _PCIE4, "h100": _PCIE5, "h200": _PCIE5,
              "b200": _PCIE5}
# The share of that link a KV load gets: vLLM's KV offloading connector copies by DMA at about
# 50 GB/s one way on an H100's PCIe 5.0 x16 (64 GB/s by spec; 83.4 GB/s both ways at once):
# blog.vllm.ai, "Inside vLLM's New KV Offloading Connector" (2026), its copy-method benchmark
HOST_LINK_SHARE = 50.0 / 64.0
# A disk tier's read bandwidth when none is given (--disk-kv-gbs): one PCIe 4.0 NVMe data-center
# drive's sequential read by its spec sheet (Samsung PM9A3, U.2: 6,900 MB/s). A replica's cards
# all read from it (one drive a node), so a token's KV reads whole, not a card's share.
DISK_READ_GBS = 6.9

EXPERIMENTS = "ABCD"

# C prices steps in seconds with a roofline of these when no device was measured: the post's
# RTX 5080 (960 GB/s by specification; 105.5 TFLOP/s, the post's best measured fp16 rate).
REFERENCE_BANDWIDTH_GBS, REFERENCE_TFLOPS = 960.0, 105.5

# The post's output lengths: floor(e^N(4.2, 0.9^2)), at least 1, 600 draws from NumPy's
# default_rng(3): median 70.5, max 1,327, the post's "median 70, max 1,327" (and its table to
# the step). Longer draws of other seeds or sizes are capped at LENGTH_MAX (a reservation's
# default output, and what D's position table must hold).
LENGTH_MU, LENGTH_SIGMA, LENGTH_MAX, LENGTH_SEED = 4.2, 0.9, 2048, 3

# Every random draw of a run, as an offset from --seed (the post's lengths and the model's
# weights are --seed itself; a capacity search's k-th draw is "capacity" + k), named by
# seed_for / random_stream, every run repeatable. The offsets differ, but a pool's router seeds
# its second draw (power-of-two's other replica) with its seed + 1, "fleet" + 1: the seed of
# "prefixes". The two streams draw different things (replicas, system prompts) in one run.
SEED_OFFSET = {"arrivals": 1, "sweep": 2, "prompts": 3, "predicted": 4, "engine_arrivals": 5,
               "fleet": 6, "capacity": 10, "replicas": 20, "prefixes": 7, "placements": 30,
               "speculation": 8}
# The KV cache's memory in C, unless --kv-memory-gb: on CUDA, this share of the device's memory
# less the weights (vLLM's default gpu_memory_utilization); on CPU, a deliberately small cache,
# so that memory and not the slots limits the batch; with no device (C alone, analytic prices),
# the post's RTX 5080 and its 16 GB.
KV_MEMORY_FRACTION, CPU_KV_MEMORY_GB, REFERENCE_MEMORY_GB = 0.9, 0.5, 16.0


RATES = (1e-6, 1e12)  # requests/s a flag takes (a run's arrivals must also span < MAX_SPAN_S)

MAX_SPAN_S = 1e9  # the arrivals' span: past it, float seconds lose a millisecond step's detail

# C's memory per request, with room to spare: one simulation peaked at ~160 bytes a request
# (1M requests), and the parent keeps three floats a request from each of nine simulations
REQUEST_BYTES = 2048

SWEEP_REQUESTS = 2000  # requests per point of the rate sweep

WHO_WAITS_REQUESTS = 100_000  # the who-waits study serves the first this many requests

REPLICAS_MAX = 1024       # the most replicas a flag or a search goes to

CAPACITY_REQUESTS = 4000  # requests per point of a capacity search (the run's, cycled)

CAPACITY_SEEDS = 5        # independent arrival draws of one replica's capacity

# D on CPU serves the post's law shrunk (CUDA: the post's requests as they are): a CPU's ridge is
# tens of FLOP/byte, so its decode step stays flat in the batch only to about 8 rows, where a
# GPU's stays flat past 100; and outputs an eighth as long keep D within about half a minute.
ENGINE_CPU = {"requests": 96, "shrink": 8, "prompt_len": 16, "slots": 8}

VLLM_MAX_NUM_SEQS = 256  # vLLM's default --max-num-seqs, beside --slots' 32 (the post's)

ENGINE_QUICK = {"requests": 16, "shrink": 16, "prompt_len": 8, "slots": 4}
