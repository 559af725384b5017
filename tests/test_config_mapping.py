"""Every field the Hugging Face config mapping reads is tested off its default.

The keys a family's mapping reads are found by running it: `Fields` records each key its config-in
function asks for (a rope parameter as `rope_parameters.<key>`), so a family or a field added later is
walked without a list to keep. A read key counts as tested when some case of that family, in
tests/test_hf_families.py's FAMILIES (checked against transformers' model) or in REFUSED here (checked
to be refused in one line), gives a different outcome (the shoal config, or the refusal) with that key
put back to its default: then a mapping that ignored the key, or used the default instead of the value
read, would fail the case's test.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from shoal.models.config import ModelConfig  # noqa: E402
from shoal.models.hf.common import Family, Fields  # noqa: E402
from shoal.models.hf.families import BY_TYPE  # noqa: E402
from test_hf_families import FAMILIES, LOAD_REFUSED, ROUTER_LOSS  # noqa: E402

_LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
_ROPE = {"rope_type": "default", "rope_theta": 500.0}

REFUSED: dict[str, tuple[str, dict[str, Any]]] = {
    # case name: (the case it changes, fields over it that the mapping refuses in one line naming them)
    **{f"{f}-partial-rotary": (f, dict(partial_rotary_factor=0.5)) for f in _LLAMA_STYLE},
    **{f"{f}-rope-partial": (f, dict(rope_parameters={**_ROPE, "partial_rotary_factor": 0.5})) for f in _LLAMA_STYLE},
    **{f"{f}-rope-longrope": (f, dict(rope_parameters={**_ROPE, "rope_type": "longrope"})) for f in _LLAMA_STYLE},
    **{f"{f}-gelu": (f, dict(hidden_act="gelu")) for f in _LLAMA_STYLE},
    "llama-attention-bias-apart": ("llama", dict(mlp_bias=False)),
    "llama-mlp-bias-apart": ("llama", dict(attention_bias=False)),
    "mistral-window-0": ("mistral", dict(sliding_window=0)),
    **{f"{f}-window-some-layers": (f"{f}-window", dict(max_window_layers=1, layer_types=None))
       for f in ("qwen2", "qwen3", "qwen2_moe")},
    **{f"{f}-layer-types-some": (f"{f}-window", dict(layer_types=["full_attention", "sliding_attention"]))
       for f in ("qwen2", "qwen3", "qwen2_moe")},
    "qwen3-attention-bias": ("qwen3", dict(attention_bias=True)),
    "qwen3_moe-attention-bias": ("qwen3_moe", dict(attention_bias=True)),
    "deepseek_v3-attention-bias": ("deepseek_v3", dict(attention_bias=True)),
    "deepseek_v3-rope-halves": ("deepseek_v3", dict(rope_interleave=False)),
    "deepseek_v3-kv-heads": ("deepseek_v3", dict(num_key_value_heads=2)),
    "deepseek_v3-partial-rotary": ("deepseek_v3", dict(partial_rotary_factor=0.5)),
    "deepseek_v3-gelu": ("deepseek_v3", dict(hidden_act="gelu")),
    "deepseek_v3-no-experts": ("deepseek_v3", dict(n_routed_experts=0)),
    "deepseek_v3-first-dense": ("deepseek_v3", dict(first_k_dense_replace=-1)),
    "deepseek_v3-rope-partial": ("deepseek_v3", dict(rope_parameters={**_ROPE, "partial_rotary_factor": 0.5})),
    "deepseek_v3-rope-longrope": ("deepseek_v3", dict(rope_parameters={**_ROPE, "rope_type": "longrope"})),
    "qwen3_moe-mlp-only-names": ("qwen3_moe", dict(mlp_only_layers=["0"])),
    "qwen2_moe-mlp-only": ("qwen2_moe", dict(mlp_only_layers=[0])),
    "qwen2_moe-no-qkv-bias": ("qwen2_moe", dict(qkv_bias=False)),
    "qwen2_moe-dense-width": ("qwen2_moe-norm", dict(intermediate_size=96)),
    "gpt2-relu": ("gpt2", dict(activation_function="relu")),
    "gpt2-unscaled": ("gpt2", dict(scale_attn_weights=False)),
    "gpt2-inverse-layer": ("gpt2", dict(scale_attn_by_inverse_layer_idx=True)),
    "gpt2-upcast": ("gpt2", dict(reorder_and_upcast_attn=True)),
}
"""What the mapping refuses, each over a case it reads; the refusal is the case's outcome."""

