"""Cards, models and profiles as people write them: "H100", "h100-sxm" and "NVIDIA H100 80GB
HBM3" are one card; an unknown name is answered with the closest ones (named, closest_names)
"""
import itertools

from nn40.config import GPUS, MODELS
from nn40.errors import UsageError


# Names as people write them: vendors' spec sheets, benchmark tables, Hugging Face ids. One
# table: each card and model C names, with the spellings it also answers to; name_key folds
# case, hyphens, spaces, word order, an organisation prefix and the words that tell no two of
# them apart ("NVIDIA", "GeForce", "HBM3", "Instruct"), so each spelling is listed once. A
# card's form factor or memory left out means the one listed first (the A100: 80 GB, SXM).
NAME_NOISE = frozenset({"nvidia", "geforce", "tesla", "hbm", "hbm2e", "hbm3", "hbm3e", "gddr6",
                        "gddr6x", "gddr7", "blackwell", "server", "workstation", "edition",
                        "instruct", "chat", "hf", "it", "base", "meta", "fp8", "bf16", "fp16"})


def _spellings(base, *optional):
    """`base` with every subset of the optional words: "H100", "H100 SXM", "H100 80GB", ..."""
    return tuple(" ".join((base,) + extra) for n in range(len(optional) + 1)
                 for extra in itertools.combinations(optional, n))


NAME_ALIASES = {
    "card": {
        "rtx-3090": _spellings("RTX 3090", "24GB"), "rtx-4090": _spellings("RTX 4090", "24GB"),
        "rtx-5080": _spellings("RTX 5080", "16GB"),
        "rtx-pro-6000": _spellings("RTX PRO 6000", "96GB") + ("RTXPRO6000",),
        "l40s": _spellings("L40S", "48GB"), "a100-40gb": _spellings("A100 40GB", "SXM"),
        "a100-80gb": _spellings("A100", "SXM", "80GB"),
        "a100-pcie-80gb": _spellings("A100 PCIe", "80GB"),
        "h100-pcie": _spellings("H100 PCIe", "80GB"), "h100": _spellings("H100", "SXM", "80GB"),
        "h200": _spellings("H200", "SXM", "141GB"), "b200": _spellings("B200", "SXM", "180GB"),
    },
    "model": {
        "llama-3-8b": ("Meta-Llama-3-8B",), "llama-3.2-1b": ("Llama-3.2-1B",),
        "mistral-7b": ("Mistral-7B", "Mistral-7B-v0.3", "Mistral-7B-Instruct-v0.3",
                       "Mistral-7B-v0.1", "Mistral-7B-Instruct-v0.1"),
        "qwen2.5-7b": ("Qwen2.5-7B",), "gpt-j-6b": ("GPT-J", "EleutherAI/gpt-j-6b"),
        "qwen3-32b": ("Qwen3-32B",),
        "mixtral-8x7b": ("Mixtral-8x7B-v0.1", "Mixtral-8x7B-Instruct-v0.1"),
        "mixtral-8x22b": ("Mixtral-8x22B-v0.1", "Mixtral-8x22B-Instruct-v0.1"),
        "qwen3-30b-a3b": ("Qwen3-30B-A3B-Instruct-2507", "Qwen3-30B-A3B-Thinking-2507"),
        "qwen3-235b-a22b": ("Qwen3-235B-A22B-Instruct-2507", "Qwen3-235B-A22B-Thinking-2507",
                            "Qwen3-235B"),
        "deepseek-v3": ("DeepSeek-V3-0324", "DeepSeek V3"),
        "deepseek-r1": ("DeepSeek-R1-0528", "DeepSeek R1"),
        "gpt-oss-20b": ("openai/gpt-oss-20b",), "opt-13b": ("facebook/opt-13b",),
        "llama-2-7b": ("Llama-2-7b-chat-hf",), "llama-2-70b": ("Llama-2-70b-chat-hf",),
        "llama-3.1-8b": ("Meta-Llama-3.1-8B",), "llama-3.1-70b": ("Meta-Llama-3.1-70B",),
        "llama-3.1-405b": ("Meta-Llama-3.1-405B",), "llama-3.3-70b": ("Llama-3.3-70B",),
        "llama-4-maverick": ("Llama-4-Maverick-17B-128E", "Llama 4 Maverick", "Maverick",
                             "Llama-4-Maverick-17B-128E-Instruct"),
    },
}


def name_key(text):
    """A name as a key: lower case, a Hugging Face id's organisation dropped, "SXM5" as "SXM"
    and "PCIe Gen5" as "PCIe", then its words and numbers, less NAME_NOISE, in sorted order:
    "NVIDIA A100-SXM4-80GB" and "A100 80GB SXM" are both "100 80 a gb sxm"."""
    import re
    text = re.sub(r"sxm\d", "sxm", str(text).lower().rsplit("/", 1)[-1])
    text = re.sub(r"pci-?e(\s*gen\s*\d)?", "pcie", text)
    words = [w for w in re.split(r"[\s_,()-]+", text) if w not in NAME_NOISE]
    return " ".join(sorted(a for w in words for a in re.findall(r"\d+(?:\.\d+)?|[a-z]+", w)))


def name_index(kind):
    """{name_key(spelling): C's name} of every card or model: its own name, its display name,
    and its aliases."""
    catalogue = GPUS if kind == "card" else MODELS
    index = {}
    for name in catalogue:
        shown = catalogue[name].name
        for spelling in (name, shown) + NAME_ALIASES[kind].get(name, ()):
            index.setdefault(name_key(spelling), name)
    return index


def find_name(text, kind):
    """C's name for a card or model as written (None: no spelling of one)."""
    return name_index(kind).get(name_key(text))


def closest_names(text, kind, n=3):
    """The C names whose spellings are nearest `text` (difflib's ratio on each lower-cased,
    its organisation and NAME_NOISE dropped), nearest first."""
    import difflib
    import re

    def plain(name):
        words = re.split(r"[\s_,()-]+", str(name).lower().rsplit("/", 1)[-1])
        return "-".join(w for w in words if w and w not in NAME_NOISE)
    spellings = {}
    for name in (GPUS if kind == "card" else MODELS):
        for spelling in (name,) + NAME_ALIASES[kind].get(name, ()):
            spellings.setdefault(plain(spelling), name)
    near = difflib.get_close_matches(plain(text), list(spellings), n=12, cutoff=0.4)
    return list(dict.fromkeys(spellings[s] for s in near))[:n]


def named(text, kind):
    """C's name for a card or model as written, or one line naming the closest ones."""
    name = find_name(text, kind)
    if name is None:
        near = closest_names(text, kind)
        raise UsageError(f"unknown {kind} {text!r}" + (f"; closest: {', '.join(near)}" if near
                                                      else "") + " (list: --catalog)")
    return name
