"""The engine profile a run prices by: one of ENGINE_PROFILES by name, or a file --calibrate
wrote, with --kv-fraction (the engine's own memory flag) where given
"""
import dataclasses
import math

from nn40.errors import UsageError, read_json
from nn40.pricing import ENGINE_PROFILES, ENGINE_RULES, EngineProfile


def profile_named(text):
    """--engine-profile: a named engine profile, or a file --calibrate wrote (checked here,
    then named by its path: see engine_profile)."""
    try:
        engine_profile(text)
    except UsageError as e:
        raise UsageError(f"{e} (the profiles: {', '.join(ENGINE_PROFILES)}, or a file "
                         "--calibrate wrote)")
    return text


def run_profile(run):
    """The run's EngineProfile (see profile_at)."""
    return profile_at(run.hardware.engine_profile, run.scheduler.kv_fraction)


def profile_at(name, kv_fraction=None):
    """--engine-profile's EngineProfile, with --kv-fraction (the engine's own memory flag)
    where given: a run's, and the catalogue's."""
    profile = engine_profile(name)
    if kv_fraction is not None:
        profile = dataclasses.replace(profile, kv_fraction=kv_fraction)
    return profile


def engine_profile(name):
    """The EngineProfile a run names: one of ENGINE_PROFILES, or the path of a profile file."""
    return ENGINE_PROFILES[name] if name in ENGINE_PROFILES else read_profile_file(name)


def read_profile_file(path):
    """A profile file --calibrate wrote -> EngineProfile (one line where it is not one)."""
    data = read_json(path, "engine profile ")
    fields = data.get("profile") if isinstance(data, dict) else None
    types = {f.name: f.type for f in dataclasses.fields(EngineProfile)}
    if not isinstance(fields, dict) or set(fields) - set(types) or \
            not {"name", "bandwidth_share", "matmul_share"} <= set(fields):
        raise UsageError(f"{path}: not an engine profile written by --calibrate")
    for key, value in fields.items():  # (each a value of its field's type: a share above 0)
        kind = {"str": str, "bool": bool}.get(getattr(types[key], "__name__", types[key]))
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value) and value >= 0 or key == "kv_fraction" and value is None
        if not (isinstance(value, kind) if kind else number) or \
                key.endswith("share") and not value > 0:
            raise UsageError(f"{path}: {key} {value!r} is not a value an engine profile takes")
    rules = fields.get("rules", EngineProfile.rules)
    if rules not in ENGINE_RULES:
        raise UsageError(f"{path}: rules {rules!r} is not a KV rule C knows "
                         f"({', '.join(ENGINE_RULES)})")
    if fields.get("kv_fraction", 0.0) is None and rules != "sglang":
        raise UsageError(f"{path}: kv_fraction null (the card's own default) is SGLang's rule "
                         f"alone, not {rules}'s: give the fraction")
    return EngineProfile(**fields)