CONTAINERS = {"rope_parameters", "rope_scaling"}
"""Keys that hold other keys: each of theirs is walked on its own."""


def _raw(name: str) -> dict[str, Any]:
    """The config.json transformers writes for a FAMILIES case (or a REFUSED case over one)."""
    if name in REFUSED:
        base, over = REFUSED[name]
        return {**_raw(base), **over}
    config_cls, fields = {**FAMILIES, **ROUTER_LOSS, **LOAD_REFUSED}[name]
    return json.loads(config_cls(**fields).to_json_string())


def _family(raw: dict[str, Any]) -> Family:
    return BY_TYPE[raw["model_type"]]


def _outcome(raw: dict[str, Any]) -> tuple[object, set[str]]:
    """(the shoal config or the refusal's text, the keys read)."""
    family = _family(raw)
    fields = Fields("config.json", {**family.defaults, **raw})
    try:
        return ModelConfig(**family.config_in(fields)), fields.read
    except ValueError as exc:
        return str(exc), fields.read


def _reset(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """`raw` with `key` at its default: the family's default, or left out (nested keys: left out)."""
    out = copy.deepcopy(raw)
    outer, _, inner = key.rpartition(".")
    if outer:
        for container in (outer, "rope_scaling"):
            if isinstance(out.get(container), dict):
                out[container].pop(inner, None)
        return out
    defaults = _family(raw).defaults
    if key in defaults:
        out[key] = copy.deepcopy(defaults[key])
    else:
        out.pop(key, None)
    return out


CASES = [*FAMILIES, *ROUTER_LOSS, *LOAD_REFUSED, *REFUSED]


def _walk() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({model_type: keys its mapping reads over every case}, {model_type: keys some case tests off
    their default})."""
    read: dict[str, set[str]] = {}
    tested: dict[str, set[str]] = {}
    for name in CASES:
        raw = _raw(name)
        outcome, keys = _outcome(raw)
        model_type = raw["model_type"]
        read.setdefault(model_type, set()).update(keys - CONTAINERS - {"model_type"})
        tested.setdefault(model_type, set()).update(
            k for k in keys - CONTAINERS if _outcome(_reset(raw, k))[0] != outcome)
    return read, tested


def test_every_read_field_has_a_case_off_its_default():
    read, tested = _walk()
    assert set(read) == set(BY_TYPE), "every family has a case"
    untested = {t: sorted(read[t] - tested[t]) for t in read if read[t] - tested[t]}
    assert not untested, f"fields read with no case off their default (add one to FAMILIES or REFUSED): {untested}"


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_cases_are_one_line_errors_naming_the_field(name):
    base, over = REFUSED[name]
    base_outcome, _ = _outcome(_raw(base))
    assert isinstance(base_outcome, ModelConfig), base_outcome
    message, _ = _outcome(_raw(name))
    assert isinstance(message, str) and "\n" not in message, message
    named = [k for k in over if k in message] + [k for k in over.get("rope_parameters", {}) if k in message]
    assert "valid:" in message and named, message


def test_walk_finds_a_field_left_at_its_default(monkeypatch):
    """Not vacuous: with llama3's low_freq_factor at its default in FAMILIES, the walk reports it."""
    config_cls, fields = FAMILIES["llama3"]
    rope = {**fields["rope_parameters"], "low_freq_factor": 1.0}
    monkeypatch.setitem(FAMILIES, "llama3", (config_cls, {**fields, "rope_parameters": rope}))
    read, tested = _walk()
    assert "rope_parameters.low_freq_factor" in read["llama"] - tested["llama"]
