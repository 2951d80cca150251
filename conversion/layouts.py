"""Weight layouts as data: a family's tensor names and fused projections, as rules that build its `Layout`.

A rule names a module on each side (`{n}` stands for a layer index); the module's tensors (`.weight`, `.bias`)
follow it:

- `Rename(stock, ours)`: the tensors move as they are. `transpose=True` for GPT-2/OpenAI-GPT's `Conv1D`, which stores
  its weight as (in, out) where archlab's `nn.Linear` stores (out, in). `when` names archlab config values the rule
  needs (Falcon's parallel and sequential blocks name the same archlab norms differently).
- `FusedQKV(stock, ours, split)`: one stock projection holds the query, key and value rows; archlab has
  `ours.q_proj`, `ours.k_proj`, `ours.v_proj` (H query heads, H_kv key/value heads, D channels each). `split` says
  how the rows are ordered:
      "concat"    [q (H·D); k (H_kv·D); v (H_kv·D)]                          MPT `Wqkv`, GPT-2 `c_attn`
      "per_head"  per head [q_h; k_h; v_h] (H_kv = H)                       BLOOM, GPT-NeoX `query_key_value`
      "grouped"   per key/value head [q (H/H_kv heads); k_g; v_g]          Falcon (every architecture)
  "per_head" is "grouped" with H_kv = H; Falcon's multi-query layout is "grouped" with H_kv = 1 (= "concat").
- `FusedGateUp(stock, ours)`: one stock projection holds a gated MLP's [gate; up] rows (Phi-3 `gate_up_proj`);
  archlab has `ours.gate_proj` and `ours.up_proj`.

`WeightRules(rules, base_prefix, ignore).layout()` is the `Layout` of a row. Rules are tried in order; exporting
writes the first rule that applies, so legacy stock names (GPT-NeoX's `embed_out`) come after the current ones.
Checkpoints saved from the stock base model lack `base_prefix` (`h.0...` for `transformer.h.0...`); `ignore` are
stock buffers that are not weights (causal-mask tables, rotary frequencies). Any other tensor a rule does not place
is refused with its name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from transformers import PreTrainedConfig

from .family import ConversionError, Layout, StateDict

SPLITS = ("concat", "per_head", "grouped")
_TENSORS = r"\.(?P<leaf>weight|bias)$"


def _pattern(path: str, alternatives: tuple[str, ...] = ()) -> re.Pattern:
    """`path.weight` / `path.bias` with `{n}` a layer index; `alternatives` are last components (`q_proj`, ...)."""
    body = re.escape(path).replace(re.escape("{n}"), r"(?P<n>\d+)")
    if alternatives:
        body += r"\.(?P<part>" + "|".join(alternatives) + ")"
    return re.compile("^" + body + _TENSORS)


def _fill(path: str, n: str | None, leaf: str) -> str:
    return f"{path.replace('{n}', n) if n is not None else path}.{leaf}"


def _applies(when: Mapping[str, Any], config: PreTrainedConfig) -> bool:
    return all(getattr(config, name) == value for name, value in when.items())


@dataclass(frozen=True)
class Rename:
    """Module `stock` is archlab's module `ours`; `transpose` for Conv1D weights."""

    stock: str
    ours: str
    transpose: bool = False
    when: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FusedQKV:
    """Module `stock` holds q, k and v in the `split` order; archlab's attention module `ours` holds them apart."""

    stock: str
    ours: str
    split: str
    transpose: bool = False

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"FusedQKV split {self.split!r} is not one of {SPLITS}.")


@dataclass(frozen=True)
class FusedGateUp:
    """Module `stock` holds a gated MLP's [gate; up] rows (Phi-3's `gate_up_proj`); archlab's MLP module `ours`
    holds `gate_proj` and `up_proj` apart."""

    stock: str
    ours: str
    transpose: bool = False


def _heads(config: PreTrainedConfig, split: str) -> tuple[int, int, int]:
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if split == "per_head" and kv_heads != heads:
        raise ConversionError(
            f"A per-head fused q/k/v projection has one key/value head per query head; this config has "
            f"num_attention_heads={heads}, num_key_value_heads={kv_heads}."
        )
    return heads, kv_heads, head_dim


def split_qkv(fused: torch.Tensor, split: str, config: PreTrainedConfig) -> tuple[torch.Tensor, ...]:
    """The (out, ...) rows of a fused projection (weight or bias) as q, k, v rows."""
    heads, kv_heads, head_dim = _heads(config, split)
    rest = fused.shape[1:]
    if split == "concat":
        return tuple(p.contiguous() for p in fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]))
    group = heads // kv_heads
    grouped = fused.reshape(kv_heads, group + 2, head_dim, *rest)
    return (
        grouped[:, :group].reshape(heads * head_dim, *rest).contiguous(),
        grouped[:, group].reshape(kv_heads * head_dim, *rest).contiguous(),
        grouped[:, group + 1].reshape(kv_heads * head_dim, *rest).contiguous(),
    )


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: str, config: PreTrainedConfig) -> torch.Tensor:
    """The inverse of `split_qkv`."""
    heads, kv_heads, head_dim = _heads(config, split)
    rest = q.shape[1:]
    if split == "concat":
        return torch.cat([q, k, v])
    group = heads // kv_heads
    parts = (
        q.reshape(kv_heads, group, head_dim, *rest),
        k.reshape(kv_heads, 1, head_dim, *rest),
        v.reshape(kv_heads, 1, head_dim, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _flip(tensor: torch.Tensor, transpose: bool) -> torch.Tensor:
    return tensor.t().contiguous() if transpose and tensor.ndim == 2 else tensor


_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def _parts(rule: Rename | FusedQKV | FusedGateUp) -> tuple[str, ...]:
    """The archlab modules a fused rule's stock module holds."""
    return _PROJECTIONS if isinstance(rule, FusedQKV) else _GATE_UP


@dataclass(frozen=True)
class WeightRules:
    """A family's weight layout: rules, the stock base-model prefix, and stock buffers to drop (regexes)."""

    rules: tuple[Rename | FusedQKV | FusedGateUp, ...]
    base_prefix: str = ""
    ignore: tuple[str, ...] = ()

    @cached_property
    def _patterns(self) -> dict[str, list[tuple[re.Pattern, Rename | FusedQKV | FusedGateUp]]]:
        """Per side ("stock", "ours"), each rule's pattern; a fused rule matches all three archlab projections."""
        return {
            "stock": [(_pattern(rule.stock), rule) for rule in self.rules],
            "ours": [
                (_pattern(rule.ours, _parts(rule)) if not isinstance(rule, Rename) else _pattern(rule.ours), rule)
                for rule in self.rules
            ],
        }

    def _match(
        self, key: str, side: str, config: PreTrainedConfig
    ) -> tuple[Rename | FusedQKV | FusedGateUp, re.Match] | None:
        for pattern, rule in self._patterns[side]:
            match = pattern.match(key)
            if match and (not isinstance(rule, Rename) or _applies(rule.when, config)):
                return rule, match
        return None

    def to_archlab(self, state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
        out: StateDict = {}
        unknown = []
        for key, tensor in state_dict.items():
            if any(re.search(pattern, key) for pattern in self.ignore):
                continue
            found = self._match(key, "stock", config)
            if found is None and self.base_prefix:  # saved from the base model: no `transformer.` in front
                found = self._match(f"{self.base_prefix}.{key}", "stock", config)
            if found is None:
                unknown.append(key)
                continue
            rule, match = found
            n, leaf = match.groupdict().get("n"), match.group("leaf")
            tensor = _flip(tensor, rule.transpose)
            if isinstance(rule, FusedQKV):
                for name, part in zip(_PROJECTIONS, split_qkv(tensor, rule.split, config)):
                    out[_fill(f"{rule.ours}.{name}", n, leaf)] = part
            elif isinstance(rule, FusedGateUp):
                for name, part in zip(_GATE_UP, tensor.chunk(2)):
                    out[_fill(f"{rule.ours}.{name}", n, leaf)] = part.contiguous()
            else:
                out[_fill(rule.ours, n, leaf)] = tensor
        if unknown:
            raise ConversionError(f"Tensors the converter does not know for this family: {unknown[:5]}.")
        return out

    def from_archlab(self, state_dict: StateDict, config: PreTrainedConfig) -> StateDict:
        out: StateDict = {}
        unknown = []
        for key, tensor in state_dict.items():
            found = self._match(key, "ours", config)
            if found is None:
                unknown.append(key)
                continue
            rule, match = found
            n, leaf = match.groupdict().get("n"), match.group("leaf")
            if isinstance(rule, FusedQKV):
                if match.group("part") != "q_proj":
                    continue  # joined with the query
                parts = [state_dict[_fill(f"{rule.ours}.{name}", n, leaf)] for name in _PROJECTIONS]
                tensor = join_qkv(*parts, rule.split, config)
            elif isinstance(rule, FusedGateUp):
                if match.group("part") != "gate_proj":
                    continue  # joined with the gate
                tensor = torch.cat([state_dict[_fill(f"{rule.ours}.{name}", n, leaf)] for name in _GATE_UP])
            out[_fill(rule.stock, n, leaf)] = _flip(tensor, rule.transpose)
        if unknown:
            raise ConversionError(f"archlab tensors this family has no place for: {unknown[:5]}.")
        return out

    def layout(self) -> Layout:
        return Layout(to_archlab=self.to_archlab, from_archlab=self.from_archlab)


__all__ = ["FusedGateUp", "FusedQKV", "Rename", "SPLITS", "WeightRules", "join_qkv", "split_qkv"]
